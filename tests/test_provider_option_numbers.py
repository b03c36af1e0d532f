"""Every numeric option of every provider type, as TOML can write it, goes through the checks of the top-level
settings: nan, inf and a negative number are refused at start, naming the instance and the option, never taken as
a wait that never ends."""

from __future__ import annotations

import pytest

from foundation.setting_values import SettingsError
from foundation.settings import Settings
from providers.registry import open_providers

# Each provider type with the options it needs besides the one under test; none is reached over the network.
TYPES = {
    "sim": 'api_url = "http://127.0.0.1:9"',
    "static": 'inventory = "inventory.toml"',
    "ironic": (
        'endpoint = "http://127.0.0.1:9"\naddress_field = "extra/ssh_address"\n'
        'image_source = "http://127.0.0.1:9/os.qcow2"\nimage_checksum = "00000000000000000000000000000000"'
    ),
}
NUMERIC_OPTIONS = [
    ("sim", "activities_per_second"),
    ("sim", "timeout"),
    ("static", "activities_per_second"),
    ("static", "graceful_timeout"),
    ("static", "power_back_timeout"),
    ("ironic", "activities_per_second"),
    ("ironic", "timeout"),
    ("ironic", "power_timeout"),
]


def instance_table(kind: str, option: str, value: str) -> str:
    return f'[[providers]]\nname = "rack1"\ntype = "{kind}"\n{TYPES[kind]}\n{option} = {value}\n'


@pytest.mark.parametrize("value", ["nan", "+inf", "-inf", "-1"])
@pytest.mark.parametrize(("kind", "option"), NUMERIC_OPTIONS)
def test_a_numeric_provider_option_that_is_not_a_finite_positive_number_is_refused(tmp_path, kind, option, value):
    path = tmp_path / "shepherd.toml"
    path.write_text(instance_table(kind, option, value))
    with pytest.raises(SettingsError) as raised:
        settings, _ = Settings.resolve({}, config_path=path)
        open_providers(settings.check())
    assert raised.value.setting == "providers"
    assert f"{option} must be" in str(raised.value) and "rack1" in str(raised.value)


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_the_same_tables_with_finite_numbers_are_taken(tmp_path, kind):
    options = "\n".join(f"{option} = 30" for each, option in NUMERIC_OPTIONS if each == kind)
    path = tmp_path / "shepherd.toml"
    path.write_text(
        f'reboot_timeout = "10m"\n[[providers]]\nname = "rack1"\ntype = "{kind}"\n{TYPES[kind]}\n{options}\n'
    )
    settings, _ = Settings.resolve({}, config_path=path)
    assert set(open_providers(settings.check())) == {"rack1"}
