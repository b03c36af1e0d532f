"""Secrets are never shown: the credentials of a URL, provider options marked secret, and either of them inside a
provider's error, in `shepherd config`, `shepherd doctor`, logs and errors."""

from __future__ import annotations

import json
import os
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest

from foundation.provider_instances import ProviderInstance
from foundation.redaction import redact_text, redact_url
from foundation.setting_values import SettingsError
from foundation.settings import Settings
from foundation.settings_report import effective_settings
from providers.registry import ENTRY_POINT_GROUP, declared_secret_options, open_provider, secret_options

URLS = [
    # User info with the characters a URL parser takes for the end of it: libpq reads up to the @.
    ("postgresql://u:pa?ss@host/db", "postgresql://u:***@host/db"),
    ("postgresql://u:pa#ss@host/db", "postgresql://u:***@host/db"),
    ("postgresql://u:pa:ss@host/db", "postgresql://u:***@host/db"),
    ("postgresql://u:p@ss@h/db?sslpassword=k&x=a@b", "postgresql://u:***@h/db?sslpassword=***&x=a@b"),
    ("postgresql://u:pa%2Fss%40@host:5432/db", "postgresql://u:***@host:5432/db"),
    ("postgresql://postgres:@/postgres?host=/tmp", "postgresql://postgres:***@/postgres?host=/tmp"),
    ("postgresql+psycopg://u:pw@h/db", "postgresql+psycopg://u:***@h/db"),
    ("postgresql://u:pw@h1:5432,h2:5433/db", "postgresql://u:***@h1:5432,h2:5433/db"),
    # IPv6 hosts, one with a zone.
    ("postgresql://u:pw@[::1]:5432/db?password=x", "postgresql://u:***@[::1]:5432/db?password=***"),
    ("postgresql://u:pw@[fe80::1%25eth0]/db", "postgresql://u:***@[fe80::1%25eth0]/db"),
    ("postgresql://[::1]:5432/db?sslmode=require", "postgresql://[::1]:5432/db?sslmode=require"),
    # Parameters, by any case and percent-encoded names, several at once.
    ("postgresql://u@h/db?password=s3cret&sslmode=require", "postgresql://u@h/db?password=***&sslmode=require"),
    ("postgresql:///db?host=/tmp&PassWord=s3cret", "postgresql:///db?host=/tmp&PassWord=***"),
    ("postgresql://u@h/db?pass%77ord=s3cret", "postgresql://u@h/db?pass%77ord=***"),
    (
        "postgresql://h/db?ssl%70assword=k&sslmode=verify-full",
        "postgresql://h/db?ssl%70assword=***&sslmode=verify-full",
    ),
    (
        "https://api.example.net/v1?token=t&api_key=k&apikey=k2&x=1",
        "https://api.example.net/v1?token=***&api_key=***&apikey=***&x=1",
    ),
    (
        "https://h/?access_token=a&client_secret=b&X-Amz-Signature=c",
        "https://h/?access_token=***&client_secret=***&X-Amz-Signature=***",
    ),
    (
        "https://swift/v1/img?temp_url_sig=s&temp_url_expires=1",
        "https://swift/v1/img?temp_url_sig=***&temp_url_expires=1",
    ),
    # A secret value holding ?, and a secret parameter hidden in another's value.
    ("postgresql://h/db?password=a?b&sslmode=require", "postgresql://h/db?password=***&sslmode=require"),
    ("postgresql://h/db?application_name=a?password=b", "postgresql://h/db?application_name=a?password=***"),
    ("postgresql://host?password=a@b", "postgresql://host?password=***"),
    # Nothing to hide.
    ("postgresql://u@host/db", "postgresql://u@host/db"),
    ("http://127.0.0.1:8800", "http://127.0.0.1:8800"),
    ("not a url", "not a url"),
]


@pytest.mark.parametrize("url, shown", URLS, ids=[url for url, _ in URLS])
def test_redact_url_hides_every_credential_and_nothing_else(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_redact_text_hides_urls_and_the_secrets_named_in_a_message() -> None:
    message = "instance 'x': api_url must be an http(s) URL, got 'ftp://admin:hunter2@bmc/?token=abc'; bearer 'b-123'"
    shown = redact_text(message, ["b-123", True, None])
    assert shown == "instance 'x': api_url must be an http(s) URL, got 'ftp://admin:***@bmc/?token=***'; bearer ***"
    # A quote inside a quoted URL's password is part of the password.
    assert redact_text("got 'https://u:pa'ss@h/'.") == "got 'https://u:***@h/'."


def echoing_factory(instance: ProviderInstance, settings: Settings) -> Any:
    """A careless plugin's factory: it quotes the options it refuses."""
    raise SettingsError("providers", f"instance {instance.name!r}: cannot use {dict(instance.options)!r}")


# Marked the way a plugin marks its own: on the factory, where its options are declared.
secret_options("bearer")(echoing_factory)

ECHO = {"echo": EntryPoint(name="echo", value=f"{__name__}:echoing_factory", group=ENTRY_POINT_GROUP)}


def test_a_providers_error_loses_its_secret_options_and_url_credentials() -> None:
    options = {"bearer": "b-0123", "api_token": "t-4567", "url": "https://u:p-89@api/?sig=s-10", "region": "eu-1"}
    instance = ProviderInstance("acme", "echo", options)
    assert declared_secret_options(instance, ECHO) == {"bearer"}
    with pytest.raises(SettingsError) as refused:
        open_provider(instance, Settings(), ECHO)
    message = str(refused.value)
    assert message.startswith("setting providers (SHEPHERD_PROVIDERS): instance 'acme': cannot use ")
    for secret in ("b-0123", "t-4567", "p-89", "s-10"):
        assert secret not in message
    assert "'region': 'eu-1'" in message and "https://u:***@api/?sig=***" in message

    # The simulator's own factory quotes a URL it refuses; the doctor and the worker's start show the message.
    sim = ProviderInstance("sim", "sim", {"api_url": "ftp://admin:hunter2@127.0.0.1:8800"})
    with pytest.raises(SettingsError) as refused:
        open_provider(sim, Settings())
    assert "hunter2" not in str(refused.value) and "ftp://admin:***@127.0.0.1:8800" in str(refused.value)


def test_an_ironic_endpoint_with_credentials_is_refused_without_quoting_it() -> None:
    instance = ProviderInstance(
        "iron", "ironic", {"endpoint": "https://shepherd:hunter2@ironic:6385", "image_source": "http://i/os.img"}
    )
    with pytest.raises(SettingsError) as refused:
        open_provider(instance, Settings())
    assert "endpoint must not carry credentials: use auth = http_basic" in str(refused.value)
    assert "hunter2" not in str(refused.value)


CONFIG = """
database_url = "postgresql://shepherd@db.example.net/bmdb?pass%77ord=hunter1"

[[providers]]
name = "iron"
type = "ironic"
endpoint = "https://ironic.example.net:6385"
password = "hunter2"
image_source = "https://swift.example.net/v1/os.img?temp_url_sig=hunter3&temp_url_expires=1"
address_template = "{name}.lab.example.net"

[[providers]]
name = "sim"
type = "sim"
api_url = "http://sim:hunter4@127.0.0.1:8800"

[[providers]]
name = "rack"
type = "static"
inventory = "/etc/shepherd/inventory.toml"
api_token = "hunter5"

[[providers]]
name = "acme"
type = "acme-cloud"
region = "hunter6"
"""


async def test_config_hides_secret_options_and_url_credentials(tmp_path: Path, shepherd_cli) -> None:
    config = tmp_path / "shepherd.toml"
    config.write_text(CONFIG)
    env = {"TEMPORAL_CONFIG_FILE": os.devnull}
    code, text, err = await shepherd_cli(env, "config", "--config", str(config))
    assert (code, err) == (0, "")
    code, out, err = await shepherd_cli(env, "config", "--config", str(config), "--json")
    assert (code, err) == (0, "")
    for secret in ("hunter1", "hunter2", "hunter3", "hunter4", "hunter5", "hunter6"):
        assert secret not in text + out, secret
    lines = text.splitlines()
    assert f'database_url = "postgresql://shepherd@db.example.net/bmdb?pass%77ord=***"  # file {config}' in lines
    # Ironic marks its password secret; an option named as a secret is hidden whatever the type.
    assert 'password = "***"' in lines and 'api_token = "***"' in lines
    assert 'image_source = "https://swift.example.net/v1/os.img?temp_url_sig=***&temp_url_expires=1"' in lines
    assert 'api_url = "http://sim:***@127.0.0.1:8800"' in lines
    # What is no secret is shown as written.
    assert 'endpoint = "https://ironic.example.net:6385"' in lines
    assert 'address_template = "{name}.lab.example.net"' in lines
    assert 'inventory = "/etc/shepherd/inventory.toml"' in lines
    # A type that is not installed cannot say which of its options are secret: all of them are hidden.
    assert 'region = "***"' in lines
    tables = {table["name"]: table for table in json.loads(out)["settings"]["providers"]}
    assert tables["iron"]["password"] == "***" and tables["acme"]["region"] == "***"
    assert tables["rack"]["inventory"] == "/etc/shepherd/inventory.toml"


def test_effective_settings_hide_the_options_a_type_declares() -> None:
    instance = ProviderInstance("acme", "echo", {"bearer": "b-0123", "region": "eu-1"})
    settings = Settings(providers=(instance,))
    shown = effective_settings(settings, {}, secret_options={"acme": declared_secret_options(instance, ECHO)})
    assert 'bearer = "***"' in shown.splitlines() and 'region = "eu-1"' in shown.splitlines()
    assert "b-0123" not in shown
