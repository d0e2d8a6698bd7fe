from meshrun.cli import main

main()
