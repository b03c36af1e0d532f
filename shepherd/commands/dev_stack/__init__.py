"""The parts of ``shepherd dev``'s embedded stack; shepherd.commands.dev runs it."""
