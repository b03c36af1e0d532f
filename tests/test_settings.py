import re
from pathlib import Path

import pytest

from foundation.setting_values import SettingsError, parse_duration
from foundation.settings import Settings
from foundation.settings_report import describe
from lifecycle.inputs import lifecycle_policy


def test_defaults_are_the_seeds():
    settings = Settings.from_env({}).check()
    assert settings.ssh_connect_timeout == 2.0
    assert settings.ssh_exec_timeout == 60.0
    assert settings.agent_target_path == "/root/agent"
    assert (settings.max_machines, settings.chunk_size) == (50, 20)
    assert settings.reconcile_interval == 900.0 and settings.device_creation_interval == 5.0
    assert settings.watchdog_interval == 60.0
    backoff = lifecycle_policy(settings).agent_start_backoff
    assert (backoff.initial, backoff.maximum, backoff.multiplier) == (300.0, 14400.0, 1.2)
    assert [backoff.delay(n) for n in (1, 2, 3)] == pytest.approx([300.0, 360.0, 432.0])
    assert backoff.delay(100) == 14400.0


def test_environment_values_are_typed():
    settings = Settings.from_env(
        {
            "SHEPHERD_SSH_EXEC_TIMEOUT": "2m",
            "SHEPHERD_MAX_MACHINES": "7",
            "SHEPHERD_STATE_DIR": "/var/lib/shepherd",
            "SHEPHERD_DATABASE_URL": "",
        }
    )
    assert settings.ssh_exec_timeout == 120.0
    assert settings.max_machines == 7
    assert settings.state_dir == Path("/var/lib/shepherd")
    assert settings.database_url is None


@pytest.mark.parametrize(
    "text, seconds", [("90", 90.0), ("1.5s", 1.5), ("250ms", 0.25), ("5m", 300.0), ("4h", 14400.0)]
)
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("environ", "setting"),
    [
        ({"SHEPHERD_SSH_CONNECT_TIMEOUT": "0"}, "ssh_connect_timeout"),
        ({"SHEPHERD_SSH_EXEC_TIMEOUT": "-5s"}, "ssh_exec_timeout"),
        ({"SHEPHERD_SSH_EXEC_TIMEOUT": "soon"}, "ssh_exec_timeout"),
        ({"SHEPHERD_CHUNK_SIZE": "0"}, "chunk_size"),
        ({"SHEPHERD_WATCHDOG_INTERVAL": "0"}, "watchdog_interval"),
        ({"SHEPHERD_WATCHDOG_INTERVAL": "soon"}, "watchdog_interval"),
        ({"SHEPHERD_MAX_MACHINES": "many"}, "max_machines"),
        ({"SHEPHERD_MAX_CACHED_WORKFLOWS": "-1"}, "max_cached_workflows"),
        ({"SHEPHERD_AGENT_START_BACKOFF_MULTIPLIER": "0.5"}, "agent_start_backoff_multiplier"),
        ({"SHEPHERD_PROVIDER": "Rack 1"}, "provider"),
        ({"SHEPHERD_DATABASE_URL": "mysql://x"}, "database_url"),
        ({"SHEPHERD_HEARTBEAT_DATABASE_URL": "mysql://x"}, "heartbeat_database_url"),
        ({"SHEPHERD_AGENT_TARGET_PATH": "agent"}, "agent_target_path"),
        ({"SHEPHERD_NO_SUCH_THING": "1"}, "no_such_thing"),
        ({"SHEPHERD_RECOVERY_HOLD_FRACTION": "nan"}, "recovery_hold_fraction"),
        ({"SHEPHERD_RECOVERY_BACKOFF_MULTIPLIER": "inf"}, "recovery_backoff_multiplier"),
        ({"SHEPHERD_MAX_ACTIVITIES_PER_SECOND": "NaN"}, "max_activities_per_second"),
        ({"SHEPHERD_HEARTBEAT_TIMEOUT": "1" + "0" * 400}, "heartbeat_timeout"),
        ({"SHEPHERD_HEARTBEAT_INTERVAL": "10m"}, "heartbeat_interval"),
        ({"SHEPHERD_HEARTBEAT_INTERVAL": "5m", "SHEPHERD_HEARTBEAT_TIMEOUT": "4m"}, "heartbeat_interval"),
        ({"SHEPHERD_HEARTBEAT_MAX_SKEW": "11m"}, "heartbeat_max_skew"),
        ({"SHEPHERD_HEARTBEAT_MAX_STREAMS_PER_ADDRESS": "-1"}, "heartbeat_max_streams_per_address"),
        ({"SHEPHERD_HEARTBEAT_MAX_STREAMS_PER_ADDRESS": "2.5"}, "heartbeat_max_streams_per_address"),
        ({"SHEPHERD_HEARTBEAT_MAX_STREAMS_PER_ADDRESS": "a few"}, "heartbeat_max_streams_per_address"),
        ({"SHEPHERD_HEARTBEAT_MAX_CONNECTIONS": "199999"}, "heartbeat_max_connections"),
        ({"SHEPHERD_HEARTBEAT_MAX_CONNECTIONS_PER_ADDRESS": "-1"}, "heartbeat_max_connections_per_address"),
        ({"SHEPHERD_HEARTBEAT_IDLE_TIMEOUT": "59s"}, "heartbeat_idle_timeout"),
        ({"SHEPHERD_HEARTBEAT_INTERVAL": "1m", "SHEPHERD_HEARTBEAT_IDLE_TIMEOUT": "1m"}, "heartbeat_idle_timeout"),
        ({"SHEPHERD_API_URL": "http://shepherd.example"}, "api_url"),
        ({"SHEPHERD_API_URL": "shepherd.example:8700"}, "api_url"),
        ({"SHEPHERD_API_URL": "https://shepherd.example/?as=admin"}, "api_url"),
        (
            {"SHEPHERD_API_URL": "https://shepherd.example", "SHEPHERD_API_CLIENT_CERTIFICATE_PATH": "/dev/null"},
            "api_client_key_path",
        ),
        (
            {"SHEPHERD_API_URL": "https://shepherd.example", "SHEPHERD_API_CA_PATH": "/nonexistent/ca.pem"},
            "api_ca_path",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_setting(environ, setting):
    with pytest.raises(SettingsError) as caught:
        Settings.from_env(environ).check()
    assert caught.value.setting == setting
    assert setting in str(caught.value)


def test_agent_settings_are_required_by_a_worker(tmp_path):
    with pytest.raises(SettingsError, match="agent_executable_path"):
        Settings.from_env({}).check_agent()
    agent = tmp_path / "agent"
    agent.write_bytes(b"#!/bin/sh\n")
    with pytest.raises(SettingsError, match="agent_endpoint"):
        Settings.from_env({"SHEPHERD_AGENT_EXECUTABLE_PATH": str(agent)}).check_agent()
    with pytest.raises(SettingsError, match="agent_executable_path"):
        Settings.from_env(
            {"SHEPHERD_AGENT_EXECUTABLE_PATH": str(tmp_path / "missing"), "SHEPHERD_AGENT_ENDPOINT": "h:1"}
        ).check_agent()
    with pytest.raises(SettingsError, match="agent_endpoint"):
        Settings.from_env(
            {"SHEPHERD_AGENT_EXECUTABLE_PATH": str(agent), "SHEPHERD_AGENT_ENDPOINT": "no-port"}
        ).check_agent()
    ok = Settings.from_env({"SHEPHERD_AGENT_EXECUTABLE_PATH": str(agent), "SHEPHERD_AGENT_ENDPOINT": "h:443"})
    assert ok.check_agent() is ok


def test_a_toml_file_sits_below_the_environment_and_flags(tmp_path):
    config = tmp_path / "shepherd.toml"
    config.write_text(
        'temporal_address = "temporal.example.net:7233"\nmax_machines = 7\nreconcile_interval = "2m"\n'
        "heartbeat_timeout = 90\nheartbeat_max_skew = 60\nheartbeat_plaintext = true\nchunk_size = 5\n"
        "state_dir = '/var/lib/shepherd'\n"
    )
    settings, sources = Settings.resolve(
        {"SHEPHERD_CHUNK_SIZE": "3", "SHEPHERD_CONFIG": str(config)}, task_queue="fleet-a"
    )
    settings.check()
    assert settings.temporal_address == "temporal.example.net:7233" and settings.max_machines == 7
    assert settings.reconcile_interval == 120.0 and settings.heartbeat_timeout == 90.0
    assert settings.heartbeat_plaintext is True and settings.state_dir == Path("/var/lib/shepherd")
    assert settings.chunk_size == 3 and settings.task_queue == "fleet-a"
    assert sources["max_machines"] == f"file {config}"
    assert sources["chunk_size"] == "environment SHEPHERD_CHUNK_SIZE" and sources["task_queue"] == "command line"
    assert "temporal_namespace" not in sources


@pytest.mark.parametrize(
    "text, setting, problem",
    [
        ("max_machine = 7\n", "max_machine", "is not a setting Shepherd knows (in "),
        ('max_machines = "seven"\n', "max_machines", "cannot use 'seven'"),
        ("max_machines = 7.5\n", "max_machines", "must be int, got 7.5 (float)"),
        ("heartbeat_plaintext = 1\n", "heartbeat_plaintext", "must be bool, got 1 (int)"),
        ("reconcile_interval = true\n", "reconcile_interval", "must be a duration, got True (bool)"),
        ('reconcile_interval = "soon"\n', "reconcile_interval", "'soon' is not a duration"),
        ("[temporal]\naddress = 'x'\n", "temporal", "is a table in"),
        ("max_machines = \n", "config", "is not valid TOML"),
    ],
)
def test_a_bad_toml_file_is_refused_naming_the_setting(tmp_path, text, setting, problem):
    config = tmp_path / "shepherd.toml"
    config.write_text(text)
    with pytest.raises(SettingsError) as caught:
        Settings.resolve({}, config_path=config)
    assert caught.value.setting == setting and problem in str(caught.value)


@pytest.mark.parametrize("literal", ["nan", "inf", "-inf"])
def test_toml_nan_and_inf_are_refused_at_check(tmp_path, literal):
    config = tmp_path / "shepherd.toml"
    config.write_text(f"recovery_hold_fraction = {literal}\nheartbeat_timeout = {literal}\n")
    with pytest.raises(SettingsError, match="must be a finite number"):
        Settings.resolve({}, config_path=config)[0].check()


def test_out_of_range_values_from_a_file_are_refused_at_check(tmp_path):
    config = tmp_path / "shepherd.toml"
    config.write_text("chunk_size = 0\n")
    with pytest.raises(SettingsError, match="setting chunk_size"):
        Settings.from_env({}, config_path=config).check()


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(SettingsError) as caught:
        Settings.resolve({"SHEPHERD_CONFIG": str(tmp_path / "nope.toml")})
    assert caught.value.setting == "config" and f"cannot read {tmp_path / 'nope.toml'}" in str(caught.value)


def readme_settings_table() -> list[tuple[str, str]]:
    """(variable, default as written) of every setting in the README's table; `A` / `_B` rows share A's stem."""
    known = {name for name, _, _ in describe()}
    rows = []
    for line in (Path(__file__).parent.parent / "README.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`SHEPHERD_"):
            continue
        names = re.findall(r"`([A-Z0-9_]+)`", cells[0])
        defaults = re.findall(r"`([^`]*)`", cells[1])
        first = names[0]
        variables = [first] + [
            next((first[:cut] + tail for cut in range(len(first), 0, -1) if first[:cut] + tail in known), tail)
            for tail in names[1:]
        ]
        written = defaults if len(defaults) == len(variables) else [""] * len(variables)
        rows += list(zip(variables, written, strict=True))
    return rows


def test_the_readme_states_the_settings_defaults_the_code_has():
    """The defaults live in Settings alone; the README's table must say the same or it is wrong."""
    rows = readme_settings_table()
    assert len(rows) >= 30, "the README's settings table was not found"
    known = {name for name, _, _ in describe()}
    assert [variable for variable, _ in rows if variable not in known] == []
    defaults = Settings()
    for variable, written in rows:
        name = variable.removeprefix("SHEPHERD_").lower()
        if written and getattr(defaults, name) is not None:
            assert getattr(Settings.from_env({variable: written}), name) == getattr(defaults, name), variable
