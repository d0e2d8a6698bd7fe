"""The `meshrun` command line: one small module per command group over one Application."""
