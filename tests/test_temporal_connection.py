"""The Temporal connection from the Temporal CLI's configuration (TEMPORAL_*, temporal.toml), Shepherd's over it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from temporalio.service import RPCError, RPCStatusCode

from foundation.settings import Settings
from foundation.startup import StartupError, connect_temporal
from foundation.temporal_connection import TemporalConfigError, load_temporal_connection
from tests.temporal_proxy import make_certificates
from tests.test_cli import shepherd

NOWHERE = {"TEMPORAL_CONFIG_FILE": "/nonexistent/temporal.toml"}


def write_profiles(tmp_path: Path, text: str) -> dict[str, str]:
    path = tmp_path / "temporal.toml"
    path.write_text(text)
    return {"TEMPORAL_CONFIG_FILE": str(path)}


def test_nothing_configured_means_the_local_default():
    connection = load_temporal_connection(Settings(), NOWHERE)
    assert (connection.address, connection.namespace, connection.uses_tls) == ("localhost:7233", "default", False)
    assert connection.source("address") == "default"
    assert connection.connect_arguments() == {"target_host": "localhost:7233", "namespace": "default"}


def test_the_temporal_variables_give_the_connection_and_shepherds_settings_win():
    environ = {**NOWHERE, "TEMPORAL_ADDRESS": "temporal.example.net:7233", "TEMPORAL_NAMESPACE": "fleet"}
    connection = load_temporal_connection(Settings(), environ)
    assert (connection.address, connection.namespace) == ("temporal.example.net:7233", "fleet")
    assert connection.source("address") == "environment TEMPORAL_ADDRESS"

    ours = load_temporal_connection(Settings(temporal_namespace="shepherd"), environ)
    assert (ours.address, ours.namespace) == ("temporal.example.net:7233", "shepherd")
    assert ours.source("namespace") == "Shepherd setting temporal_namespace"


def test_a_profile_gives_mutual_tls_and_the_variables_override_it(tmp_path):
    issued = make_certificates(tmp_path / "certificates")
    environ = write_profiles(
        tmp_path,
        '[profile.prod]\naddress = "temporal.internal:7233"\nnamespace = "prod"\n'
        f'[profile.prod.tls]\nserver_name = "temporal.internal"\nserver_ca_cert_path = "{issued.ca}"\n'
        f'client_cert_path = "{issued.client.certificate}"\nclient_key_path = "{issued.client.key}"\n',
    )
    connection = load_temporal_connection(
        Settings(), {**environ, "TEMPORAL_PROFILE": "prod", "TEMPORAL_NAMESPACE": "other"}
    )
    assert (connection.address, connection.namespace, connection.uses_tls) == ("temporal.internal:7233", "other", True)
    assert connection.source("address") == f"profile prod of {environ['TEMPORAL_CONFIG_FILE']}"
    assert connection.source("namespace") == "environment TEMPORAL_NAMESPACE"
    tls = connection.connect_arguments()["tls"]
    assert tls.domain == "temporal.internal"
    assert tls.server_root_ca_cert == issued.ca.read_bytes()
    assert tls.client_private_key == issued.client.key.read_bytes()
    described = {part: (value, source) for part, value, source in connection.described()}
    assert described["tls_client_key"] == (str(issued.client.key), connection.source("address"))


def test_an_api_key_turns_tls_on_and_is_never_shown():
    connection = load_temporal_connection(
        Settings(), {**NOWHERE, "TEMPORAL_API_KEY": "sekrit-key", "TEMPORAL_GRPC_META_X_TEAM": "fleet"}
    )
    arguments = connection.connect_arguments()
    assert arguments["api_key"] == "sekrit-key" and arguments["rpc_metadata"] == {"x-team": "fleet"}
    assert arguments["tls"].server_root_ca_cert is None, "the system trust store"
    assert "sekrit-key" not in repr(connection.described())
    assert ("api_key", "***", "environment TEMPORAL_API_KEY") in connection.described()


# What the SDK says when the server or a proxy in front of it refuses the credentials (as the nginx of
# tests/temporal_proxy.py answers, see test_temporal_tls.py): a gRPC status, or an HTTP 401 with a page.
CONNECT_FAILED = "Failed client connect: `get_system_info` call error after connection: "
GRPC_REFUSAL = (
    CONNECT_FAILED + 'Status { code: Unauthenticated, message: "invalid API key", metadata: MetadataMap { headers: '
    '{"server": "nginx/1.22.1", "content-type": "application/grpc", "content-length": "0"} }, source: None }'
)
HTTP_REFUSAL = (
    CONNECT_FAILED + 'Status { code: Internal, message: "protocol error: received message with invalid compression '
    'flag: 60 (valid flags are 0 and 1) while receiving response with status: 401 Unauthorized", metadata: '
    'MetadataMap { headers: {"server": "nginx/1.22.1", "content-type": "text/html", "content-length": "179"} }, '
    "source: None }"
)
REFUSED_KEY = "the server refused the API key (environment TEMPORAL_API_KEY): check TEMPORAL_API_KEY"


@pytest.mark.parametrize("text", [GRPC_REFUSAL, HTTP_REFUSAL], ids=["grpc-status", "http-401"])
def test_a_refusal_of_the_credentials_names_the_api_key(text):
    connection = load_temporal_connection(Settings(), {**NOWHERE, "TEMPORAL_API_KEY": "sekrit-key"})
    assert connection.explain(RuntimeError(text)) == REFUSED_KEY
    assert connection.explain(RPCError("invalid API key", RPCStatusCode.UNAUTHENTICATED, b"")) == REFUSED_KEY


@pytest.mark.parametrize(
    "text",
    [
        CONNECT_FAILED + 'Status { code: NotFound, message: "Namespace fleet-401 is not found.", metadata: '
        "MetadataMap { headers: {} }, source: None }",
        CONNECT_FAILED + 'Status { code: Unavailable, message: "error trying to connect: tcp connect error: '
        'deadline has elapsed (127.0.0.1:4010)", metadata: MetadataMap { headers: {} }, source: None }',
        CONNECT_FAILED + 'Status { code: Internal, message: "protocol error", metadata: MetadataMap { headers: '
        '{"content-type": "text/html", "content-length": "401"} }, source: None }',
    ],
    ids=["namespace", "port", "content-length"],
)
def test_a_401_elsewhere_in_the_error_is_no_refusal_of_the_credentials(text):
    connection = load_temporal_connection(
        Settings(), {**NOWHERE, "TEMPORAL_API_KEY": "sekrit-key", "TEMPORAL_ADDRESS": "127.0.0.1:4010"}
    )
    assert connection.explain(RuntimeError(text)) == text


@pytest.mark.parametrize(
    ("environ", "problem"),
    [
        ({"TEMPORAL_PROFILE": "prod"}, "Profile 'prod' not found"),
        ({"TEMPORAL_TLS_CLIENT_CERT_PATH": "/etc/shepherd/client.pem"}, "needs its key: set TEMPORAL_TLS_CLIENT_KEY"),
        ({"TEMPORAL_TLS_CLIENT_KEY_PATH": "/etc/shepherd/client.key"}, "needs its certificate: set TEMPORAL_TLS"),
    ],
)
def test_an_unusable_configuration_is_one_error_naming_what_to_fix(environ, problem):
    with pytest.raises(TemporalConfigError, match=problem):
        load_temporal_connection(Settings(), {**NOWHERE, **environ})


def test_a_broken_profile_file_is_named(tmp_path):
    environ = write_profiles(tmp_path, "[profile.prod\n")
    with pytest.raises(TemporalConfigError, match=r"TEMPORAL_CONFIG_FILE.*TOML parse error"):
        load_temporal_connection(Settings(), environ)


def test_a_certificate_that_cannot_be_read_names_its_variable():
    environ = {**NOWHERE, "TEMPORAL_TLS_SERVER_CA_CERT_PATH": "/nonexistent/ca.pem"}
    connection = load_temporal_connection(Settings(), environ)
    with pytest.raises(TemporalConfigError) as caught:
        connection.connect_arguments()
    assert str(caught.value) == (
        "cannot read the TLS server CA certificate at /nonexistent/ca.pem (environment "
        "TEMPORAL_TLS_SERVER_CA_CERT_PATH): No such file or directory"
    )


async def test_commands_reach_temporal_through_the_temporal_variables_alone(temporal_env, shepherd_cli, bmdb_url):
    environ = {
        **NOWHERE,
        "TEMPORAL_ADDRESS": temporal_env.client.service_client.config.target_host,
        "TEMPORAL_NAMESPACE": temporal_env.client.namespace,
        "SHEPHERD_DATABASE_URL": bmdb_url,
    }
    code, _, err = await shepherd_cli(environ, "machines")
    assert code == 0, err
    code, _, err = await shepherd_cli({**environ, "TEMPORAL_ADDRESS": "127.0.0.1:1"}, "machines")
    assert code == 1 and "cannot reach Temporal at 127.0.0.1:1 (environment TEMPORAL_ADDRESS)" in err


def test_config_shows_the_connection_and_where_each_part_came_from(tmp_path):
    environ = {**NOWHERE, "TEMPORAL_ADDRESS": "t.example.net:7233", "TEMPORAL_API_KEY": "sekrit"}
    result = shepherd("config", env=environ)
    assert result.returncode == 0, result.stderr
    assert "#   address = t.example.net:7233  (environment TEMPORAL_ADDRESS)" in result.stdout
    assert "#   api_key = ***  (environment TEMPORAL_API_KEY)" in result.stdout
    assert "sekrit" not in result.stdout
    shown = json.loads(shepherd("config", "--json", env=environ).stdout)
    assert {"part": "namespace", "value": "default", "source": "default"} in shown["temporal_connection"]


API_KEY = "sk-live-0123456789abcdef"
# api_key lines an operator could get wrong; the SDK's own error quotes each of them whole.
BROKEN_KEY_LINES = {
    "unquoted": f"api_key = {API_KEY}",
    "unterminated": f'api_key = "{API_KEY}',
    "not a string": f'api_key = ["{API_KEY}"]',
    "trailing text": f'api_key = "{API_KEY}" {API_KEY}',
}


@pytest.mark.parametrize("line", list(BROKEN_KEY_LINES.values()), ids=list(BROKEN_KEY_LINES))
def test_a_malformed_api_key_line_is_named_without_the_key(tmp_path, line):
    environ = write_profiles(tmp_path, f'[profile.default]\naddress = "127.0.0.1:1"\n{line}\n')
    with pytest.raises(TemporalConfigError) as caught:
        load_temporal_connection(Settings(), environ)
    message = str(caught.value)
    assert "\n" not in message and "0123456789" not in message, message
    assert message.startswith(f"cannot use the Temporal client configuration (profile default of {tmp_path}/")
    assert "TOML parse error at line 3, column " in message and " (key api_key): " in message


def test_a_value_of_the_wrong_type_is_not_quoted(tmp_path):
    environ = write_profiles(tmp_path, f'[profile.default]\n[profile.default.tls]\ndisabled = "{API_KEY}"\n')
    with pytest.raises(TemporalConfigError) as caught:
        load_temporal_connection(Settings(), environ)
    assert str(caught.value).endswith(
        "line 3, column 12 (key disabled): invalid type: string (value not shown), expected a boolean"
    )


async def test_a_broken_api_key_line_is_echoed_neither_at_start_nor_by_config_or_doctor(tmp_path, shepherd_cli):
    environ = write_profiles(tmp_path, f"[profile.default]\napi_key = {API_KEY}\n")
    with pytest.raises(StartupError) as refused:
        await connect_temporal(Settings(), environ=environ)
    assert "0123456789" not in str(refused.value) and "(key api_key)" in str(refused.value)

    env = {**environ, "SHEPHERD_STATE_DIR": str(tmp_path / "state")}
    code, out, err = await shepherd_cli(env, "config")
    assert (code, out) == (1, "") and "0123456789" not in err
    assert err.startswith(
        f"shepherd config: cannot use the Temporal client configuration (profile default of {tmp_path}"
    )
    code, out, err = await shepherd_cli(env, "doctor", "--json")
    checks = {check["name"]: check for check in json.loads(out)["checks"]}
    assert code == 1 and "0123456789" not in out + err
    assert "TOML parse error at line 2, column 11 (key api_key): " in checks["temporal"]["detail"]
