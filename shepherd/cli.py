"""The ``shepherd`` command: one subcommand a module in shepherd/commands/.

A bad setting or an unreachable service ends the command with one line naming
the problem and a non-zero exit code: 1 when the command could not do its job,
2 for arguments or settings it cannot run with.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from temporalio.service import RPCError

from bmdb.store import BMDBUnavailable
from foundation.logs import configure_logging
from foundation.setting_values import SettingsError
from foundation.startup import StartupError
from shepherd.commands import (
    api,
    api_key,
    approvals,
    config,
    decommission,
    dev,
    doctor,
    events,
    fleet,
    heartbeat_server,
    inventory,
    login,
    machines,
    maintenance,
    migrate,
    provider,
    recover,
    release,
    reset_host_key,
    restart_agent,
    sim,
    ssh_key,
    status,
    worker,
)
from shepherd.commands.base import EXIT_FAILURE, EXIT_USAGE, CommandError, UsageError, resolve_settings

# In the order `shepherd -h` lists them.
COMMANDS = (
    dev,
    worker,
    migrate,
    heartbeat_server,
    api,
    recover,
    restart_agent,
    release,
    maintenance,
    decommission,
    reset_host_key,
    approvals,
    doctor,
    machines,
    status,
    events,
    fleet,
    config,
    login,
    ssh_key,
    api_key,
    inventory,
    provider,
    sim,
)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand, each as its module describes it."""
    parser = argparse.ArgumentParser(prog="shepherd", description="Bare-metal fleet manager on Temporal.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(commands)
    return parser


def run_and_exit() -> NoReturn:
    """The `shepherd` executable: main, then leave without the interpreter's finalization.

    The Temporal SDK's native threads outlive every client and cannot be stopped; when one calls back into
    Python while the interpreter finalizes, the process aborts ("Fatal Python error: PyGILState_Release")
    instead of exiting with its status. Every command has closed what it opened by now, so what finalization
    would still do is flush the standard streams and the log handlers: done here.
    """
    code = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv (default: the process's arguments) and run the command it names; the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sim"]:
        # The simulator parses its own arguments, help included.
        return sim.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(verbose=args.verbose)
    try:
        return _run(args)
    except UsageError as error:
        parser.error(str(error))
    except (SettingsError, CommandError) as error:
        print(f"shepherd {args.command}: {error}", file=sys.stderr)
        return EXIT_USAGE if isinstance(error, SettingsError) else EXIT_FAILURE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`shepherd machines | head`): nothing more to say, and nowhere to say it.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE


def _run(args: argparse.Namespace) -> int:
    settings = resolve_settings(args)[0].check()
    configure_logging(settings.log_format, verbose=args.verbose)
    try:
        code: int = args.run(settings, args)
        return code
    except StartupError as error:
        raise CommandError(str(error)) from None
    except RPCError as error:
        raise CommandError(f"Temporal refused: {error.message}") from None
    except BMDBUnavailable as error:
        raise CommandError(f"{error} (setting database_url)") from None
