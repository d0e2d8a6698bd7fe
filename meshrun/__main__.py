from meshrun.cli.main import main

main()
