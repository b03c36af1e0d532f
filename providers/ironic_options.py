"""The options of an `ironic` provider instance, each checked when the instance is opened, by name.

Four things: how to reach Ironic (endpoint and auth, or a clouds.yaml cloud), which nodes are capacity (available
nodes, narrowed by resource class, conductor group, owner and traits), what to deploy on them (an image, or a whole
instance_info table, and the user data that reaches the new OS with Shepherd's SSH key in a config drive), and where
SSH reaches a deployed node (a node field the operator names, a DNS name made from the node's name, or the address
Ironic's inspection recorded of one of its interfaces).
"""

from __future__ import annotations

import os
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundation.provider_instances import ProviderInstance
from foundation.secret_files import SecretFileError, read_secret_file
from foundation.setting_values import SettingsError
from providers.registry import duration_option, unknown_options
from providers.ssh_address import parse_ssh_address

OPTIONS = (
    "endpoint",
    "auth",
    "username",
    "password_file",
    "password_env",
    "cloud",
    "clouds_file",
    "ca_file",
    "verify_tls",
    "timeout",
    "resource_class",
    "conductor_group",
    "owner",
    "traits",
    "image_source",
    "image_checksum",
    "instance_info",
    "root_device",
    "user_data_file",
    "address_field",
    "address_template",
    "address_source",
    "address_interface",
    "address_ip_version",
    "ssh_port",
    "ssh_user",
    "power_timeout",
)
# Options whose value is a secret: never shown by shepherd config or doctor, never quoted in an error. Ironic's
# password is refused inline (it belongs in password_file or password_env), and hidden should one be written anyway.
SECRET_OPTIONS = ("password",)
AUTH_TYPES = ("none", "http_basic")
# The node tables an address may be read from; driver_info is left out: it holds the BMC's credentials.
ADDRESS_TABLES = ("extra", "instance_info", "properties")
# What an address template may use of the node.
TEMPLATE_FIELDS = ("name", "uuid")
# The one address_source: what Ironic's inspection recorded (providers/ironic_inventory.py).
INSPECTION = "inspection"
# A network interface's name as Linux gives it: at most 15 characters, no slash, no white space.
_INTERFACE = re.compile(r"[^\s/]{1,15}")
_TRAIT = re.compile(r"[A-Z0-9_]{1,255}")
_USER = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]{0,31}")


@dataclass(frozen=True)
class IronicOptions:
    """One ironic instance's options, checked; the password is read when the connection opens, not kept here."""

    provider: str
    endpoint: str | None
    auth: str
    username: str | None
    password_file: Path | None
    password_env: str | None
    cloud: str | None
    clouds_file: Path | None
    verify: bool | str
    timeout: float
    resource_class: str | None
    conductor_group: str | None
    owner: str | None
    traits: tuple[str, ...]
    instance_info: Mapping[str, Any]
    user_data_file: Path | None
    address_field: tuple[str, str] | None
    address_template: str | None
    address_source: str | None
    address_interface: str | None
    address_ip_version: int | None
    ssh_port: int
    ssh_user: str | None
    power_timeout: float

    def password(self) -> str:
        """The HTTP basic password, read now from its variable or file; SettingsError when it cannot serve."""
        if self.password_env is not None:
            password = os.environ.get(self.password_env)
            if not password:
                raise self.error(f"password_env: the variable {self.password_env} is not set, or empty")
            return password
        assert self.password_file is not None  # checked when the options were read
        try:
            return read_secret_file(self.password_file)
        except SecretFileError as error:
            raise self.error(f"password_file {self.password_file} {error}") from None

    def user_data(self) -> str | None:
        """The user data for the new OS, read now; SettingsError when the file cannot be read."""
        if self.user_data_file is None:
            return None
        try:
            return self.user_data_file.read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise self.error(f"user_data_file: {self.user_data_file} cannot be read: {error}") from None

    def error(self, problem: str) -> SettingsError:
        """A SettingsError naming the instance and the problem."""
        return SettingsError("providers", f"instance {self.provider!r} (type ironic): {problem}")


def read_options(instance: ProviderInstance, default_timeout: float) -> IronicOptions:
    """The instance's options, checked; SettingsError naming the first that is wrong."""
    unknown_options(instance, OPTIONS)
    options = instance.options

    def error(problem: str) -> SettingsError:
        return SettingsError("providers", f"instance {instance.name!r} (type ironic): {problem}")

    def text(name: str) -> str | None:
        value = options.get(name)
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip():
            raise error(f"{name} must be a non-empty string, got {value!r}")
        return value

    def path(name: str) -> Path | None:
        value = text(name)
        return Path(value) if value is not None else None

    endpoint, cloud = text("endpoint"), text("cloud")
    if (endpoint is None) == (cloud is None):
        raise error("name Ironic by endpoint (its URL) or by cloud (a clouds.yaml cloud), one of the two")
    if endpoint is not None and not endpoint.startswith(("http://", "https://")):
        raise error(f"endpoint must be an http:// or https:// URL, got {endpoint!r}")
    if endpoint is not None and "@" in endpoint.split("://", 1)[1].split("/", 1)[0]:
        # Not echoed: what precedes the @ may be a password, and the endpoint is in every error of the instance.
        raise error("endpoint must not carry credentials: use auth = http_basic with username and password_file")
    if cloud is None and options.get("clouds_file") is not None:
        raise error("clouds_file goes with cloud")
    auth = text("auth") or "none"
    if auth not in AUTH_TYPES:
        raise error(f"auth must be one of {', '.join(AUTH_TYPES)} (Keystone: use cloud), got {auth!r}")
    if cloud is not None and options.get("auth") is not None:
        raise error("auth goes with endpoint; a cloud brings its own auth from clouds.yaml")
    username, password_file, password_env = text("username"), path("password_file"), text("password_env")
    if "password" in options:
        raise error("password: never inline: use password_file or password_env")
    if auth == "http_basic":
        if username is None:
            raise error("auth = http_basic needs username")
        if (password_file is None) == (password_env is None):
            raise error("auth = http_basic needs password_file or password_env, one of the two")
    elif username is not None or password_file is not None or password_env is not None:
        raise error("username, password_file and password_env go with auth = http_basic")

    verify_tls = options.get("verify_tls", True)
    if not isinstance(verify_tls, bool):
        raise error(f"verify_tls must be true or false, got {verify_tls!r}")
    ca_file = path("ca_file")
    if ca_file is not None and not verify_tls:
        raise error("ca_file and verify_tls = false contradict each other")

    traits = options.get("traits", [])
    if not isinstance(traits, list) or not all(isinstance(t, str) and _TRAIT.fullmatch(t) for t in traits):
        raise error(f"traits must be a list of trait names such as CUSTOM_SHEPHERD, got {traits!r}")

    instance_info = _instance_info(options, error)

    address_field, address_template = text("address_field"), text("address_template")
    address_source = text("address_source")
    if [address_field, address_template, address_source].count(None) != 2:
        raise error(
            "say where SSH reaches a deployed node: address_field (a node field such as extra/ssh_address), "
            'address_template (a DNS name such as {name}.rack1.example.com) or address_source = "inspection" '
            "(the address Ironic's inspection recorded), one of the three"
        )
    field_path = _address_field(address_field, error) if address_field is not None else None
    if address_template is not None:
        _check_template(address_template, error)
    address_interface, address_ip_version = _inspection_options(options, address_source, error)

    ssh_port = options.get("ssh_port", 22)
    if isinstance(ssh_port, bool) or not isinstance(ssh_port, int) or not 0 < ssh_port < 65536:
        raise error(f"ssh_port must be a port number, got {ssh_port!r}")
    ssh_user = text("ssh_user")
    if ssh_user is not None and not _USER.fullmatch(ssh_user):
        raise error(f"ssh_user must be a user name, got {ssh_user!r}")

    return IronicOptions(
        provider=instance.name,
        endpoint=endpoint.rstrip("/") if endpoint is not None else None,
        auth=auth,
        username=username,
        password_file=password_file,
        password_env=password_env,
        cloud=cloud,
        clouds_file=path("clouds_file"),
        verify=str(ca_file) if ca_file is not None else verify_tls,
        timeout=duration_option(instance, "timeout", default_timeout),
        resource_class=text("resource_class"),
        conductor_group=text("conductor_group"),
        owner=text("owner"),
        traits=tuple(traits),
        instance_info=instance_info,
        user_data_file=path("user_data_file"),
        address_field=field_path,
        address_template=address_template,
        address_source=address_source,
        address_interface=address_interface,
        address_ip_version=address_ip_version,
        ssh_port=ssh_port,
        ssh_user=ssh_user,
        power_timeout=duration_option(instance, "power_timeout", 120.0),
    )


def _instance_info(options: Mapping[str, Any], error: Any) -> dict[str, Any]:
    """What a deploy sets in the node's instance_info: the image (or, for the ramdisk deploy, the ISO to boot), its
    checksum, the root device hint, and the operator's own table."""
    table = options.get("instance_info", {})
    if not isinstance(table, dict):
        raise error(f"instance_info must be a table, got {table!r}")
    info = dict(table)
    for name in ("image_source", "image_checksum"):
        value = options.get(name)
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise error(f"{name} must be a non-empty string, got {value!r}")
        if name in table:
            raise error(f"{name} is given twice: as an option and in instance_info")
        info[name] = value
    if "boot_iso" in info:
        # The ramdisk deploy boots the node from an ISO instead of writing an image to its disk; Ironic refuses a
        # node that names both.
        if not isinstance(info["boot_iso"], str) or not info["boot_iso"]:
            raise error(f"instance_info's boot_iso must be the URL of an ISO, got {info['boot_iso']!r}")
        if "image_source" in info:
            raise error(
                "image_source and instance_info's boot_iso exclude each other: Ironic writes an image to the disk "
                "or boots an ISO (the ramdisk deploy), not both"
            )
    elif not isinstance(info.get("image_source"), str) or not info["image_source"]:
        raise error(
            "image_source must name the image to deploy (an option, or a key of instance_info), or instance_info's "
            "boot_iso the ISO a ramdisk deploy boots"
        )
    root_device = options.get("root_device")
    if root_device is not None:
        if not isinstance(root_device, dict) or not root_device:
            raise error(f"root_device must be a table of Ironic root device hints, got {root_device!r}")
        info["root_device"] = dict(root_device)
    return info


def _address_field(value: str, error: Any) -> tuple[str, str]:
    """(table, key) of an address_field such as extra/ssh_address."""
    table, _, key = value.partition("/")
    if table not in ADDRESS_TABLES or not key or "/" in key:
        raise error(
            f"address_field must be TABLE/KEY with TABLE one of {', '.join(ADDRESS_TABLES)}, such as "
            f"extra/ssh_address; got {value!r}"
        )
    return table, key


def _check_template(template: str, error: Any) -> None:
    """SettingsError unless the template uses only the node's name and uuid."""
    try:
        used = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as problem:
        raise error(f"address_template {template!r}: {problem}") from None
    unknown = used - set(TEMPLATE_FIELDS)
    if unknown or not used:
        raise error(
            f"address_template must use the node's {' or '.join('{' + f + '}' for f in TEMPLATE_FIELDS)} "
            f"and nothing else, got {template!r}"
        )


def _inspection_options(options: Mapping[str, Any], source: str | None, error: Any) -> tuple[str | None, int | None]:
    """(address_interface, address_ip_version) of an address_source = "inspection", checked."""
    if source is not None and source != INSPECTION:
        raise error(
            f'address_source must be "{INSPECTION}" (the address Ironic\'s inspection recorded), got {source!r}'
        )
    interface, ip_version = options.get("address_interface"), options.get("address_ip_version")
    if source is None and (interface is not None or ip_version is not None):
        raise error(f'address_interface and address_ip_version go with address_source = "{INSPECTION}"')
    if interface is not None and not (isinstance(interface, str) and _INTERFACE.fullmatch(interface)):
        raise error(f"address_interface must be a network interface's name such as eno1, got {interface!r}")
    if ip_version is not None and (type(ip_version) is not int or ip_version not in (4, 6)):
        raise error(f"address_ip_version must be 4 or 6, got {ip_version!r}")
    return interface, ip_version


def parse_address(value: Any, node: str, source: str) -> tuple[str, int | None]:
    """(host, port or None) of an address read from a node: host, host:port, [v6]:port or a bare IPv6 address;
    ValueError naming the node and where the address came from."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{node}: {source} must be a host name or address, got {value!r}")
    return parse_ssh_address(value.strip(), f"{node}: {source}", bare_ipv6=True)
