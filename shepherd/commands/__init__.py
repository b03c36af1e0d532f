"""The ``shepherd`` subcommands, one module each."""
