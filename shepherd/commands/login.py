"""``shepherd login`` and ``shepherd logout``: an operator's login at the organisation's OIDC issuer.

``login`` runs the device flow: it prints a page and a code, the operator opens the page in any browser, enters
the code and logs in there, and the command waits until the login is approved, denied or expired. The tokens are
kept for the operator alone (foundation/login_tokens.py) and refreshed as needed by what talks to the operator
API. ``login --status`` says who is logged in, where, and until when; ``logout`` forgets the tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Iterator
from datetime import UTC, datetime

from foundation.login_tokens import CachedLogin, TokenCacheError
from foundation.oidc_client import DeviceLogin, LoginError
from foundation.oidc_issuer import IssuerUnavailable
from foundation.operator_login import current_login, log_in, log_out
from foundation.setting_values import format_duration
from foundation.settings import Settings
from shepherd.commands.base import EXIT_OK, CommandError, Subcommands, add_common


def register(commands: Subcommands) -> None:
    """Add ``shepherd login`` and ``shepherd logout`` to the commands."""
    login = commands.add_parser("login", help="log in at the OIDC issuer (device flow); --status: who is logged in")
    add_common(login)
    login.add_argument("--status", action="store_true", help="say who is logged in and until when; change nothing")
    login.set_defaults(run=run)
    logout = commands.add_parser("logout", help="forget the tokens of shepherd login, and revoke them at the issuer")
    add_common(logout)
    logout.set_defaults(run=run_logout)


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Log in through the device flow, or with --status say who is logged in."""
    settings.check_login()
    with _login_errors():
        if args.status:
            for line in status_lines(current_login(settings), time.time()):
                print(line)
            return EXIT_OK
        login = asyncio.run(log_in(settings, _show))
    print(f"Logged in at {login.issuer} as {_who(login)}; {_until(login, time.time())}.")
    return EXIT_OK


def run_logout(settings: Settings, args: argparse.Namespace) -> int:
    """Forget the kept tokens and ask the issuer to revoke the refresh token."""
    with _login_errors():
        done = asyncio.run(log_out())
    if done.login is None:
        print("Removed an unreadable tokens file." if done.removed else "Not logged in.")
        return EXIT_OK
    revoked = "revoked at the issuer" if done.revoked else "not revoked: the issuer could not be asked or offers none"
    print(f"Logged out {done.login.subject} at {done.login.issuer}: forgot the tokens; refresh token {revoked}.")
    return EXIT_OK


def status_lines(login: CachedLogin, now: float) -> list[str]:
    """What `shepherd login --status` says of a login."""
    return [
        f"Logged in at {login.issuer} as {_who(login)}, through client {login.client_id} for {login.audience}.",
        f"{_sentence(_until(login, now))}.",
    ]


def _show(device: DeviceLogin) -> None:
    # Flushed: the operator needs the code now, not when a pipe's buffer fills.
    print(f"To log in, open {device.verification_uri} and enter the code {device.user_code}", flush=True)
    if device.verification_uri_complete:
        print(f"  (or open {device.verification_uri_complete})", flush=True)
    left = _left(device.expires_at, time.time())
    print(f"Waiting for the login to be approved; the code is good for {left}.", flush=True)


def _who(login: CachedLogin) -> str:
    groups = ", ".join(login.groups) if login.groups else "none"
    return f"{login.subject} (groups: {groups})"


def _until(login: CachedLogin, now: float) -> str:
    when = datetime.fromtimestamp(login.expires_at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    if login.expires_at <= now:
        then = "renewed with the refresh token at the next use" if login.refresh_token else "log in again"
        return f"the access token expired at {when}; {then}"
    then = "then renewed with the refresh token" if login.refresh_token else "then log in again"
    return f"the access token is good until {when} (in {_left(login.expires_at, now)}), {then}"


def _left(until: float, now: float) -> str:
    return format_duration(max(0.0, round(until - now)))


@contextlib.contextmanager
def _login_errors() -> Iterator[None]:
    """A login that cannot be made or used ends the command with why."""
    try:
        yield
    except (LoginError, IssuerUnavailable, TokenCacheError) as error:
        raise CommandError(str(error)) from None


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]
