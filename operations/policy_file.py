"""The operator API's policy file: which actions each role allows, who holds which role where, and which actions
need a confirmation; read from TOML and checked whole, so a mistake is refused at load, never met at a request.

    [roles]
    viewer = ["read", "events-stream"]
    admin = ["*"]

    [[grants]]
    role = "viewer"
    groups = ["shepherd-viewers"]           # and/or subjects = [...] (token sub), certificates = [...] (DN or CN)
    providers = ["rack1"]                    # optional: only machines of these provider instances
    where = "MachineStage = 'WATCHING'"      # optional: only machines this visibility query selects

    [confirmations]
    second_person = ["decommission"]
    typed = ["release-recoveries"]
    bulk_confirm_over = 50
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509

from foundation.provider_instances import INSTANCE_NAME

# The operator actions, one for each thing an operator may ask; a bulk action is one of them over a --where.
READ = "read"  # machines, status, events
EVENTS_STREAM = "events-stream"
RECOVER = "recover"
REIMAGE = "reimage"
RESTART_AGENT = "restart-agent"
MAINTENANCE = "maintenance"
RETRY = "retry"
RELEASE = "release"
DECOMMISSION = "decommission"
RESET_HOST_KEY = "reset-host-key"
FLEET_PAUSE = "fleet-pause"
FLEET_RESUME = "fleet-resume"
FLEET_TRIGGER = "fleet-trigger"
RELEASE_RECOVERIES = "release-recoveries"

READS = (READ, EVENTS_STREAM)
MACHINE_ACTIONS = (RECOVER, REIMAGE, RESTART_AGENT, MAINTENANCE, RETRY, RELEASE, DECOMMISSION, RESET_HOST_KEY)
# These act on a provider instance's schedule and holds, not on machines one by one.
FLEET_ACTIONS = (FLEET_PAUSE, FLEET_RESUME, FLEET_TRIGGER, RELEASE_RECOVERIES)
ACTIONS = READS + MACHINE_ACTIONS + FLEET_ACTIONS
ALL_ACTIONS = "*"
# An operator's bulk action past this many machines needs a typed confirmation, unless the file says otherwise.
DEFAULT_BULK_CONFIRM_OVER = 50
# Longer than any filter a person writes; keeps a query the API sends to Temporal small.
MAX_QUERY_CHARS = 2000

_SECTIONS = ("roles", "grants", "confirmations")
_GRANT_KEYS = ("role", "subjects", "groups", "certificates", "providers", "where")
_CONFIRMATION_KEYS = ("second_person", "typed", "bulk_confirm_over")
_QUOTES = "'\"`"


class PolicyError(ValueError):
    """A policy file Shepherd will not use; str() is one line naming the file, the table or key, and the problem."""


@dataclass(frozen=True)
class Grant:
    """A role given to subjects (token sub), groups (token groups) and client certificates (subject DN or CN),
    optionally only over some provider instances and the machines a visibility query selects."""

    role: str
    subjects: frozenset[str] = frozenset()
    groups: frozenset[str] = frozenset()
    certificates: frozenset[str] = frozenset()  # as written: DNs (RFC 4514) and CNs
    providers: frozenset[str] | None = None  # None: every provider instance
    where: str | None = None  # None: every machine

    def scope_text(self) -> str:
        """Where the grant holds, as an operator reads it: "all providers", "providers rack1; where ..."."""
        text = "all providers" if self.providers is None else "providers " + ", ".join(sorted(self.providers))
        return text if self.where is None else f"{text}; where {self.where}"


@dataclass(frozen=True)
class Confirmations:
    """Which actions need more than the ask: a second operator's approval, or the target's name typed again."""

    second_person: frozenset[str] = frozenset()
    typed: frozenset[str] = frozenset()
    bulk_confirm_over: int = DEFAULT_BULK_CONFIRM_OVER


@dataclass(frozen=True)
class Policy:
    """A whole policy file, checked: roles by name with the actions each allows, the grants, the confirmations."""

    roles: dict[str, frozenset[str]]
    grants: tuple[Grant, ...]
    confirmations: Confirmations

    def describe(self) -> str:
        """One line for the log when the file is read again."""
        return f"{len(self.roles)} roles, {len(self.grants)} grants"


def load_policy(path: Path) -> Policy:
    """The policy in a TOML file; PolicyError (a ValueError) naming the file, the key and the problem, or OSError."""
    data = path.read_bytes()
    try:
        table = tomllib.loads(data.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise PolicyError(f"{path}: not TOML: {error}") from None
    return parse_policy(table, str(path))


def parse_policy(table: dict[str, Any], source: str) -> Policy:
    """The policy a TOML document holds; source names it in errors."""
    _only(table, _SECTIONS, source, "the top level")
    roles_table = table.get("roles", {})
    if not isinstance(roles_table, dict):
        raise PolicyError(f"{source}: roles: must be a [roles] table of role = [actions]")
    roles = {name: _actions(value, source, f"[roles] {name}", wildcard=True) for name, value in roles_table.items()}
    grants_list = table.get("grants", [])
    if not isinstance(grants_list, list) or not all(isinstance(grant, dict) for grant in grants_list):
        raise PolicyError(f"{source}: grants: must be [[grants]] tables")
    grants = tuple(_grant(grant, roles, source, number) for number, grant in enumerate(grants_list, 1))
    confirmations = _confirmations(table.get("confirmations", {}), source)
    return Policy(roles, grants, confirmations)


def _grant(table: dict[str, Any], roles: dict[str, frozenset[str]], source: str, number: int) -> Grant:
    where = f"[[grants]] {number}"
    _only(table, _GRANT_KEYS, source, where)
    role = table.get("role")
    if not isinstance(role, str):
        raise PolicyError(f"{source}: {where}: role: must name a role of [roles], got {role!r}")
    if role not in roles:
        defined = ", ".join(sorted(roles)) or "none"
        raise PolicyError(f"{source}: {where}: role: {role!r} is not defined in [roles] (defined: {defined})")
    where = f"{where} (role {role})"
    subjects, groups = _names(table, "subjects", source, where), _names(table, "groups", source, where)
    certificates = _names(table, "certificates", source, where)
    for name in certificates:
        _check_certificate_name(name, source, where)
    if not (subjects or groups or certificates):
        raise PolicyError(f"{source}: {where}: names no one: give subjects, groups or certificates")
    providers = None
    if "providers" in table:
        providers = _names(table, "providers", source, where)
        if not providers:
            raise PolicyError(f"{source}: {where}: providers: empty; leave it out for every provider")
        for name in sorted(providers):
            if not INSTANCE_NAME.match(name):
                raise PolicyError(
                    f"{source}: {where}: providers: {name!r} is no provider instance name ({INSTANCE_NAME.pattern})"
                )
    query = None
    if "where" in table:
        query = table["where"]
        if not isinstance(query, str):
            raise PolicyError(f"{source}: {where}: where: must be a visibility query string, got {query!r}")
        problem = query_problem(query)
        if problem:
            raise PolicyError(f"{source}: {where}: where: {problem}")
        query = query.strip()
    return Grant(role, subjects, groups, certificates, providers, query)


def _confirmations(table: Any, source: str) -> Confirmations:
    if not isinstance(table, dict):
        raise PolicyError(f"{source}: confirmations: must be a [confirmations] table")
    _only(table, _CONFIRMATION_KEYS, source, "[confirmations]")
    second_person = _actions(table.get("second_person", []), source, "[confirmations] second_person")
    typed = _actions(table.get("typed", []), source, "[confirmations] typed")
    for key, actions in (("second_person", second_person), ("typed", typed)):
        reads = sorted(actions & set(READS))
        if reads:
            raise PolicyError(f"{source}: [confirmations] {key}: {', '.join(reads)} only reads and needs none")
    over = table.get("bulk_confirm_over", DEFAULT_BULK_CONFIRM_OVER)
    if isinstance(over, bool) or not isinstance(over, int) or over < 0:
        raise PolicyError(f"{source}: [confirmations] bulk_confirm_over: must be a whole number >= 0, got {over!r}")
    return Confirmations(second_person, typed, over)


def _actions(value: Any, source: str, key: str, *, wildcard: bool = False) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(action, str) for action in value):
        raise PolicyError(f"{source}: {key}: must be a list of actions, got {value!r}")
    for action in value:
        if action == ALL_ACTIONS and wildcard:
            continue
        if action not in ACTIONS:
            raise PolicyError(f"{source}: {key}: unknown action {action!r} (actions: {', '.join(ACTIONS)})")
    return frozenset(ACTIONS) if ALL_ACTIONS in value else frozenset(value)


def _names(table: dict[str, Any], key: str, source: str, where: str) -> frozenset[str]:
    value = table.get(key, [])
    if not isinstance(value, list) or not all(isinstance(name, str) and name.strip() for name in value):
        raise PolicyError(f"{source}: {where}: {key}: must be a list of names, got {value!r}")
    return frozenset(value)


def _only(table: dict[str, Any], keys: tuple[str, ...], source: str, where: str) -> None:
    unknown = sorted(set(table) - set(keys))
    if unknown:
        raise PolicyError(f"{source}: {where}: unknown key {unknown[0]!r} (known: {', '.join(keys)})")


def _check_certificate_name(name: str, source: str, where: str) -> None:
    """A certificate name is a CN, or a whole subject DN in RFC 4514 form (which holds '=')."""
    if "=" not in name:
        return
    try:
        x509.Name.from_rfc4514_string(name)
    except ValueError:
        raise PolicyError(
            f"{source}: {where}: certificates: {name!r} is neither a CN nor a DN in RFC 4514 form (CN=x,O=y)"
        ) from None


def certificate_matches(written: str, subject: str) -> bool:
    """Whether a certificate name of a grant names the client certificate whose subject DN (RFC 4514) is given:
    the same DN, attribute for attribute, or its CN."""
    try:
        name = x509.Name.from_rfc4514_string(subject)
    except ValueError:
        return False
    if "=" in written:
        return x509.Name.from_rfc4514_string(written) == name
    common_names = name.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    return any(attribute.value == written for attribute in common_names)


def query_problem(query: str) -> str | None:
    """What keeps a visibility query from being put in parentheses and ANDed safely, or None.

    Its quotes must close and its parentheses balance outside them, and it may not hold a comment, a ';' or a
    backslash: each would let the text close the parentheses around it, or hide what follows, and so reach past a
    scope.
    """
    if not query.strip():
        return "is empty"
    if len(query) > MAX_QUERY_CHARS:
        return f"is longer than {MAX_QUERY_CHARS} characters"
    if not query.isprintable():
        return "holds a line break or another unprintable character"
    if "\\" in query:
        # Query parsers differ on whether it escapes a quote, so it could end a string here and not there.
        return "holds a backslash"
    depth, quote = 0, ""
    for index, char in enumerate(query):
        if quote:
            # A doubled quote reads the same either way: a quote in the string, or two strings side by side.
            if char == quote:
                quote = ""
            continue
        if char in _QUOTES:
            quote = char
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth < 0:
                return f"closes a parenthesis it did not open, at character {index + 1}"
        elif char == ";" or query.startswith(("--", "/*", "*/", "#"), index):
            marker = char if char in "#;" else query[index : index + 2]
            return f"holds {marker!r} outside quotes, at character {index + 1}"
    if quote:
        return f"a {quote} quote is not closed"
    if depth:
        return "a parenthesis is not closed"
    return None
