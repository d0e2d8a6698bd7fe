"""Training helpers for scripts that `meshrun train` runs (DiLoCo)."""
