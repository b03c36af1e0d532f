"""Provider instances from [[providers]] tables, and provider types found through their entry points."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from foundation.provider_instances import ProviderInstance
from foundation.setting_values import SettingsError
from foundation.settings import Settings
from foundation.settings_report import effective_settings
from providers.registry import open_provider, open_providers, provider_types
from providers.sim import SimProvider
from providers.static import StaticProvider
from shepherd.commands.dev_stack.stack_settings import providers_file


def settings_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "shepherd.toml"
    path.write_text(text)
    return path


def test_shepherds_own_types_are_entry_points():
    assert {"sim", "static"} <= set(provider_types())


def test_without_providers_tables_the_provider_setting_is_the_one_instance():
    settings = Settings.from_env({"SHEPHERD_PROVIDER": "sim"}).check()
    assert settings.provider_instances == (ProviderInstance("sim", "sim"),)
    [provider] = open_providers(settings).values()
    assert isinstance(provider, SimProvider) and provider.name == "sim"


def test_providers_tables_name_instances_with_types_and_options(tmp_path):
    path = settings_file(
        tmp_path,
        """
reboot_timeout = "10m"

[[providers]]
name = "rack1"
type = "static"
inventory = "/etc/shepherd/rack1.toml"
activities_per_second = 2

[[providers]]
name = "sim"
type = "sim"
api_url = "http://127.0.0.1:8800"
""",
    )
    settings, sources = Settings.resolve({}, config_path=path)
    settings.check()
    assert [(i.name, i.type, i.activities_per_second) for i in settings.provider_instances] == [
        ("rack1", "static", 2.0),
        ("sim", "sim", 0.0),
    ]
    providers = open_providers(settings)
    assert isinstance(providers["rack1"], StaticProvider) and providers["rack1"].name == "rack1"
    assert isinstance(providers["sim"], SimProvider) and providers["sim"].name == "sim"
    shown = json.loads(effective_settings(settings, sources, as_json=True))
    assert shown["settings"]["providers"][0] == {
        "name": "rack1",
        "type": "static",
        "inventory": "/etc/shepherd/rack1.toml",
        "activities_per_second": 2.0,
    }
    assert "[[providers]]" in effective_settings(settings, sources)


@pytest.mark.parametrize(
    "tables, problem",
    [
        ('[[providers]]\nname = "Rack 1"\ntype = "static"\n', "name must match"),
        ('[[providers]]\nname = "rack1"\n', "type must name a provider type"),
        ('[[providers]]\nname = "a"\ntype = "sim"\n[[providers]]\nname = "a"\ntype = "sim"\n', "more than once: a"),
        ('[[providers]]\nname = "a"\ntype = "sim"\nactivities_per_second = -1\n', "activities_per_second"),
        ('providers = "sim"\n', "must be [[providers]] tables"),
    ],
)
def test_malformed_providers_tables_are_refused_naming_the_table(tmp_path, tables, problem):
    with pytest.raises(SettingsError, match="providers") as raised:
        Settings.resolve({}, config_path=settings_file(tmp_path, tables))
    assert problem in str(raised.value) and str(tmp_path) in str(raised.value)


def test_providers_are_no_environment_variable():
    with pytest.raises(SettingsError, match="not a variable"):
        Settings.from_env({"SHEPHERD_PROVIDERS": "rack1"})


@pytest.mark.parametrize(
    "instance, problem",
    [
        (ProviderInstance("aws", "aws"), "type 'aws', which no installed package provides (installed: "),
        (ProviderInstance("rack1", "static"), "inventory must name the inventory file"),
        (ProviderInstance("rack1", "static", {"inventory": "i.toml", "invetory": "x"}), "no option invetory"),
        (ProviderInstance("rack1", "static", {"inventory": "i.toml", "graceful_timeout": "soon"}), "graceful_timeout"),
        (ProviderInstance("rack1", "static", {"inventory": "i.toml", "power_back_timeout": "5m"}), "reboot_timeout"),
        (ProviderInstance("sim", "sim", {"api_url": "ftp://x"}), "api_url must be an http(s) URL"),
        (ProviderInstance("sim", "sim", {"timeout": 0}), "timeout must be positive"),
    ],
)
def test_a_provider_instance_the_type_cannot_run_is_refused_naming_it(instance, problem):
    with pytest.raises(SettingsError) as raised:
        open_providers(Settings(providers=(instance,)))
    assert problem in str(raised.value) and instance.name in str(raised.value)


def test_a_plugin_that_cannot_be_loaded_fails_only_its_own_instances(tmp_path, monkeypatch):
    # A package that declares a provider type whose module is not installed: a half-removed plugin, a missing extra.
    dist = tmp_path / "broken_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[shepherd.providers]\nbroken = no_such_module_here:from_settings\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "broken" in provider_types()

    sim = ProviderInstance("sim", "sim", {})
    assert open_provider(sim, Settings()).name == "sim", "the other types load as ever"
    with pytest.raises(SettingsError) as raised:
        open_provider(ProviderInstance("rack9", "broken", {}), Settings())
    assert "instance 'rack9': provider type 'broken' (no_such_module_here:from_settings) cannot be loaded" in str(
        raised.value
    )


def test_the_stack_file_of_provider_instances_keeps_their_rate_limits(tmp_path):
    instances = (
        ProviderInstance("rack1", "sim", {"api_url": "http://127.0.0.1:8800"}, activities_per_second=2.5),
        ProviderInstance("rack2", "sim", {"api_url": "http://127.0.0.1:8801"}),
    )
    path = providers_file(Settings(providers=instances), tmp_path / "providers.toml")
    settings, _ = Settings.resolve({}, config_path=path)
    assert settings.check().provider_instances == instances
