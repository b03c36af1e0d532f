"""`shepherd login` against a real OIDC provider: the device flow, the tokens kept 0600, refreshed, and each way a
login ends."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import stat
from pathlib import Path

import pytest

from foundation.login_tokens import TokenCacheError, load_login, tokens_path
from foundation.oidc_client import DeviceLogin, LoginError, OidcClient, wait_after
from foundation.operator_login import NotLoggedIn, access_token, log_in, log_out
from foundation.operator_tokens import TokenVerifier
from foundation.settings import Settings
from shepherd.cli import main
from tests.oidc_fixtures import (
    CLI_CLIENT,
    CLI_CLIENT_BRIEF_CODES,
    CLI_CLIENT_BRIEF_TOKENS,
    OidcProvider,
    oidc_fixture,  # noqa: F401
)


def login_settings(oidc: OidcProvider, client_id: str = CLI_CLIENT) -> Settings:
    return Settings(oidc_issuer=oidc.issuer, oidc_audience=oidc.audience, oidc_client_id=client_id)


def login_env(oidc: OidcProvider, config_home: Path, client_id: str = CLI_CLIENT) -> dict[str, str]:
    clean = {name: value for name, value in os.environ.items() if not name.startswith("SHEPHERD_")}
    return {
        **clean,
        "SHEPHERD_OIDC_ISSUER": oidc.issuer,
        "SHEPHERD_OIDC_AUDIENCE": oidc.audience,
        "SHEPHERD_OIDC_CLIENT_ID": client_id,
        "XDG_CONFIG_HOME": str(config_home),
    }


async def logged_in(oidc: OidcProvider, settings: Settings, path: Path, user: str, *, consent: bool = True):
    """log_in, with the user doing their part in the browser as soon as the code is shown."""
    approvals: list[asyncio.Task[str]] = []

    def show(device: DeviceLogin) -> None:
        approvals.append(asyncio.create_task(oidc.approve_device_login(device.user_code, user, consent=consent)))

    try:
        return await log_in(settings, show, path=path)
    finally:
        await asyncio.gather(*approvals)


async def test_shepherd_login_keeps_the_tokens_for_the_operator_alone_until_logout(oidc, tmp_path):
    config_home = tmp_path / "config"
    env = login_env(oidc, config_home)
    lines: asyncio.Queue[str] = asyncio.Queue()
    printed = Printed(asyncio.get_running_loop(), lines)
    command = asyncio.create_task(asyncio.to_thread(cli, ["login"], env, printed))
    first = await asyncio.wait_for(lines.get(), 60)
    shown = re.fullmatch(r"To log in, open (\S+) and enter the code (\S+)\n", first)
    assert shown is not None, first
    assert shown.group(1) == f"{oidc.issuer}/device"
    await oidc.approve_device_login(shown.group(2), "alice")
    code, out, err = await command
    assert code == 0, err
    last = out.splitlines()[-1]
    assert last.startswith(f"Logged in at {oidc.issuer} as alice (groups: shepherd-admins); the access token is good")
    assert last.endswith("then renewed with the refresh token.")

    path = config_home / "shepherd" / "tokens.json"
    assert tokens_path({"XDG_CONFIG_HOME": str(config_home)}) == path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == stat.S_IMODE(config_home.stat().st_mode) == 0o700
    kept = load_login(path)
    assert kept is not None and kept.refresh_token and (kept.subject, kept.groups) == ("alice", ("shepherd-admins",))

    # Within its lifetime the kept token is what a client of the API gets, and the API accepts it.
    token = await access_token(login_settings(oidc), path=path)
    assert token == kept.access_token
    async with TokenVerifier(oidc.issuer, oidc.audience) as verifier:
        assert (await verifier.verify(token)).subject == "alice"

    status = await asyncio.to_thread(cli, ["login", "--status"], env)
    assert status[0] == 0, status
    assert status[1].splitlines()[0] == (
        f"Logged in at {oidc.issuer} as alice (groups: shepherd-admins), through client {CLI_CLIENT} for "
        f"{oidc.audience}."
    )
    assert status[1].splitlines()[1].startswith("The access token is good until ")

    logout = await asyncio.to_thread(cli, ["logout"], env)
    said = f"Logged out alice at {oidc.issuer}: forgot the tokens; refresh token revoked at the issuer.\n"
    assert logout[:2] == (0, said)
    assert not path.exists()
    async with OidcClient(oidc.issuer, CLI_CLIENT, oidc.audience) as client:
        with pytest.raises(LoginError, match="the issuer refused to refresh the login: invalid_grant"):
            await client.refresh(kept.refresh_token)
    after = await asyncio.to_thread(cli, ["login", "--status"], env)
    assert after == (1, "", f"shepherd login: not logged in at {oidc.issuer}; run shepherd login\n")


def cli(args: list[str], env: dict[str, str], out: io.StringIO | None = None) -> tuple[int, str, str]:
    """Run the shepherd command in this process with env as its environment: (exit status, stdout, stderr)."""
    out, err = out or io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(args)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return code, out.getvalue(), err.getvalue()


class Printed(io.StringIO):
    """A command's stdout that also hands each line to a queue of the test's event loop as it is printed."""

    def __init__(self, loop: asyncio.AbstractEventLoop, lines: asyncio.Queue[str]) -> None:
        super().__init__()
        self.loop, self.lines, self.line = loop, lines, ""

    def write(self, text: str) -> int:
        self.line += text
        while "\n" in self.line:
            line, self.line = self.line.split("\n", 1)
            self.loop.call_soon_threadsafe(self.lines.put_nowait, line + "\n")
        return super().write(text)


async def test_an_access_token_about_to_expire_is_refreshed_until_the_login_is_revoked(oidc, tmp_path):
    settings = login_settings(oidc, CLI_CLIENT_BRIEF_TOKENS)  # access tokens of 5 s: inside the refresh margin
    path = tmp_path / "shepherd" / "tokens.json"
    first = await logged_in(oidc, settings, path, "bob")
    token = await access_token(settings, path=path)
    assert token != first.access_token
    renewed = load_login(path)
    assert renewed is not None and renewed.access_token == token
    assert renewed.refresh_token not in (None, first.refresh_token)  # the provider rotates refresh tokens
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    async with TokenVerifier(oidc.issuer, oidc.audience) as verifier:
        assert (await verifier.verify(token)).subject == "bob"

    async with OidcClient(oidc.issuer, settings.oidc_client_id, oidc.audience) as client:
        assert renewed.refresh_token is not None and await client.revoke(renewed.refresh_token)
    with pytest.raises(NotLoggedIn, match=f"the login at {re.escape(oidc.issuer)} has ended .*invalid_grant"):
        await access_token(settings, path=path)
    assert not path.exists()


async def test_a_denied_login_says_so_and_keeps_nothing(oidc, tmp_path):
    path = tmp_path / "tokens.json"
    with pytest.raises(LoginError, match=r"^the login was denied at the issuer$"):
        await logged_in(oidc, login_settings(oidc), path, "alice", consent=False)
    assert not path.exists()


async def test_a_code_nobody_enters_expires(oidc, tmp_path):
    path = tmp_path / "tokens.json"
    async with OidcClient(oidc.issuer, CLI_CLIENT_BRIEF_CODES, oidc.audience) as client:
        device = await client.start_device_login()  # good for 2 s
        assert device.interval == 1
        with pytest.raises(LoginError, match=r"^the code expired before the login was approved; run shepherd login"):
            await client.wait_for_tokens(device)
    assert not path.exists()


def test_the_poll_keeps_the_interval_and_slows_down_when_asked():
    assert wait_after("authorization_pending", "", 5.0) == 5.0
    assert wait_after("slow_down", "", 5.0) == 10.0
    assert wait_after("slow_down", "", 10.0) == 15.0
    with pytest.raises(LoginError) as caught:
        wait_after("invalid_client", "no such client\x1b[2J", 5.0)
    assert str(caught.value) == "the issuer refused the login: invalid_client: no such client [2J"  # no escape


async def test_a_login_elsewhere_or_a_tokens_file_others_can_read_is_not_used(oidc, tmp_path):
    path = tmp_path / "shepherd" / "tokens.json"
    with pytest.raises(NotLoggedIn, match=f"^not logged in at {re.escape(oidc.issuer)}; run shepherd login$"):
        await access_token(login_settings(oidc), path=path)
    await logged_in(oidc, login_settings(oidc), path, "alice")
    elsewhere = login_settings(oidc).replace(oidc_audience="https://other.test/api")
    with pytest.raises(NotLoggedIn, match=r"not at the configured .* audience https://other\.test/api"):
        await access_token(elsewhere, path=path)

    path.chmod(0o644)
    with pytest.raises(TokenCacheError, match=f"the tokens file {re.escape(str(path))} is readable by others"):
        await access_token(login_settings(oidc), path=path)
    done = await log_out(path=path)
    assert done.removed and done.login is None and not path.exists()


def test_login_names_the_settings_it_needs(tmp_path):
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    code, _, err = cli(["login"], env)
    assert code == 2 and "setting oidc_issuer (SHEPHERD_OIDC_ISSUER): must be set" in err
    code, _, err = cli(["login", "--status"], {**env, "SHEPHERD_OIDC_ISSUER": "http://idp.example.net"})
    assert code == 2 and "setting oidc_issuer (SHEPHERD_OIDC_ISSUER): must be an https:// URL" in err
    issuer = {"SHEPHERD_OIDC_ISSUER": "https://idp.example.net", "SHEPHERD_OIDC_AUDIENCE": "https://shepherd.test"}
    code, _, err = cli(["login"], {**env, **issuer})
    assert code == 2 and "setting oidc_client_id (SHEPHERD_OIDC_CLIENT_ID): must be set" in err
    assert cli(["logout"], env) == (0, "Not logged in.\n", "")
