from pathlib import Path

import pytest

from shepherd.settings import Settings, SettingsError, parse_duration


def test_defaults_are_the_seeds():
    settings = Settings.from_env({}).check()
    assert settings.ssh_connect_timeout == 2.0
    assert settings.ssh_exec_timeout == 60.0
    assert settings.agent_target_path == "/root/agent"
    assert (settings.max_machines, settings.chunk_size) == (50, 20)
    assert settings.reconcile_interval == 60.0 and settings.device_creation_interval == 5.0
    backoff = settings.agent_start_backoff
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
        ({"SHEPHERD_MAX_MACHINES": "many"}, "max_machines"),
        ({"SHEPHERD_AGENT_START_BACKOFF_MULTIPLIER": "0.5"}, "agent_start_backoff_multiplier"),
        ({"SHEPHERD_PROVIDER": "aws"}, "provider"),
        ({"SHEPHERD_DATABASE_URL": "mysql://x"}, "database_url"),
        ({"SHEPHERD_AGENT_TARGET_PATH": "agent"}, "agent_target_path"),
        ({"SHEPHERD_NO_SUCH_THING": "1"}, "no_such_thing"),
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
