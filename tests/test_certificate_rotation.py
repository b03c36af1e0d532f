"""Certificate rotation without downtime, over real gRPC and real TLS: the heartbeat server serves a renewed
certificate to new connections without a restart, keeps the pair before when the new one is bad, agents given a CA
bundle trust a certificate of the new CA, and every process exports how many days its certificates have left."""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlencode, urlsplit, urlunsplit

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from temporalio.service import TLSConfig

from agent.build import build_agent_executable
from agent.heartbeat import signed_heartbeat
from agent.reference import LOG_FILE, STATE_DIR_VARIABLE
from bmdb.store import BMDB
from foundation.files import replace_file
from foundation.metrics import (
    AGENT_ENDPOINT_CA,
    BMDB_CLIENT_CERTIFICATE,
    CERTIFICATE_EXPIRY,
    HEARTBEAT_SERVER_CERTIFICATE,
    TEMPORAL_CLIENT_CERTIFICATE,
    CertificateExpiry,
    meter_of,
    metrics_runtime,
)
from foundation.setting_values import SettingsError
from foundation.settings import Settings
from foundation.tls import (
    CertificateAuthority,
    agent_ca_bundle_file,
    days_left,
    load_ca_certificates,
    subject_alternative_name,
)
from lifecycle.takeover import TakeoverSettings, takeover_init
from processes.heartbeat_server import ServingCertificate, build_server, run_heartbeat_server
from processes.heartbeat_service import HeartbeatService
from processes.worker import watch_certificates
from proto import agent_api_pb2_grpc, takeover_pb2
from tests.ports import free_port, free_ports
from tests.processes import kill_processes_mentioning
from tests.test_agent_heartbeats import heartbeat_after
from tests.test_heartbeat_processes import server_processes, two_free_ports
from tests.test_observability import scrape, total

HOST = "127.0.0.1"
NOW = datetime.datetime.now(datetime.UTC)
# Long enough for any poll below; each ends as soon as what it waits for is there.
DEADLINE = 30.0

T = TypeVar("T")


def authority(name: str, days: float = 3650) -> CertificateAuthority:
    return CertificateAuthority(name, NOW - datetime.timedelta(minutes=5), NOW + datetime.timedelta(days=days))


def server_pair(issuer: CertificateAuthority, days: float = 365, starts_in: float = -300) -> tuple[bytes, bytes]:
    """(certificate, key) PEM for the heartbeat server at HOST, valid for days from starts_in seconds from now."""
    start = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=starts_in)
    return issuer.issue(HOST, start, start + datetime.timedelta(days=days), subject_alternative_name(HOST))


def serial_of(certificate_pem: bytes) -> int:
    return x509.load_pem_x509_certificate(certificate_pem).serial_number


@dataclass
class TLSFiles:
    """The heartbeat server's certificate and key files, which the tests replace as an operator would."""

    certificate: Path
    key: Path

    def install(self, pair: tuple[bytes, bytes]) -> None:
        """Each file replaced whole (written beside, renamed over), key first."""
        certificate, key = pair
        replace_file(self.key, key, 0o600)
        replace_file(self.certificate, certificate, 0o644)


@pytest.fixture
def tls_files(tmp_path: Path) -> TLSFiles:
    directory = tmp_path / "tls"
    directory.mkdir()
    return TLSFiles(directory / "server.pem", directory / "server-key.pem")


def served_certificate(port: int, *cas: CertificateAuthority) -> x509.Certificate:
    """The certificate the server shows a new TLS connection, verified against cas."""
    context = ssl.create_default_context(cadata="".join(ca.certificate_pem.decode() for ca in cas))
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection((HOST, port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=HOST) as connection,
    ):
        der = connection.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


async def served_serial(port: int, *cas: CertificateAuthority) -> int:
    return (await asyncio.to_thread(served_certificate, port, *cas)).serial_number


async def eventually(check: Callable[[], Awaitable[T | None]], what: str) -> T:
    """check's first true answer, polled until DEADLINE."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while True:
        value = await check()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"{what} not within {DEADLINE}s")
        await asyncio.sleep(0.05)


async def admit_agent(bmdb: BMDB, provider_id: str) -> tuple[uuid.UUID, Ed25519PrivateKey]:
    machine_id, _ = await bmdb.admit_machine("sim", provider_id)
    key = Ed25519PrivateKey.generate()
    await bmdb.record_agent_started(
        machine_id, datetime.datetime.now(datetime.UTC), key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    )
    return machine_id, key


@dataclass
class ReferenceAgent:
    """The built reference agent on a machine of its own, run as a takeover runs it: it answers and detaches."""

    machine_id: uuid.UUID
    state_dir: Path

    async def take_over(self, executable: Path, init: takeover_pb2.TakeoverInit, bmdb: BMDB) -> None:
        completed = await asyncio.to_thread(
            subprocess.run,
            [str(executable)],
            input=init.SerializeToString(),
            capture_output=True,
            env={STATE_DIR_VARIABLE: str(self.state_dir), "PATH": "/usr/bin:/bin"},
            timeout=30,
            check=True,
        )
        response = takeover_pb2.TakeoverResponse.FromString(completed.stdout)
        assert response.WhichOneof("result") == "success", response
        await bmdb.record_agent_started(self.machine_id, datetime.datetime.now(datetime.UTC), response.success.key)

    def log(self) -> str:
        path = self.state_dir / LOG_FILE
        return path.read_text() if path.exists() else ""


@pytest.fixture
def reference_agents(tmp_path: Path) -> Iterator[Callable[[uuid.UUID], ReferenceAgent]]:
    made: list[ReferenceAgent] = []

    def make(machine_id: uuid.UUID) -> ReferenceAgent:
        state_dir = tmp_path / f"agent-{len(made)}"
        state_dir.mkdir()
        made.append(ReferenceAgent(machine_id, state_dir))
        return made[-1]

    yield make
    for agent in made:
        kill_processes_mentioning(str(agent.state_dir))


@pytest.fixture(scope="module")
def agent_executable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_agent_executable(tmp_path_factory.mktemp("build") / "agent")


def init_for(machine_id: uuid.UUID, port: int, ca_file: Path) -> takeover_pb2.TakeoverInit:
    """The TakeoverInit a worker sends, with the CA bundle in ca_file."""
    settings = TakeoverSettings.of(Settings(agent_endpoint=f"{HOST}:{port}"), b"", load_ca_certificates(ca_file))
    return takeover_init(str(machine_id), settings)


async def test_a_renewed_certificate_reaches_new_connections_while_an_agent_heartbeats_on(
    bmdb, tls_files, tmp_path, reference_agents, agent_executable
):
    ca = authority("fleet CA")
    first, renewed = server_pair(ca), server_pair(ca)
    tls_files.install(first)
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(ca.certificate_pem)
    service = HeartbeatService(bmdb, interval=0.05, max_skew=60.0)
    server, port = build_server(service, f"{HOST}:0", (tls_files.certificate, tls_files.key))
    await server.start()
    try:
        agent = reference_agents((await bmdb.admit_machine("sim", "node-0001"))[0])
        await agent.take_over(agent_executable, init_for(agent.machine_id, port, ca_file), bmdb)
        await heartbeat_after(bmdb, agent.machine_id, None)
        assert await served_serial(port, ca) == serial_of(first[0])

        tls_files.install(renewed)

        async def renewed_served() -> bool:
            return await served_serial(port, ca) == serial_of(renewed[0])

        await eventually(renewed_served, "the renewed certificate served to a new connection")
        accepted = service.results["accepted"]

        # The agent's connection, opened before the renewal, goes on being accepted.
        async def accepted_since() -> bool:
            return service.results["accepted"] >= accepted + 3

        await eventually(accepted_since, "heartbeats after the renewal")
        # A new agent connection, over the renewed certificate, is accepted too.
        other_id, other_key = await admit_agent(bmdb, "node-0002")
        credentials = grpc.ssl_channel_credentials(root_certificates=ca.certificate_pem)
        async with grpc.aio.secure_channel(f"{HOST}:{port}", credentials) as channel:
            await agent_api_pb2_grpc.AgentCallbackStub(channel).Heartbeat(signed_heartbeat(str(other_id), other_key))
        assert "heartbeat failed" not in agent.log(), "no heartbeat of the agent failed"
        assert set(service.results) == {"accepted"}
    finally:
        await server.stop(None)
        await service.close()


def half_written(pair: tuple[bytes, bytes], files: TLSFiles) -> Path:
    """The certificate file caught while it is being written in place: a writer that does not rename."""
    certificate, key = pair
    replace_file(files.key, key, 0o600)
    files.certificate.write_bytes(certificate[: len(certificate) // 2])
    return files.certificate


def another_key(pair: tuple[bytes, bytes], files: TLSFiles) -> Path:
    """A renewed certificate beside a key that is not its own (the old one, say)."""
    files.certificate.write_bytes(pair[0])
    return files.key


def key_not_pem(pair: tuple[bytes, bytes], files: TLSFiles) -> Path:
    files.install((pair[0], b"-----BEGIN PRIVATE KEY-----\nnot base64 at all\n-----END PRIVATE KEY-----\n"))
    return files.key


def expired(pair: tuple[bytes, bytes], files: TLSFiles) -> Path:
    ca = authority("fleet CA")
    files.install(server_pair(ca, days=1, starts_in=-3 * 86400))
    return files.certificate


@pytest.mark.parametrize(
    ("spoil", "problem"),
    [
        (half_written, "holds a PEM certificate that does not parse"),
        (another_key, "do not belong together: the certificate is for another key"),
        (key_not_pem, "holds no PEM private key that parses"),
        (expired, "expired on"),
    ],
)
async def test_a_bad_new_pair_keeps_the_one_before_served_and_is_logged_once(bmdb, tls_files, caplog, spoil, problem):
    ca = authority("fleet CA")
    first, renewed = server_pair(ca), server_pair(ca)
    tls_files.install(first)
    service = HeartbeatService(bmdb, interval=30.0, max_skew=60.0)
    server, port = build_server(service, f"{HOST}:0", (tls_files.certificate, tls_files.key))
    await server.start()
    try:
        caplog.set_level(logging.WARNING, logger="shepherd.heartbeat")
        at_fault = spoil(renewed, tls_files)
        # Every new connection still gets the pair before, and the change is logged once, not once a connection.
        for _ in range(4):
            assert await served_serial(port, ca) == serial_of(first[0])
        lines = [record.getMessage() for record in caplog.records if "not reloaded" in record.getMessage()]
        assert len(lines) == 1, lines
        assert str(at_fault) in lines[0] and problem in lines[0]

        # Mended: the next connection gets the renewed pair.
        tls_files.install(renewed)
        assert await served_serial(port, ca) == serial_of(renewed[0])
    finally:
        await server.stop(None)
        await service.close()


async def test_a_certificate_not_valid_yet_is_served_once_it_is(bmdb, tls_files, caplog):
    ca = authority("fleet CA")
    first, early = server_pair(ca), server_pair(ca, starts_in=3)
    tls_files.install(first)
    serving = ServingCertificate(tls_files.certificate, tls_files.key, not_before_margin=1.0)
    service = HeartbeatService(bmdb, interval=30.0, max_skew=60.0)
    server, port = build_server(service, f"{HOST}:0", serving)
    await server.start()
    try:
        tls_files.install(early)
        assert await served_serial(port, ca) == serial_of(first[0])
        assert any("is valid only from" in record.getMessage() for record in caplog.records)

        # The files do not change again: the pair is tried again once its validity has begun, and a margin after.
        async def early_served() -> bool:
            return await served_serial(port, ca) == serial_of(early[0])

        await eventually(early_served, "the certificate served once valid")
    finally:
        await server.stop(None)
        await service.close()


def test_a_bad_pair_at_start_names_the_setting(tls_files):
    ca = authority("fleet CA")
    certificate, _ = server_pair(ca)
    _, key = server_pair(ca)
    tls_files.install((certificate, key))
    with pytest.raises(SettingsError) as caught:
        ServingCertificate(tls_files.certificate, tls_files.key)
    assert caught.value.setting == "heartbeat_tls_key_path"
    assert "do not belong together" in str(caught.value)
    tls_files.certificate.write_bytes(b"")
    with pytest.raises(SettingsError) as caught:
        ServingCertificate(tls_files.certificate, tls_files.key)
    assert caught.value.setting == "heartbeat_tls_certificate_path"
    assert f"{tls_files.certificate} holds no PEM certificate" in str(caught.value)


def test_the_ca_bundle_is_read_whole_and_an_invalid_one_names_the_setting(tmp_path):
    old, new = authority("old CA"), authority("new CA")
    bundle = tmp_path / "ca-bundle.pem"
    bundle.write_bytes(old.certificate_pem + b"\n" + new.certificate_pem)
    ders = load_ca_certificates(bundle)
    assert [x509.load_der_x509_certificate(der).subject for der in ders] == [
        x509.load_pem_x509_certificate(ca.certificate_pem).subject for ca in (old, new)
    ]
    init = takeover_init("m-1", TakeoverSettings.of(Settings(agent_endpoint="h:1"), b"", ders))
    assert init.ca_certificate == ders[0] and list(init.ca_certificates) == list(ders)

    bundle.write_bytes(old.certificate_pem + new.certificate_pem[:200])
    with pytest.raises(SettingsError) as caught:
        load_ca_certificates(bundle)
    assert caught.value.setting == "agent_endpoint_ca_certificate_path"
    assert str(bundle) in str(caught.value)


async def test_agents_given_the_bundle_trust_a_certificate_from_the_new_ca(
    bmdb, tls_files, tmp_path, reference_agents, agent_executable
):
    old_ca, new_ca = authority("old CA"), authority("new CA")
    tls_files.install(server_pair(old_ca))
    service = HeartbeatService(bmdb, interval=0.2, max_skew=60.0)
    server, port = build_server(service, f"{HOST}:0", (tls_files.certificate, tls_files.key))
    await server.start()
    only_old, bundle = tmp_path / "ca-old.pem", tmp_path / "ca-bundle.pem"
    only_old.write_bytes(old_ca.certificate_pem)
    bundle.write_bytes(old_ca.certificate_pem + new_ca.certificate_pem)

    try:
        # Taken over once the workers hand out the bundle, while the old CA's certificate is served.
        early = reference_agents((await bmdb.admit_machine("sim", "node-0001"))[0])
        await early.take_over(agent_executable, init_for(early.machine_id, port, bundle), bmdb)
        before = await heartbeat_after(bmdb, early.machine_id, None)

        # The server moves to a certificate of the new CA, without a restart.
        renewed = server_pair(new_ca)
        tls_files.install(renewed)

        async def renewed_served() -> bool:
            return await served_serial(port, old_ca, new_ca) == serial_of(renewed[0])

        await eventually(renewed_served, "the new CA's certificate served")
        # The agent's own connection goes on; an agent taken over now connects afresh, to the new certificate.
        await heartbeat_after(bmdb, early.machine_id, before)
        late = reference_agents((await bmdb.admit_machine("sim", "node-0002"))[0])
        await late.take_over(agent_executable, init_for(late.machine_id, port, bundle), bmdb)
        await heartbeat_after(bmdb, late.machine_id, None)
        # An agent that knows only the old CA (taken over before the bundle) cannot connect to it.
        stranded = reference_agents((await bmdb.admit_machine("sim", "node-0003"))[0])
        await stranded.take_over(agent_executable, init_for(stranded.machine_id, port, only_old), bmdb)

        async def stranded_failed() -> bool:
            return "heartbeat failed 1 time(s) (UNAVAILABLE" in stranded.log()

        await eventually(stranded_failed, "the old-CA agent's failure")
        record = await bmdb.get_machine(stranded.machine_id)
        assert record is not None and record.agent_heartbeat_at is None
        # Neither failed to connect. (A first heartbeat may come before the test records the agent's key, and be
        # refused as NOT_ACCEPTED, as after a real takeover: that is not the certificate's doing.)
        failures = [line for line in (early.log() + late.log()).splitlines() if "heartbeat failed" in line]
        assert all("NOT_ACCEPTED" in line for line in failures), failures
    finally:
        await server.stop(None)
        await service.close()


def with_query(url: str, **parameters: str) -> str:
    parts = urlsplit(url)
    query = "&".join(part for part in (parts.query, urlencode(parameters)) if part)
    return urlunsplit(parts._replace(query=query))


def expiry_of(series: dict, certificate: str) -> float | None:
    wanted = ("certificate", certificate)
    values = [value for (name, labels), value in series.items() if name == CERTIFICATE_EXPIRY and wanted in labels]
    return values[0] if values else None


async def test_the_heartbeat_server_exports_the_days_its_certificates_have_left_and_follows_a_rotation(
    bmdb_url, tls_files, tmp_path
):
    ca = authority("fleet CA")
    first, renewed = server_pair(ca, days=90), server_pair(ca, days=400)
    tls_files.install(first)
    bmdb_certificate = tmp_path / "bmdb-client.pem"
    bmdb_certificate.write_bytes(ca.issue("shepherd", NOW, NOW + datetime.timedelta(days=30))[0])
    port, metrics_port = free_ports(2)
    settings = Settings(
        heartbeat_listen=f"{HOST}:{port}",
        heartbeat_tls_certificate_path=tls_files.certificate,
        heartbeat_tls_key_path=tls_files.key,
        metrics_listen=f"{HOST}:{metrics_port}",
    )
    stop = asyncio.Event()
    # libpq reads sslcert only for a TLS connection, which the tests' local PostgreSQL does not offer.
    serving = asyncio.create_task(
        run_heartbeat_server(settings, with_query(bmdb_url, sslcert=str(bmdb_certificate)), stop=stop)
    )
    try:

        async def exported(certificate: str, expected: float) -> bool:
            try:
                value = expiry_of(await scrape(metrics_port), certificate)
            except OSError:
                return False  # not serving /metrics yet
            return value is not None and abs(value - expected) < 0.01

        def days(pem: bytes) -> float:
            return days_left(x509.load_pem_x509_certificate(pem))

        await eventually(lambda: exported(HEARTBEAT_SERVER_CERTIFICATE, days(first[0])), "the server's 90 days")
        assert await exported(BMDB_CLIENT_CERTIFICATE, days(bmdb_certificate.read_bytes()))

        tls_files.install(renewed)
        # An agent's next connection gets the renewed certificate, and the gauge follows it.
        assert await served_serial(port, ca) == serial_of(renewed[0])
        await eventually(lambda: exported(HEARTBEAT_SERVER_CERTIFICATE, days(renewed[0])), "the renewed 400 days")
    finally:
        stop.set()
        await serving


@contextmanager
def two_processes(bmdb_url: str, port: int, metrics_port: int, tls_files: TLSFiles, tmp_path: Path) -> Iterator[None]:
    """`shepherd heartbeat-server --processes 2` serving TLS on port, /metrics on metrics_port and the next."""
    env = {
        **os.environ,
        "SHEPHERD_DATABASE_URL": bmdb_url,
        "SHEPHERD_STATE_DIR": str(tmp_path / "state"),
        "SHEPHERD_HEARTBEAT_LISTEN": f"{HOST}:{port}",
        "SHEPHERD_HEARTBEAT_TLS_CERTIFICATE_PATH": str(tls_files.certificate),
        "SHEPHERD_HEARTBEAT_TLS_KEY_PATH": str(tls_files.key),
        "SHEPHERD_METRICS_LISTEN": f"{HOST}:{metrics_port}",
    }
    command = [sys.executable, "-m", "shepherd", "heartbeat-server", "--processes", "2"]
    parent = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        for pid in server_processes(parent.pid):
            os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait()


async def test_each_of_several_server_processes_reloads_on_its_own(bmdb_url, tls_files, tmp_path):
    ca = authority("fleet CA")
    first, renewed = server_pair(ca, days=90), server_pair(ca, days=400)
    tls_files.install(first)
    port, metrics_port = free_port(), two_free_ports()
    with two_processes(bmdb_url, port, metrics_port, tls_files, tmp_path):

        async def exported_by_both(pem: bytes) -> bool:
            days = days_left(x509.load_pem_x509_certificate(pem))
            for number in range(2):
                try:
                    value = expiry_of(await scrape(metrics_port + number), HEARTBEAT_SERVER_CERTIFICATE)
                except OSError:
                    return False  # not started yet
                if value is None or abs(value - days) >= 0.01:
                    return False
            return True

        await eventually(lambda: exported_by_both(first[0]), "both processes serving the first certificate")
        tls_files.install(renewed)
        # New connections, spread by the kernel over both processes: each process serves the renewed pair.
        for _ in range(30):
            assert await served_serial(port, ca) == serial_of(renewed[0])
        await eventually(lambda: exported_by_both(renewed[0]), "both processes reloaded")


async def test_a_worker_exports_the_sooner_of_each_certificate_it_holds_and_its_file(tmp_path, monkeypatch):
    old_ca, new_ca = authority("old CA", days=10), authority("new CA", days=1000)
    client_ca = authority("Temporal client CA")
    held, renewed_on_disk = (client_ca.issue("worker", NOW, NOW + datetime.timedelta(days=d)) for d in (20, 400))
    client_certificate, client_key = tmp_path / "worker.pem", tmp_path / "worker.key"
    client_certificate.write_bytes(renewed_on_disk[0])
    client_key.write_bytes(renewed_on_disk[1])
    monkeypatch.setenv("TEMPORAL_TLS_CLIENT_CERT_PATH", str(client_certificate))
    monkeypatch.setenv("TEMPORAL_TLS_CLIENT_KEY_PATH", str(client_key))
    bundle = tmp_path / "ca-bundle.pem"
    bundle.write_bytes(old_ca.certificate_pem + new_ca.certificate_pem)
    metrics_port = free_port()
    # Held here: /metrics is served while the runtime lives.
    runtime = metrics_runtime(f"{HOST}:{metrics_port}", "worker")
    expiry = CertificateExpiry(meter_of(runtime))
    watch_certificates(
        expiry,
        Settings(agent_endpoint_ca_certificate_path=bundle),
        TLSConfig(client_cert=held[0], client_private_key=held[1]),
        agent_ca_bundle_file(bundle),
        "postgresql://shepherd@db.example.net/bmdb",
    )
    expiry.refresh()
    series = await scrape(metrics_port)

    def days(pem: bytes) -> float:
        return days_left(x509.load_pem_x509_certificate(pem))

    # The client certificate connected with expires before the renewed file: that one counts until a restart.
    assert abs(total(series, CERTIFICATE_EXPIRY, certificate=TEMPORAL_CLIENT_CERTIFICATE) - days(held[0])) < 0.01
    # The bundle is as good as the CA in it that expires first.
    assert abs(total(series, CERTIFICATE_EXPIRY, certificate=AGENT_ENDPOINT_CA) - days(old_ca.certificate_pem)) < 0.01
    assert expiry_of(series, BMDB_CLIENT_CERTIFICATE) is None, "no sslcert in the URL: nothing to watch"

    # The old CA leaves the bundle on disk: takeovers hand out the new bundle from now on, and it counts.
    replace_file(bundle, new_ca.certificate_pem, 0o644)
    expiry.refresh()
    series = await scrape(metrics_port)
    assert abs(total(series, CERTIFICATE_EXPIRY, certificate=AGENT_ENDPOINT_CA) - days(new_ca.certificate_pem)) < 0.01


@pytest.mark.parametrize(
    ("spoil", "problem"),
    [
        pytest.param(lambda bundle, _: bundle.unlink(), "No such file or directory", id="gone"),
        pytest.param(lambda bundle, _: replace_file(bundle, b"", 0o644), "holds no PEM certificate", id="empty"),
        pytest.param(
            lambda bundle, pem: replace_file(bundle, pem[: len(pem) // 2], 0o644),
            "holds a PEM certificate that does not parse",
            id="half-written",
        ),
    ],
)
async def test_a_bad_bundle_file_is_logged_once_and_the_bundle_in_use_still_counts(tmp_path, caplog, spoil, problem):
    ca, renewed = authority("fleet CA", days=50), authority("renewed fleet CA", days=500)
    bundle = tmp_path / "ca.pem"
    bundle.write_bytes(ca.certificate_pem)
    metrics_port = free_port()
    # Held here: /metrics is served while the runtime lives.
    runtime = metrics_runtime(f"{HOST}:{metrics_port}", "worker")
    expiry = CertificateExpiry(meter_of(runtime))
    settings = Settings(agent_endpoint_ca_certificate_path=bundle)
    in_use = agent_ca_bundle_file(bundle)
    watch_certificates(expiry, settings, None, in_use, "postgresql://h/db")
    spoil(bundle, renewed.certificate_pem)
    for _ in range(3):
        expiry.refresh()
    lines = [record.getMessage() for record in caplog.records if "not reloaded" in record.getMessage()]
    assert len(lines) == 1 and str(bundle) in lines[0] and problem in lines[0], lines
    assert lines[0].startswith("agents' CA bundle not reloaded, the one read before is used on: ")
    assert in_use.current() == der_bundle_of(ca)
    series = await scrape(metrics_port)
    held = days_left(x509.load_pem_x509_certificate(ca.certificate_pem))
    assert abs(total(series, CERTIFICATE_EXPIRY, certificate=AGENT_ENDPOINT_CA) - held) < 0.01

    # Mended: the renewed bundle is handed out and counts from the next refresh.
    replace_file(bundle, renewed.certificate_pem, 0o644)
    expiry.refresh()
    assert in_use.current() == der_bundle_of(renewed)
    series = await scrape(metrics_port)
    held = days_left(x509.load_pem_x509_certificate(renewed.certificate_pem))
    assert abs(total(series, CERTIFICATE_EXPIRY, certificate=AGENT_ENDPOINT_CA) - held) < 0.01
    assert len([record for record in caplog.records if "not reloaded" in record.getMessage()]) == 1


def der_bundle_of(issuer: CertificateAuthority) -> tuple[bytes, ...]:
    """The DER bundle a file holding only issuer's certificate gives."""
    return (x509.load_pem_x509_certificate(issuer.certificate_pem).public_bytes(Encoding.DER),)
