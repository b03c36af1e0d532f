"""A BMDB URL that reaches another host without sslmode=verify-full leaves agent keys and heartbeats open to whoever
is on the path: each process that opens BMDB says so at start, and `shepherd doctor` shows every URL's TLS and
warns of such a one."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from foundation.bmdb_tls import bmdb_transport
from foundation.settings import Settings
from processes.heartbeat_server import run_heartbeat_server
from processes.operator_api import run_operator_api
from processes.worker import run_worker
from shepherd.commands.doctor import Doctor
from shepherd.commands.doctor_checks.verdicts import Status

# 0.0.0.0 is no loopback address, so the rule reads it as another host's; a connection to it ends at once on this
# host (nothing listens on port 1), so each process stops right after its start.
ELSEWHERE = "postgresql://shepherd:pw@0.0.0.0:1/bmdb"
WARNING = "does not check the server's certificate and name"


@pytest.mark.parametrize(
    ("url", "environ", "host", "sslmode", "warned"),
    [
        ("postgresql://s@db.example.net/bmdb", {}, "db.example.net", "prefer", True),
        ("postgresql://s@db.example.net/bmdb?sslmode=require", {}, "db.example.net", "require", True),
        ("postgresql://s@db.example.net/bmdb?sslmode=verify-ca", {}, "db.example.net", "verify-ca", True),
        ("postgresql://s@db.example.net/bmdb?sslmode=verify-full", {}, "db.example.net", "verify-full", False),
        ("postgresql://s@db.example.net/bmdb", {"PGSSLMODE": "verify-full"}, "db.example.net", "verify-full", False),
        (
            "postgresql://s@db.example.net/bmdb?sslmode=disable",
            {"PGSSLMODE": "verify-full"},
            "db.example.net",
            "disable",
            True,
        ),
        ("postgresql://s@127.0.0.1:5432/bmdb", {}, "127.0.0.1", "prefer", False),
        ("postgresql://s@[::1]:5432/bmdb", {}, "::1", "prefer", False),
        ("postgresql://s@localhost/bmdb", {}, "localhost", "prefer", False),
        ("postgresql:///bmdb?host=/run/postgresql", {}, "/run/postgresql", "prefer", False),
        ("postgresql://s@localhost/bmdb?host=db.example.net", {}, "db.example.net", "prefer", True),
    ],
)
def test_a_url_reads_as_libpq_reads_its_host_and_tls(url, environ, host, sslmode, warned):
    transport = bmdb_transport(url, environ)
    assert (transport.host, transport.sslmode) == (host, sslmode)
    assert (transport.warning("database_url") is not None) is warned


def warned(caplog: pytest.LogCaptureFixture, setting: str) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.levelno == logging.WARNING and WARNING in record.getMessage() and setting in record.getMessage()
    ]


async def test_each_process_warns_at_start_of_a_bmdb_url_open_on_the_way(caplog, tmp_path: Path):
    caplog.set_level(logging.WARNING)
    settings = Settings(
        database_url=ELSEWHERE,
        heartbeat_plaintext=True,
        heartbeat_listen="127.0.0.1:0",
        temporal_address="127.0.0.1:1",
        api_signing_key_path=tmp_path / "absent-key",
        api_policy_path=tmp_path / "absent-policy.toml",
    )
    starts = {
        "heartbeat server": run_heartbeat_server(settings, ELSEWHERE, stop=asyncio.Event()),
        "worker": run_worker(settings, ELSEWHERE, stop=asyncio.Event()),
        "operator API": run_operator_api(settings, stop=asyncio.Event()),
    }
    for process, start in starts.items():
        caplog.clear()
        # Each stops at what it reaches next (BMDB, Temporal, its key file), after the warning.
        with pytest.raises(Exception):  # noqa: B017 (whatever stops it; the warning before is what is tested)
            await asyncio.wait_for(start, 60)
        lines = warned(caplog, "database_url")
        assert len(lines) == 1, (process, [record.getMessage() for record in caplog.records])
        assert "0.0.0.0 with sslmode=prefer (libpq's default)" in lines[0] and ":pw@" not in lines[0]


@pytest.mark.parametrize(
    ("urls", "status", "shown"),
    [
        (
            {"SHEPHERD_DATABASE_URL": "postgresql://s@db.example.net/bmdb?sslmode=require"},
            Status.WARN,
            "database_url reaches BMDB at db.example.net with sslmode=require (the URL), which does not check",
        ),
        (
            {
                "SHEPHERD_DATABASE_URL": "postgresql://s@db.example.net/bmdb?sslmode=verify-full",
                "SHEPHERD_HEARTBEAT_DATABASE_URL": "postgresql://h@db.example.net/bmdb",
            },
            Status.WARN,
            "heartbeat_database_url reaches BMDB at db.example.net with sslmode=prefer (libpq's default)",
        ),
        (
            {
                "SHEPHERD_DATABASE_URL": "postgresql://s@db.example.net/bmdb?sslmode=verify-full",
                "SHEPHERD_HEARTBEAT_DATABASE_URL": "postgresql://h@127.0.0.1/bmdb",
            },
            Status.OK,
            "database_url: sslmode=verify-full (the URL); heartbeat_database_url: sslmode=prefer (libpq's default), "
            "on this host",
        ),
    ],
)
async def test_doctor_shows_the_tls_of_each_bmdb_url_and_warns_of_one_open_on_the_way(urls, status, shown):
    doctor = Doctor(Settings.from_env(urls), timeout=10.0, environ={})
    async with doctor.stack:
        await doctor.check("bmdb tls", doctor.bmdb_tls)
    check = doctor.checks["bmdb tls"]
    assert check.status is status, check
    assert shown in check.detail
