"""The checks of ``shepherd doctor``, a module for each part they check; shepherd.commands.doctor runs them."""
