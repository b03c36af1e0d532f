"""The heartbeat server checks a renewed certificate as the agents will before it serves it: one for another name
than the host agents call, or from a CA they do not trust, is refused, logged and counted, and the pair before
serves on; at start such a pair names its setting."""

from __future__ import annotations

import asyncio
import datetime
import functools
import logging
from pathlib import Path

import pytest
from cryptography import x509

from foundation.agent_trust import names_host
from foundation.setting_values import SettingsError
from foundation.settings import Settings
from foundation.tls import CertificateAuthority, subject_alternative_name
from processes.heartbeat_server import ServingCertificate, agent_trust, run_heartbeat_server
from tests.ports import free_ports
from tests.test_certificate_rotation import (
    HOST,
    TLSFiles,
    authority,
    eventually,
    serial_of,
    served_serial,
    server_pair,
)
from tests.test_observability import scrape, total

REFUSED = "shepherd_heartbeat_certificate_reloads_refused_total"


@pytest.fixture
def tls_files(tmp_path: Path) -> TLSFiles:
    directory = tmp_path / "tls"
    directory.mkdir()
    return TLSFiles(directory / "server.pem", directory / "server-key.pem")


def pair_for(issuer: CertificateAuthority, host: str) -> tuple[bytes, bytes]:
    now = datetime.datetime.now(datetime.UTC)
    return issuer.issue(
        host, now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=90), subject_alternative_name(host)
    )


async def test_a_renewal_the_agents_would_refuse_is_not_served_and_is_counted(bmdb_url, tls_files, tmp_path, caplog):
    ca, stranger = authority("fleet CA"), authority("someone else's CA")
    first, renewed = server_pair(ca), server_pair(ca)
    tls_files.install(first)
    ca_file = tmp_path / "agents-ca.pem"
    ca_file.write_bytes(ca.certificate_pem)
    port, metrics_port = free_ports(2)
    settings = Settings(
        heartbeat_listen=f"{HOST}:{port}",
        heartbeat_tls_certificate_path=tls_files.certificate,
        heartbeat_tls_key_path=tls_files.key,
        metrics_listen=f"{HOST}:{metrics_port}",
        agent_endpoint=f"{HOST}:{port}",
        agent_endpoint_ca_certificate_path=ca_file,
    )
    caplog.set_level(logging.WARNING, logger="shepherd.tls")
    stop = asyncio.Event()
    serving = asyncio.create_task(run_heartbeat_server(settings, bmdb_url, stop=stop))
    try:

        async def refused(count: int) -> bool:
            try:
                return total(await scrape(metrics_port), REFUSED) == count
            except OSError:
                return False  # not serving /metrics yet

        async def first_served() -> bool:
            try:
                return await served_serial(port, ca) == serial_of(first[0])
            except OSError:
                return False  # not listening yet

        await eventually(first_served, "the first certificate served")
        for count, (wrong, problem) in enumerate(
            [
                (pair_for(ca, "heartbeat.example.net"), f"not for {HOST}, the host agents call"),
                (server_pair(stranger), "not issued by a CA agents trust"),
            ],
            start=1,
        ):
            tls_files.install(wrong)
            # A new connection still gets the pair before: the agents never see the wrong one.
            assert await served_serial(port, ca) == serial_of(first[0])
            lines = [record.getMessage() for record in caplog.records if problem in record.getMessage()]
            assert len(lines) == 1, lines
            assert str(tls_files.certificate) in lines[0]
            await eventually(functools.partial(refused, count), f"{count} refused reload(s) counted")

        tls_files.install(renewed)
        assert await served_serial(port, ca) == serial_of(renewed[0])
    finally:
        stop.set()
        await serving


def test_a_pair_the_agents_would_refuse_at_start_names_the_setting(tls_files, tmp_path):
    ca = authority("fleet CA")
    ca_file = tmp_path / "agents-ca.pem"
    ca_file.write_bytes(ca.certificate_pem)
    tls_files.install(pair_for(ca, "heartbeat.example.net"))
    trust = agent_trust(Settings(agent_endpoint=f"{HOST}:8900", agent_endpoint_ca_certificate_path=ca_file))
    with pytest.raises(SettingsError) as caught:
        ServingCertificate(tls_files.certificate, tls_files.key, trust=trust)
    assert caught.value.setting == "heartbeat_tls_certificate_path"
    assert "is for heartbeat.example.net, not for 127.0.0.1" in str(caught.value)
    # Unset, they are not checked: the endpoint's name or the agents' CA may be known to the worker alone.
    ServingCertificate(tls_files.certificate, tls_files.key, trust=agent_trust(Settings()))


@pytest.mark.parametrize(
    ("names", "host", "accepted"),
    [
        ("heartbeat.example.net", "HEARTBEAT.example.net.", True),
        ("*.example.net", "heartbeat.example.net", True),
        ("*.example.net", "a.heartbeat.example.net", False),
        ("*.net", "example.net", False),
        ("10.0.0.5", "10.0.0.5", True),
        ("10.0.0.5", "10.0.0.6", False),
        ("2001:db8::1", "2001:db8:0::1", True),
        ("heartbeat.example.net", "10.0.0.5", False),
    ],
)
def test_names_are_matched_as_a_tls_client_matches_them(names, host, accepted):
    certificate = x509.load_pem_x509_certificate(pair_for(authority("fleet CA"), names)[0])
    assert names_host(certificate, host) is accepted
