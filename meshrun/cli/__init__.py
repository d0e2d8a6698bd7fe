"""The `meshrun` command line: one small module per command group over one Application.

`app` is the typer root with every command registered; `main` is the console entry point.
"""

from meshrun.cli import (  # noqa: F401  (register commands)
    bench,
    coordinator,
    demo,
    network,
    node,
    service,
    status,
    train,
)
from meshrun.cli.app import root as app


def main() -> None:
    app(prog_name="meshrun")
