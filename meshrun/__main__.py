"""`python -m meshrun`: the same command line as `meshrun`."""

from meshrun.cli import main

main()
