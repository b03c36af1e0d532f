"""A machine's [machines.bmc] table in the static inventory: its BMC, Redfish or IPMI, each key checked.

The password stays in a file only its owner reads, or in a variable, until the BMC is used: each pass checks the
file's metadata, and a reboot reads it. The file must be in the BMC secrets directory and the variable of the BMC
password prefix (providers.bmc_secrets), and a Redfish BMC is reached over https:// unless the table consents to
http:// in so many words: whatever the inventory names is sent to the URL it gives.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

from foundation.secret_files import SecretFileError, read_secret_file
from providers import ProviderError
from providers.bmc_secrets import BmcSecretRules
from providers.ipmi import DEFAULT_PORT, IpmiEndpoint
from providers.redfish import RedfishEndpoint
from providers.ssh_address import HOSTNAME

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LOGIN_KEYS = ("username", "password_file", "password_env")
# The keys of a [machines.bmc] table by its type; a key of the other type is refused by name.
_BMC_KEYS = {
    "redfish": ("type", "url", "system", *_LOGIN_KEYS, "ca_file", "verify_tls", "insecure_http"),
    "ipmi": ("type", "host", "port", *_LOGIN_KEYS),
}
# An IPMI user name is at most 16 bytes (the RAKP messages of an IPMI 2.0 login).
_IPMI_USER_BYTES = 16


class InventoryError(ProviderError):
    """The inventory (or a password it points to) is wrong; the operator must fix it, the next pass re-reads it."""

    retryable = False


class Refusal(Exception):
    """A problem of one table of the inventory, before the file, line and id are added to it."""


@dataclass(frozen=True, kw_only=True)
class _BmcLogin:
    """Who logs in to a BMC; the password stays in its file or variable until the BMC is used."""

    username: str
    password_file: Path | None = None
    password_env: str | None = None
    # The rules the inventory was read under, applied again when the password is read: the file may have been
    # replaced by a link since.
    secrets: BmcSecretRules = field(compare=False, repr=False)

    def _password(self, machine: str, provider: str) -> str:
        """The BMC password, read now from its variable or file; InventoryError when it cannot serve."""
        if self.password_env is None:
            assert self.password_file is not None  # load_inventory demands one of the two
            refusal = self.secrets.file_check().refusal(self.password_file)
            if refusal is not None:
                raise InventoryError(provider, f"machine {machine!r}: BMC password file {self.password_file} {refusal}")
            try:
                return read_secret_file(self.password_file)
            except SecretFileError as problem:
                where = f"machine {machine!r}: BMC password file {self.password_file}"
                raise InventoryError(provider, f"{where} {problem}") from None
        where = f"machine {machine!r}: BMC password variable {self.password_env}"
        password = os.environ.get(self.password_env)
        if password is None:
            raise InventoryError(provider, f"{where} is not set")
        if not password:
            raise InventoryError(provider, f"{where} is empty")
        return password


@dataclass(frozen=True, kw_only=True)
class RedfishBMC(_BmcLogin):
    """How to reach a machine's Redfish BMC."""

    type: ClassVar[str] = "redfish"
    url: str
    system: str | None = None
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


@dataclass(frozen=True, kw_only=True)
class IpmiBMC(_BmcLogin):
    """How to reach a machine's IPMI BMC."""

    type: ClassVar[str] = "ipmi"
    host: str
    port: int = DEFAULT_PORT

    def endpoint(self, machine: str, provider: str = "static") -> IpmiEndpoint:
        """The BMC endpoint with the password read now; InventoryError when it cannot be read."""
        return IpmiEndpoint(
            machine=machine,
            host=self.host,
            port=self.port,
            username=self.username,
            password=self._password(machine, provider),
        )


# A machine's BMC as the inventory gives it, and what reaching it takes once its password is read.
BMCConfig = RedfishBMC | IpmiBMC
BmcEndpoint = RedfishEndpoint | IpmiEndpoint


def known_keys(table: dict[str, Any], known: tuple[str, ...], prefix: str) -> None:
    """Refusal for a key the table does not know."""
    unknown = sorted(set(table) - set(known))
    if unknown:
        names = ", ".join(repr(prefix + key) for key in unknown)
        raise Refusal(f"unknown key(s) {names} (known: {', '.join(prefix + key for key in known)})")


def bmc_config(table: dict[str, Any], base: Path, secrets: BmcSecretRules) -> BMCConfig:
    """One [machines.bmc] table, checked against the rules of where its password may come from; relative paths are
    relative to the inventory's folder."""
    if "password" in table:
        raise Refusal("bmc.password: never inline: use password_file or password_env")
    kind = table.get("type")
    if not isinstance(kind, str) or kind not in _BMC_KEYS:
        raise Refusal(f"bmc.type must be 'redfish' or 'ipmi', got {kind!r}")
    own = _BMC_KEYS[kind]
    for other, keys in _BMC_KEYS.items():
        foreign = sorted(set(table) & (set(keys) - set(own)))
        if foreign:
            names = ", ".join(repr(f"bmc.{key}") for key in foreign)
            takes = ", ".join(key for key in own if key not in ("type", *_LOGIN_KEYS))
            raise Refusal(f"{names} is for a bmc of type = {other!r}; type = {kind!r} takes {takes}")
    known_keys(table, own, "bmc.")
    login = _bmc_login(table, base, secrets)
    return _redfish_bmc(table, base, login) if kind == "redfish" else _ipmi_bmc(table, login)


def _bmc_login(table: dict[str, Any], base: Path, secrets: BmcSecretRules) -> dict[str, Any]:
    """The username and the password's file or variable of a [machines.bmc] table, checked, as _BmcLogin's
    fields."""
    username = table.get("username")
    if username is None:
        raise Refusal("missing bmc.username")
    if not isinstance(username, str) or not username:
        raise Refusal(f"bmc.username must be a non-empty string, got {username!r}")
    password_file, password_env = table.get("password_file"), table.get("password_env")
    if (password_file is None) == (password_env is None):
        raise Refusal("bmc needs exactly one of password_file and password_env")
    if password_file is not None and (not isinstance(password_file, str) or not password_file):
        raise Refusal(f"bmc.password_file must be a path, got {password_file!r}")
    if password_env is not None and (not isinstance(password_env, str) or not _ENV_NAME.fullmatch(password_env)):
        raise Refusal(f"bmc.password_env must be an environment variable name, got {password_env!r}")
    refusal = secrets.variable_refusal(password_env) if password_env is not None else None
    if refusal is not None:
        raise Refusal(refusal)
    return {
        "username": username,
        "password_file": base / password_file if password_file is not None else None,
        "password_env": password_env,
        "secrets": secrets,
    }


def _redfish_bmc(table: dict[str, Any], base: Path, login: dict[str, Any]) -> RedfishBMC:
    """The Redfish keys of a [machines.bmc] table, checked."""
    url = table.get("url")
    if isinstance(url, str) and "@" in url:
        # Not echoed: what precedes the @ may be a password.
        raise Refusal("bmc.url must not carry credentials: use username and password_file or password_env")
    bad_url = Refusal(f"bmc.url must be an http:// or https:// URL, got {url!r}")
    if not isinstance(url, str):
        raise bad_url
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - urlsplit checks the port only when asked for it
    except ValueError:
        raise bad_url from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise bad_url
    insecure_http = table.get("insecure_http", False)
    if not isinstance(insecure_http, bool):
        raise Refusal(f"bmc.insecure_http must be true or false, got {insecure_http!r}")
    if parts.scheme == "http" and not insecure_http:
        raise Refusal(
            f"bmc.url {url} is http://, so the BMC password would cross the network in clear text: give the BMC's "
            "https:// URL, or write insecure_http = true in this [machines.bmc] to consent"
        )
    if parts.scheme == "https" and insecure_http:
        raise Refusal("bmc.insecure_http = true goes with an http:// url; this one is https://, so drop it")
    system = table.get("system")
    if system is not None and (not isinstance(system, str) or not system.startswith("/")):
        raise Refusal(f"bmc.system must be a path such as /redfish/v1/Systems/1, got {system!r}")
    ca_file = table.get("ca_file")
    if ca_file is not None and (not isinstance(ca_file, str) or not ca_file):
        raise Refusal(f"bmc.ca_file must be a path, got {ca_file!r}")
    verify_tls = table.get("verify_tls", True)
    if not isinstance(verify_tls, bool):
        raise Refusal(f"bmc.verify_tls must be true or false, got {verify_tls!r}")
    if not verify_tls and ca_file is not None:
        raise Refusal("bmc: verify_tls = false and ca_file contradict each other; keep one")
    return RedfishBMC(
        **login,
        url=url.rstrip("/"),
        system=system,
        ca_file=base / ca_file if ca_file is not None else None,
        verify_tls=verify_tls,
    )


def _ipmi_bmc(table: dict[str, Any], login: dict[str, Any]) -> IpmiBMC:
    """The IPMI keys of a [machines.bmc] table, checked."""
    host = table.get("host")
    if host is None:
        raise Refusal("missing bmc.host (the BMC's host name or IP address)")
    if not isinstance(host, str) or not (HOSTNAME.fullmatch(host) or _ip_address(host)):
        # host:port is the likely slip of an operator used to the ssh key.
        hint = "; the port goes in bmc.port" if isinstance(host, str) and host.count(":") == 1 else ""
        raise Refusal(f"bmc.host must be a host name or an IP address, got {host!r}{hint}")
    port = table.get("port", DEFAULT_PORT)
    # bool is an int to Python, and true is no port.
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise Refusal(f"bmc.port must be 1-65535, got {port!r}")
    username = login["username"]
    if len(username.encode()) > _IPMI_USER_BYTES:
        raise Refusal(f"bmc.username of an IPMI BMC is at most {_IPMI_USER_BYTES} bytes, got {username!r}")
    return IpmiBMC(**login, host=host, port=port)


def _ip_address(text: str) -> bool:
    """Whether text is an IPv4 or IPv6 address."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
