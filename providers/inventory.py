"""The static provider's inventory: a TOML file of [[machines]] the operator owns, each field checked on reading.

A machine is an id, where SSH reaches it, and optionally its BMC (Redfish), whose password stays in a file only
its owner reads, or in a variable, until the BMC is used.
"""

from __future__ import annotations

import ipaddress
import os
import re
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from providers import Availability, ProviderError, ProviderMachine
from providers.redfish import RedfishEndpoint

INVENTORY_ID = re.compile(r"[A-Za-z0-9._-]{1,63}")
_USER = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]{0,31}")
_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# TOML allows spaces and a quoted key inside the brackets of an array-of-tables header.
_HEADER = re.compile(r"""^[ \t]*\[\[[ \t]*(?:machines|"machines"|'machines')[ \t]*\]\]""", re.MULTILINE)

_MACHINE_KEYS = ("id", "ssh", "ssh_user", "location", "bmc")
_BMC_KEYS = ("type", "url", "system", "username", "password_file", "password_env", "ca_file", "verify_tls")


class InventoryError(ProviderError):
    """The inventory (or a password it points to) is wrong; the operator must fix it, the next pass re-reads it."""

    retryable = False


@dataclass(frozen=True)
class BMCConfig:
    """How to reach a machine's BMC; the password stays in its file or variable until the BMC is used."""

    type: str
    url: str
    system: str | None
    username: str
    password_file: Path | None = None
    password_env: str | None = None
    ca_file: Path | None = None
    verify_tls: bool = True

    def endpoint(self, machine: str, provider: str = "static") -> RedfishEndpoint:
        """The BMC endpoint with the password read now; InventoryError when it cannot be read."""
        return RedfishEndpoint(
            machine=machine,
            url=self.url,
            username=self.username,
            password=self._password(machine, provider),
            system=self.system,
            verify=str(self.ca_file) if self.ca_file is not None else self.verify_tls,
        )

    def _password(self, machine: str, provider: str) -> str:
        """The BMC password, read now from its variable or file; InventoryError when it cannot serve."""
        if self.password_env is not None:
            where = f"machine {machine!r}: BMC password variable {self.password_env}"
            password = os.environ.get(self.password_env)
            if password is None:
                raise InventoryError(provider, f"{where} is not set")
        else:
            assert self.password_file is not None  # load_inventory demands one of the two
            where = f"machine {machine!r}: BMC password file {self.password_file}"
            password = _read_secret(self.password_file, where, provider)
        if not password:
            raise InventoryError(provider, f"{where} is empty")
        return password


def _password_file_problem(path: Path) -> str | None:
    """Why the password file cannot serve, seen from its metadata alone (every pass checks; only a reboot reads it)."""
    try:
        mode = path.stat().st_mode
    except OSError as error:
        return f"cannot be read: {error.strerror or type(error).__name__}"
    if not stat.S_ISREG(mode):
        return "is not a regular file"
    if mode & 0o077:
        return f"is readable by others (mode {stat.S_IMODE(mode):04o}); run: chmod 600 {path}"
    return None


def password_file_refusal(inventory: Path, provider: str, machine: InventoryMachine) -> InventoryError | None:
    """Why the machine's BMC password file cannot serve, as load_inventory words it; None when it can."""
    if machine.bmc is None or machine.bmc.password_file is None:
        return None
    unusable = _password_file_problem(machine.bmc.password_file)
    if unusable is None:
        return None
    return _inventory_error(
        inventory, provider, f"BMC password file {machine.bmc.password_file} {unusable}", machine.line, machine.id
    )


def _inventory_error(
    path: Path, provider: str, problem: str, line: int = 0, machine: str | None = None
) -> InventoryError:
    """The problem, prefixed with where in the inventory it is."""
    where = f"inventory {path}" + (f" line {line}" if line else "")
    where += f" machine {machine!r}" if machine else ""
    return InventoryError(provider, f"{where}: {problem}")


def _read_secret(path: Path, where: str, provider: str) -> str:
    """The text of a password file that only its owner can read, without its trailing newline."""
    try:
        # fstat of the opened file, not stat of the path: the mode checked is the mode of what is read.
        with path.open("rb") as file:
            mode = os.fstat(file.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise InventoryError(provider, f"{where} is not a regular file")
            if mode & 0o077:
                raise InventoryError(
                    provider,
                    f"{where} is readable by others (mode {stat.S_IMODE(mode):04o}); run: chmod 600 {path}",
                )
            data = file.read()
    except OSError as error:
        raise InventoryError(provider, f"{where} cannot be read: {error.strerror or type(error).__name__}") from None
    try:
        return data.decode().rstrip("\r\n")
    except UnicodeDecodeError:
        raise InventoryError(provider, f"{where} is not UTF-8 text") from None


@dataclass(frozen=True)
class InventoryMachine:
    """One machine of the inventory; line is its [[machines]] header's line (0 when unknown)."""

    id: str
    host: str
    port: int = 22
    # None: the ssh_user setting (default root), the one place that default lives.
    ssh_user: str | None = None
    bmc: BMCConfig | None = None
    line: int = 0
    location: str | None = None

    def provider_machine(self) -> ProviderMachine:
        """The machine as the Provider interface shows it; BMDB decides whether it is ours."""
        return ProviderMachine(
            provider_id=self.id,
            availability=Availability.POSSIBLY_USED,
            address=self.host,
            ssh_port=self.port,
            location=self.location,
            status="listed",
            ssh_user=self.ssh_user,
        )


class _Refusal(Exception):
    """A problem of one machine's entry, before the file, line and id are added to it."""


def load_inventory(path: Path, provider: str = "static") -> list[InventoryMachine]:
    """The machines of the inventory at path, every field checked; InventoryError naming the first problem."""

    def refuse(problem: str, line: int = 0, machine: str | None = None) -> InventoryError:
        return _inventory_error(path, provider, problem, line, machine)

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
        raise refuse(f"cannot be read: {reason or type(error).__name__}") from None
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        # tomllib's message carries the line and column.
        raise refuse(f"is not valid TOML: {error}") from None
    unknown = sorted(set(document) - {"machines"})
    if unknown:
        raise refuse(f"unknown top-level key(s) {', '.join(map(repr, unknown))}; machines are [[machines]] tables")
    tables = document.get("machines", [])
    if not isinstance(tables, list) or not all(isinstance(table, dict) for table in tables):
        raise refuse("'machines' must be a list of [[machines]] tables")
    # tomllib keeps no positions, so the n-th header is the n-th table; inline arrays have no header lines.
    # Counted from one header to the next: counting from the top for each would be quadratic in the inventory.
    headers: list[int] = []
    line, counted_to = 1, 0
    for match in _HEADER.finditer(text):
        line += text.count("\n", counted_to, match.start())
        counted_to = match.start()
        headers.append(line)
    lines = headers if len(headers) == len(tables) else [0] * len(tables)

    machines: list[InventoryMachine] = []
    seen: dict[str, int] = {}
    for table, line in zip(tables, lines, strict=True):
        raw_id = table.get("id")
        machine_id = raw_id if isinstance(raw_id, str) and INVENTORY_ID.fullmatch(raw_id) else None
        try:
            machine = _machine(table, line, path.parent)
        except _Refusal as problem:
            raise refuse(str(problem), line, machine_id) from None
        if machine.id in seen:
            first = f"line {seen[machine.id]}" if seen[machine.id] else "an earlier table"
            raise refuse(f"duplicate id, first listed at {first}", line, machine.id)
        refusal = password_file_refusal(path, provider, machine)
        if refusal is not None:
            raise refusal
        seen[machine.id] = line
        machines.append(machine)
    return machines


def _machine(table: dict[str, Any], line: int, base: Path) -> InventoryMachine:
    """One [[machines]] table, checked; _Refusal with the problem."""
    _known_keys(table, _MACHINE_KEYS, "")
    machine_id = table.get("id")
    if machine_id is None:
        raise _Refusal("missing id")
    if not isinstance(machine_id, str) or not INVENTORY_ID.fullmatch(machine_id):
        raise _Refusal(f"id must match {INVENTORY_ID.pattern}, got {machine_id!r}")
    host, port = _ssh_address(table.get("ssh"))
    user = table.get("ssh_user")
    if user is not None and (not isinstance(user, str) or not _USER.fullmatch(user)):
        raise _Refusal(f"ssh_user must be a user name ({_USER.pattern}), got {user!r}")
    location = table.get("location")
    if location is not None and not isinstance(location, str):
        raise _Refusal(f"location must be a string, got {location!r}")
    bmc = table.get("bmc")
    if bmc is not None and not isinstance(bmc, dict):
        raise _Refusal("bmc must be a [machines.bmc] table")
    return InventoryMachine(
        id=machine_id,
        host=host,
        port=port,
        ssh_user=user,
        bmc=_bmc(bmc, base) if bmc is not None else None,
        line=line,
        location=location,
    )


def _known_keys(table: dict[str, Any], known: tuple[str, ...], prefix: str) -> None:
    """_Refusal for an inline password or a key the table does not know."""
    if prefix and "password" in table:
        raise _Refusal(f"{prefix}password: never inline: use password_file or password_env")
    unknown = sorted(set(table) - set(known))
    if unknown:
        names = ", ".join(repr(prefix + key) for key in unknown)
        raise _Refusal(f"unknown key(s) {names} (known: {', '.join(prefix + key for key in known)})")


def _ssh_address(value: Any) -> tuple[str, int]:
    """(host, port) of host[:port] or [IPv6]:port; host without brackets, as SSH clients take it."""
    if value is None:
        raise _Refusal("missing ssh (host[:port])")
    if not isinstance(value, str):
        raise _Refusal(f"ssh must be a string host[:port], got {value!r}")
    bad = _Refusal(f"ssh must be host[:port] or [IPv6]:port, got {value!r}")
    if value.startswith("["):
        host, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise bad
        port_text = rest[1:] if rest else None
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise _Refusal(f"ssh: {host!r} is not an IPv6 address") from None
    elif value.count(":") > 1:
        raise _Refusal(f"ssh: an IPv6 address goes in brackets, [{value}] or [{value}]:22")
    else:
        host, colon, port_text_or_empty = value.partition(":")
        port_text = port_text_or_empty if colon else None
        if not _HOSTNAME.fullmatch(host):
            raise bad
    if port_text is None:
        return host, 22
    if not port_text.isascii() or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise _Refusal(f"ssh: port must be 1-65535, got {port_text!r} in {value!r}")
    return host, int(port_text)


def _bmc(table: dict[str, Any], base: Path) -> BMCConfig:
    """One [machines.bmc] table, checked; relative paths are relative to the inventory's folder."""
    _known_keys(table, _BMC_KEYS, "bmc.")
    kind = table.get("type")
    if kind != "redfish":
        raise _Refusal(f"bmc.type must be 'redfish', got {kind!r}")
    url = table.get("url")
    if isinstance(url, str) and "@" in url:
        # Not echoed: what precedes the @ may be a password.
        raise _Refusal("bmc.url must not carry credentials: use username and password_file or password_env")
    bad_url = _Refusal(f"bmc.url must be an http:// or https:// URL, got {url!r}")
    if not isinstance(url, str):
        raise bad_url
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - urlsplit checks the port only when asked for it
    except ValueError:
        raise bad_url from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise bad_url
    system = table.get("system")
    if system is not None and (not isinstance(system, str) or not system.startswith("/")):
        raise _Refusal(f"bmc.system must be a path such as /redfish/v1/Systems/1, got {system!r}")
    username = table.get("username")
    if username is None:
        raise _Refusal("missing bmc.username")
    if not isinstance(username, str) or not username:
        raise _Refusal(f"bmc.username must be a non-empty string, got {username!r}")
    password_file, password_env = table.get("password_file"), table.get("password_env")
    if (password_file is None) == (password_env is None):
        raise _Refusal("bmc needs exactly one of password_file and password_env")
    if password_file is not None and (not isinstance(password_file, str) or not password_file):
        raise _Refusal(f"bmc.password_file must be a path, got {password_file!r}")
    if password_env is not None and (not isinstance(password_env, str) or not _ENV_NAME.fullmatch(password_env)):
        raise _Refusal(f"bmc.password_env must be an environment variable name, got {password_env!r}")
    ca_file = table.get("ca_file")
    if ca_file is not None and (not isinstance(ca_file, str) or not ca_file):
        raise _Refusal(f"bmc.ca_file must be a path, got {ca_file!r}")
    verify_tls = table.get("verify_tls", True)
    if not isinstance(verify_tls, bool):
        raise _Refusal(f"bmc.verify_tls must be true or false, got {verify_tls!r}")
    if not verify_tls and ca_file is not None:
        raise _Refusal("bmc: verify_tls = false and ca_file contradict each other; keep one")
    return BMCConfig(
        type=kind,
        url=url.rstrip("/"),
        username=username,
        system=system,
        password_file=base / password_file if password_file is not None else None,
        password_env=password_env,
        ca_file=base / ca_file if ca_file is not None else None,
        verify_tls=verify_tls,
    )
