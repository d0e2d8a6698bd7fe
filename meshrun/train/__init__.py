"""Training helpers for scripts that `meshrun train` runs: DiLoCo (meshrun.train.diloco), and `report`, which
tells `meshrun jobs` how far a job is (meshrun.train.progress)."""

from meshrun.train.progress import report

__all__ = ["report"]
