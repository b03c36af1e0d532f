"""The ``shepherd`` command: cli.py, and one module per subcommand in commands/."""
