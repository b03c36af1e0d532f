"""The static provider's inventory: a TOML file of [[machines]] the operator owns, each field checked on reading.

A machine is an id, where SSH reaches it, and optionally its BMC (providers.inventory_bmc: Redfish or IPMI), whose
password stays in a file only its owner reads, or in a variable, until the BMC is used; where each may be is the
settings' to say (providers.bmc_secrets).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundation.secret_files import secret_file_problem
from providers import Availability, ProviderMachine
from providers.bmc_secrets import BmcSecretRules, PasswordFileCheck
from providers.inventory_bmc import (
    BMCConfig,
    InventoryError,
    Refusal,
    bmc_config,
    known_keys,
)
from providers.ssh_address import parse_ssh_address

INVENTORY_ID = re.compile(r"[A-Za-z0-9._-]{1,63}")
_USER = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]{0,31}")
# TOML allows spaces and a quoted key inside the brackets of an array-of-tables header.
_HEADER = re.compile(r"""^[ \t]*\[\[[ \t]*(?:machines|"machines"|'machines')[ \t]*\]\]""", re.MULTILINE)

_MACHINE_KEYS = ("id", "ssh", "ssh_user", "location", "bmc")


def password_file_refusal(
    inventory: Path, provider: str, machine: InventoryMachine, check: PasswordFileCheck
) -> InventoryError | None:
    """Why the machine's BMC password file cannot serve, as load_inventory words it; None when it can. check is the
    pass's check of where the file is; the file's own metadata is read here, nothing of its content."""
    if machine.bmc is None or machine.bmc.password_file is None:
        return None
    unusable = check.refusal(machine.bmc.password_file) or secret_file_problem(machine.bmc.password_file)
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


def load_inventory(path: Path, provider: str = "static", *, secrets: BmcSecretRules) -> list[InventoryMachine]:
    """The machines of the inventory at path, every field checked, BMC passwords against the secrets' rules;
    InventoryError naming the first problem."""

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
    check = secrets.file_check()
    for table, line in zip(tables, lines, strict=True):
        raw_id = table.get("id")
        machine_id = raw_id if isinstance(raw_id, str) and INVENTORY_ID.fullmatch(raw_id) else None
        try:
            machine = _machine(table, line, path.parent, secrets)
        except Refusal as problem:
            raise refuse(str(problem), line, machine_id) from None
        if machine.id in seen:
            first = f"line {seen[machine.id]}" if seen[machine.id] else "an earlier table"
            raise refuse(f"duplicate id, first listed at {first}", line, machine.id)
        refusal = password_file_refusal(path, provider, machine, check)
        if refusal is not None:
            raise refusal
        seen[machine.id] = line
        machines.append(machine)
    return machines


def _machine(table: dict[str, Any], line: int, base: Path, secrets: BmcSecretRules) -> InventoryMachine:
    """One [[machines]] table, checked; Refusal with the problem."""
    known_keys(table, _MACHINE_KEYS, "")
    machine_id = table.get("id")
    if machine_id is None:
        raise Refusal("missing id")
    if not isinstance(machine_id, str) or not INVENTORY_ID.fullmatch(machine_id):
        raise Refusal(f"id must match {INVENTORY_ID.pattern}, got {machine_id!r}")
    host, port = _ssh_address(table.get("ssh"))
    user = table.get("ssh_user")
    if user is not None and (not isinstance(user, str) or not _USER.fullmatch(user)):
        raise Refusal(f"ssh_user must be a user name ({_USER.pattern}), got {user!r}")
    location = table.get("location")
    if location is not None and not isinstance(location, str):
        raise Refusal(f"location must be a string, got {location!r}")
    bmc = table.get("bmc")
    if bmc is not None and not isinstance(bmc, dict):
        raise Refusal("bmc must be a [machines.bmc] table")
    return InventoryMachine(
        id=machine_id,
        host=host,
        port=port,
        ssh_user=user,
        bmc=bmc_config(bmc, base, secrets) if bmc is not None else None,
        line=line,
        location=location,
    )


def _ssh_address(value: Any) -> tuple[str, int]:
    """(host, port) of host[:port] or [IPv6]:port; host without brackets, as SSH clients take it."""
    if value is None:
        raise Refusal("missing ssh (host[:port])")
    try:
        host, port = parse_ssh_address(value, "ssh")
    except ValueError as problem:
        raise Refusal(str(problem)) from None
    return host, port or 22
