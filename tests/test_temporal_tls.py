"""Temporal behind nginx as a gRPC proxy that demands client certificates or an API key: a fleet comes up through
it either way, and each way a TLS connection or an API key can be wrong is one line naming the cause and the
setting."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from foundation.settings import Settings
from foundation.startup import connect_temporal
from lifecycle.contracts import MachineStage
from tests.fleet_stack import fleet_stack
from tests.temporal_proxy import SERVER_NAME, ProxyCertificates, TemporalProxy, make_certificates
from tests.test_fleet import nodes


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> ProxyCertificates:
    return make_certificates(tmp_path_factory.mktemp("certificates"))


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, temporal_env, certificates) -> Iterator[TemporalProxy]:
    upstream = temporal_env.client.service_client.config.target_host
    running = TemporalProxy(tmp_path_factory.mktemp("nginx"), upstream, certificates)
    yield running
    running.stop()


def mutual_tls(proxy: TemporalProxy, certificates: ProxyCertificates, namespace: str) -> dict[str, str]:
    """The Temporal CLI's variables of a worker allowed through the proxy."""
    return {
        "TEMPORAL_CONFIG_FILE": "/nonexistent/temporal.toml",
        "TEMPORAL_ADDRESS": proxy.address,
        "TEMPORAL_NAMESPACE": namespace,
        "TEMPORAL_TLS_SERVER_NAME": SERVER_NAME,
        "TEMPORAL_TLS_SERVER_CA_CERT_PATH": str(certificates.ca),
        "TEMPORAL_TLS_CLIENT_CERT_PATH": str(certificates.client.certificate),
        "TEMPORAL_TLS_CLIENT_KEY_PATH": str(certificates.client.key),
    }


def api_key(address: str, certificates: ProxyCertificates, namespace: str, key: str | None) -> dict[str, str]:
    """The Temporal CLI's variables of a client that shows an API key, and no client certificate, to the proxy."""
    variables = {
        "TEMPORAL_CONFIG_FILE": "/nonexistent/temporal.toml",
        "TEMPORAL_ADDRESS": address,
        "TEMPORAL_NAMESPACE": namespace,
        # The proxy's certificate is from the tests' own CA, not one of the system's.
        "TEMPORAL_TLS_SERVER_NAME": SERVER_NAME,
        "TEMPORAL_TLS_SERVER_CA_CERT_PATH": str(certificates.ca),
    }
    if key is not None:
        variables["TEMPORAL_API_KEY"] = key
    return variables


def set_environment(monkeypatch, variables: dict[str, str]) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


async def test_a_fleet_comes_up_through_a_proxy_that_demands_client_certificates(
    tmp_path, monkeypatch, proxy, certificates, temporal_client, bmdb_url, shepherd_cli
):
    variables = mutual_tls(proxy, certificates, temporal_client.namespace)
    set_environment(monkeypatch, variables)
    client = await connect_temporal(Settings())
    assert client.service_client.config.target_host == proxy.address
    async with fleet_stack(tmp_path, client, bmdb_url, machines=2) as stack:
        await stack.run_pass()
        await stack.wait_for_stage(nodes(2), MachineStage.WATCHING)
        # The operator's commands go the same way, with nothing but the Temporal variables.
        code, out, err = await shepherd_cli({**variables, "SHEPHERD_DATABASE_URL": bmdb_url}, "status", "node-0002")
        assert code == 0, err
        assert "WATCHING" in out


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        pytest.param(
            {"TEMPORAL_TLS_SERVER_CA_CERT_PATH": "other_ca"},
            "the server's certificate is not signed by a CA in {other_ca} (environment "
            "TEMPORAL_TLS_SERVER_CA_CERT_PATH): give the CA that issued the server's certificate",
            id="wrong-ca",
        ),
        pytest.param(
            {"TEMPORAL_TLS_CLIENT_CERT_PATH": None, "TEMPORAL_TLS_CLIENT_KEY_PATH": None},
            "the server demands a client certificate (mutual TLS): set TEMPORAL_TLS_CLIENT_CERT_PATH and "
            "TEMPORAL_TLS_CLIENT_KEY_PATH",
            id="no-client-certificate",
        ),
        pytest.param(
            {"TEMPORAL_TLS_CLIENT_CERT_PATH": "stranger.certificate", "TEMPORAL_TLS_CLIENT_KEY_PATH": "stranger.key"},
            "the server refused the client certificate {stranger.certificate} (environment "
            "TEMPORAL_TLS_CLIENT_CERT_PATH): it is not issued by a CA the server trusts, or revoked",
            id="rejected-client-certificate",
        ),
        pytest.param(
            {"TEMPORAL_TLS_CLIENT_CERT_PATH": "expired.certificate", "TEMPORAL_TLS_CLIENT_KEY_PATH": "expired.key"},
            "the TLS client certificate ({expired.certificate}, environment TEMPORAL_TLS_CLIENT_CERT_PATH) expired on",
            id="expired-client-certificate",
        ),
        pytest.param(
            {"TEMPORAL_TLS_SERVER_NAME": "elsewhere.test"},
            f"the server's certificate is for {SERVER_NAME}, not elsewhere.test (environment "
            "TEMPORAL_TLS_SERVER_NAME): set the server name to one of them",
            id="wrong-server-name",
        ),
    ],
)
async def test_each_tls_mistake_is_one_line_naming_the_cause_and_the_setting(
    changes, problem, proxy, certificates, temporal_env, shepherd_cli, bmdb_url
):
    files = {
        "other_ca": certificates.other_ca,
        "stranger.certificate": certificates.stranger_client.certificate,
        "stranger.key": certificates.stranger_client.key,
        "expired.certificate": certificates.expired_client.certificate,
        "expired.key": certificates.expired_client.key,
    }
    variables = mutual_tls(proxy, certificates, temporal_env.client.namespace)
    for name, value in changes.items():
        if value is None:
            variables.pop(name)
        else:
            variables[name] = str(files.get(value, value))
    code, out, err = await shepherd_cli({**variables, "SHEPHERD_DATABASE_URL": bmdb_url}, "machines")
    expected = problem.format(
        other_ca=certificates.other_ca,
        stranger=certificates.stranger_client,
        expired=certificates.expired_client,
    )
    assert (code, out) == (1, "") and len(err.splitlines()) == 1, err
    assert expected in err, err
    assert "Traceback" not in err


async def test_a_fleet_comes_up_through_a_proxy_that_demands_an_api_key(
    tmp_path, monkeypatch, proxy, certificates, temporal_client, bmdb_url, shepherd_cli
):
    variables = api_key(proxy.api_key_address, certificates, temporal_client.namespace, proxy.api_key)
    set_environment(monkeypatch, variables)
    client = await connect_temporal(Settings())
    assert client.service_client.config.target_host == proxy.api_key_address
    async with fleet_stack(tmp_path, client, bmdb_url, machines=1) as stack:
        await stack.run_pass()
        await stack.wait_for_stage(nodes(1), MachineStage.WATCHING)
        code, out, err = await shepherd_cli({**variables, "SHEPHERD_DATABASE_URL": bmdb_url}, "status", "node-0001")
        assert code == 0, err
        assert "WATCHING" in out


@pytest.mark.parametrize("door", ["grpc-status", "http-401"])
@pytest.mark.parametrize(
    ("sends_key", "problem"),
    [
        pytest.param(
            True,
            "the server refused the API key (environment TEMPORAL_API_KEY): check TEMPORAL_API_KEY",
            id="wrong-key",
        ),
        pytest.param(
            False,
            "the server demands credentials: an API key (TEMPORAL_API_KEY) or a client certificate",
            id="no-key",
        ),
    ],
)
async def test_a_refused_api_key_is_one_line_naming_the_setting_and_never_the_key(
    door, sends_key, problem, proxy, certificates, temporal_env, shepherd_cli, bmdb_url
):
    address = proxy.api_key_address if door == "grpc-status" else proxy.api_key_http_address
    # Close to the right key, so that a message quoting either would be caught below.
    wrong = f"{proxy.api_key[:-4]}XXXX"
    variables = api_key(address, certificates, temporal_env.client.namespace, wrong if sends_key else None)
    code, out, err = await shepherd_cli({**variables, "SHEPHERD_DATABASE_URL": bmdb_url}, "machines")
    assert (code, out) == (1, "") and len(err.splitlines()) == 1, err
    assert problem in err, err
    assert wrong not in err and proxy.api_key not in err
    assert proxy.api_key[:8] not in err and "Bearer" not in err
    assert "Traceback" not in err


@pytest.mark.parametrize("right", [True, False], ids=["right-key", "wrong-key"])
async def test_an_api_key_from_a_profile_gets_through_or_is_named_by_its_profile(
    right, tmp_path, proxy, certificates, temporal_env, shepherd_cli, bmdb_url
):
    """A temporal.toml profile keeps the key out of the environment (the systemd unit passes one as a credential);
    a refusal then names the profile, not a variable that is not set."""
    key = proxy.api_key if right else f"{proxy.api_key[:-4]}XXXX"
    profile = tmp_path / "temporal.toml"
    profile.write_text(
        f'[profile.default]\naddress = "{proxy.api_key_address}"\nnamespace = "{temporal_env.client.namespace}"\n'
        f'api_key = "{key}"\n'
        f'[profile.default.tls]\nserver_name = "{SERVER_NAME}"\nserver_ca_cert_path = "{certificates.ca}"\n'
    )
    variables = {"TEMPORAL_CONFIG_FILE": str(profile), "SHEPHERD_DATABASE_URL": bmdb_url}
    code, out, err = await shepherd_cli(variables, "machines")
    if right:
        assert (code, err) == (0, ""), err
        return
    assert (code, out) == (1, "") and len(err.splitlines()) == 1, err
    assert f"the server refused the API key (profile default of {profile}): check api_key in the profile" in err
    assert key not in err and proxy.api_key not in err
