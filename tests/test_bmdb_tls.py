"""BMDB over TLS: a real PostgreSQL that speaks only TLS on 127.0.0.1, reached with sslmode=verify-full.

The server's certificate and the client certificates come from a CA the test makes (foundation.tls). The
server refuses plain text, asks for a password from the user `shepherd` and for a client certificate from
`shepherd_mtls`; every BMDB path (migrate, the store, the heartbeat writes, open_bmdb) must work with either,
and each way the TLS set-up can be wrong must end a command with one line naming database_url and the cause.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import text

from bmdb import migrate
from bmdb.connection_errors import connection_failure
from bmdb.heartbeat_batcher import HeartbeatBatcher
from bmdb.migrate import open_bmdb
from bmdb.store import BMDB, Heartbeat, HeartbeatsNotRecorded
from foundation.startup import StartupError
from foundation.tls import CertificateAuthority, subject_alternative_name
from tests.certificates import Issued, write_issued

HOST = "127.0.0.1"
# The URL carries it in every test, and no message may show it.
PASSWORD = "not-for-the-logs-7f3a"
# PostgreSQL refuses to run as root: as root, the server runs as the user the pgserver wheel runs it as.
SERVER_USER = "pgserver"


@dataclass(frozen=True)
class TLSPostgres:
    port: int
    ca: Path
    other_ca: Path
    client: Issued
    # Issued by another CA, and by the right CA for another user.
    stranger: Issued
    other_user: Issued

    def url(self, user: str = "shepherd", database: str = "bmdb", host: str = HOST, **parameters: str) -> str:
        """A postgresql:// URL with the query parameters given; always with a password, which must never show."""
        query = urllib.parse.urlencode(parameters, safe="/")
        return f"postgresql://{user}:{PASSWORD}@{host}:{self.port}/{database}" + (f"?{query}" if query else "")

    def verify_full(self, user: str = "shepherd", database: str = "bmdb", **parameters: str) -> str:
        """The URL production uses: the server's certificate checked against the CA, and its name against host."""
        return self.url(user, database, sslmode="verify-full", sslrootcert=str(self.ca), **parameters)

    def mutual(self, database: str = "bmdb_mtls", client: Issued | None = None, **parameters: str) -> str:
        """verify-full, with the client certificate the server demands of `shepherd_mtls`."""
        client = client or self.client
        return self.verify_full(
            "shepherd_mtls", database, sslcert=str(client.certificate), sslkey=str(client.key), **parameters
        )

    def create_database(self, owner: str) -> str:
        """A new, empty database owned by owner: each test migrates and writes its own."""
        name = f"bmdb_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.verify_full("postgres", "postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name} OWNER {owner}")
        return name


def _postgres_bin() -> Path:
    """The directory of a PostgreSQL built with OpenSSL: the system's (the pgserver wheel's is built without)."""
    candidates = [Path(found).resolve().parent for found in [shutil.which("postgres")] if found]
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    for binaries in candidates:
        pg_config = binaries / "pg_config"
        if (binaries / "initdb").exists() and pg_config.exists():
            configure = subprocess.run([pg_config, "--configure"], capture_output=True, text=True).stdout
            if "--with-openssl" in configure or "--with-ssl=openssl" in configure:
                return binaries
    pytest.fail("no PostgreSQL server built with OpenSSL (Debian: apt-get install postgresql)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _write(path: Path, content: bytes, mode: int) -> Path:
    path.write_bytes(content)
    path.chmod(mode)
    return path


def _run(command: list[str | Path], user: str | None) -> None:
    done = subprocess.run(command, capture_output=True, text=True, user=user)
    if done.returncode != 0:
        raise RuntimeError(f"{command[0]} failed: {done.stderr or done.stdout}")


def _start_server(directory: Path, authority: CertificateAuthority, user: str | None) -> tuple[int, Callable[[], None]]:
    """initdb and start a PostgreSQL that speaks only TLS on HOST; its port, and how to stop it."""
    binaries = _postgres_bin()
    data = directory / "data"
    files = data / "tls"
    if user is not None:
        from pgserver.utils import ensure_user_exists

        ensure_user_exists(user)
        os.chown(directory, pwd.getpwnam(user).pw_uid, pwd.getpwnam(user).pw_gid)
    _run([binaries / "initdb", "-D", data, "-U", "postgres", "--auth=trust", "--encoding=utf8"], user)
    now = datetime.datetime.now(datetime.UTC)
    certificate, key = authority.issue(
        HOST, now - datetime.timedelta(days=1), now + datetime.timedelta(days=30), subject_alternative_name(HOST)
    )
    files.mkdir()
    _write(files / "server.pem", certificate, 0o644)
    # PostgreSQL refuses a key that others can read.
    _write(files / "server.key", key, 0o600)
    _write(files / "ca.pem", authority.certificate_pem, 0o644)
    if user is not None:
        # The server's key must belong to the user the server runs as.
        for path in [files, *files.iterdir()]:
            os.chown(path, pwd.getpwnam(user).pw_uid, pwd.getpwnam(user).pw_gid)
    port = _free_port()
    with (data / "postgresql.conf").open("a") as conf:
        conf.write(
            f"""
listen_addresses = '{HOST}'
port = {port}
unix_socket_directories = ''
ssl = on
ssl_cert_file = '{files / "server.pem"}'
ssl_key_file = '{files / "server.key"}'
ssl_ca_file = '{files / "ca.pem"}'
password_encryption = 'scram-sha-256'
"""
        )
    # First match wins: no plain text for anyone; a certificate for shepherd_mtls, a password for shepherd.
    (data / "pg_hba.conf").write_text(
        f"""
hostnossl all all 0.0.0.0/0 reject
hostssl all shepherd_mtls {HOST}/32 cert
hostssl all shepherd {HOST}/32 scram-sha-256
hostssl all postgres {HOST}/32 trust
"""
    )
    _run([binaries / "pg_ctl", "-D", data, "-l", data / "server.log", "-w", "-t", "60", "start"], user)
    return port, lambda: _run([binaries / "pg_ctl", "-D", data, "-m", "fast", "-w", "stop"], user)


@pytest.fixture(scope="module")
def tls_postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSPostgres]:
    directory = tmp_path_factory.mktemp("bmdb-tls")
    now = datetime.datetime.now(datetime.UTC)
    valid_from, valid_until = now - datetime.timedelta(days=1), now + datetime.timedelta(days=30)
    authority = CertificateAuthority("BMDB test CA", valid_from, valid_until)
    other = CertificateAuthority("someone else's CA", valid_from, valid_until)
    ca = _write(directory / "ca.pem", authority.certificate_pem, 0o644)
    other_ca = _write(directory / "other-ca.pem", other.certificate_pem, 0o644)
    # A client certificate's common name is the database user it logs in as (pg_hba `cert`).
    client = write_issued(directory, "client", authority.issue("shepherd_mtls", valid_from, valid_until))
    stranger = write_issued(directory, "stranger", other.issue("shepherd_mtls", valid_from, valid_until))
    other_user = write_issued(directory, "other-user", authority.issue("someone_else", valid_from, valid_until))
    # Not under pytest's temporary directory: a pytest run that starts meanwhile makes its root private again, and
    # the server, running as another user, could no longer reach its files.
    server_directory = Path(tempfile.mkdtemp(prefix="shepherd-bmdb-tls-"))
    stop: Callable[[], None] | None = None
    try:
        port, stop = _start_server(server_directory, authority, SERVER_USER if os.geteuid() == 0 else None)
        server = TLSPostgres(port, ca, other_ca, client, stranger, other_user)
        with psycopg.connect(server.verify_full("postgres", "postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE ROLE shepherd LOGIN PASSWORD '{PASSWORD}'")
            conn.execute("CREATE ROLE shepherd_mtls LOGIN")
            # BMDB's roles, made once for the cluster by a superuser (docs/operations.md#bmdb-roles): the owners
            # migrating here may not create roles.
            for role in ("shepherd_heartbeat", "shepherd_worker", "shepherd_reader"):
                conn.execute(f"CREATE ROLE {role} NOLOGIN")
            conn.execute("CREATE DATABASE bmdb OWNER shepherd")
            conn.execute("CREATE DATABASE bmdb_mtls OWNER shepherd_mtls")
        yield server
    finally:
        if stop is not None:
            stop()
        shutil.rmtree(server_directory, ignore_errors=True)


def url_for(server: TLSPostgres, user: str, database: str) -> str:
    """The two ways in, both over verify-full: shepherd with a password, shepherd_mtls with a client certificate."""
    return server.mutual(database) if user == "shepherd_mtls" else server.verify_full(database=database)


@pytest.mark.parametrize("user", ["shepherd", "shepherd_mtls"])
async def test_shepherd_migrate_over_verify_full(user, tls_postgres, shepherd_cli):
    url = url_for(tls_postgres, user, tls_postgres.create_database(user))
    code, out, err = await shepherd_cli({"SHEPHERD_DATABASE_URL": url}, "migrate")
    assert code == 0, err
    assert f"schema revision {migrate.head_revision()}" in out
    assert PASSWORD not in out + err
    assert migrate.current_revision(url) == migrate.head_revision()


@pytest.mark.parametrize("user", ["shepherd", "shepherd_mtls"])
async def test_the_store_and_the_heartbeat_writes_go_over_tls(user, tls_postgres):
    url = url_for(tls_postgres, user, tls_postgres.create_database(user))
    await asyncio.to_thread(migrate.upgrade, url)
    # What the worker and the heartbeat server open: reachable, and at the schema revision they need.
    bmdb = await open_bmdb(url)
    batcher = HeartbeatBatcher(bmdb)
    try:
        machine_id, created = await bmdb.admit_machine("sim", "node-0001")
        assert created
        await bmdb.record_provided(machine_id, address="10.0.0.1", ssh_port=22, location=None)
        started = datetime.datetime.now(datetime.UTC)
        await bmdb.record_agent_started(machine_id, started, b"k" * 32)
        # The heartbeat server's path: the batcher, on the store's own connection outside the pool.
        assert await batcher.record(Heartbeat(machine_id, b"k" * 32, started + datetime.timedelta(seconds=1)))
        record = await bmdb.get_machine(machine_id)
        assert record is not None and record.address == "10.0.0.1" and record.agent_heartbeat_at is not None

        async with bmdb.engine.connect() as conn:
            encrypted = (
                await conn.execute(
                    text(
                        "SELECT count(*), bool_and(s.ssl), min(s.version), min(s.client_dn) FROM pg_stat_ssl s "
                        "JOIN pg_stat_activity a USING (pid) WHERE a.datname = current_database()"
                    )
                )
            ).one()
    finally:
        await batcher.close()
        await bmdb.close()
    # This query's connection and the heartbeat connection at least, every one of them TLS.
    backends, all_tls, version, client_dn = encrypted
    assert backends >= 2 and all_tls and version.startswith("TLSv1.")
    assert client_dn == ("/CN=shepherd_mtls" if user == "shepherd_mtls" else None)


async def test_plain_text_is_refused_by_the_server(tls_postgres, shepherd_cli):
    url = tls_postgres.url(database="bmdb", sslmode="disable")
    code, out, err = await shepherd_cli({"SHEPHERD_DATABASE_URL": url}, "migrate")
    assert_one_line(code, out, err, "the server accepts only TLS connections: add sslmode=verify-full")


def assert_one_line(code: int, out: str, err: str, cause: str) -> None:
    assert (code, out) == (1, ""), err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("shepherd migrate: ") and err.rstrip().endswith("(setting database_url)"), err
    assert cause in err, err
    assert PASSWORD not in err and "Traceback" not in err


@pytest.fixture
def files(tls_postgres, tmp_path) -> dict[str, str]:
    """Files a failure case names, by a short name."""
    not_pem = tmp_path / "not-a-certificate.pem"
    not_pem.write_text("this is not a certificate\n")
    loose_key = tmp_path / "loose.key"
    loose_key.write_bytes(tls_postgres.client.key.read_bytes())
    loose_key.chmod(0o644)
    return {
        "other_ca": str(tls_postgres.other_ca),
        "not_pem": str(not_pem),
        "loose_key": str(loose_key),
        "home": str(tmp_path),
    }


@pytest.mark.parametrize(
    ("case", "cause"),
    [
        pytest.param(
            "other_ca",
            "the server's certificate does not verify against the CA in {other_ca} (sslrootcert): it is issued by "
            "another CA, or it has expired; give the CA that issued BMDB's certificate",
            id="server-certificate-from-another-ca",
        ),
        pytest.param(
            "other_host",
            "the server's certificate is for 127.0.0.1 (and 1 other name), not localhost (sslmode=verify-full checks "
            "the URL's host): connect by a name the certificate carries",
            id="server-certificate-for-another-host",
        ),
        pytest.param(
            "missing_root",
            "the CA certificate file /nonexistent/bmdb-ca.pem (sslrootcert) does not exist",
            id="sslrootcert-missing",
        ),
        pytest.param(
            "not_pem_root",
            "cannot read the CA certificate file {not_pem} (sslrootcert): it holds no PEM certificate or key",
            id="sslrootcert-not-a-certificate",
        ),
        pytest.param(
            "no_root",
            "sslmode=verify-full checks the server's certificate, but the URL names no CA: add sslrootcert=PATH",
            id="sslrootcert-not-given",
        ),
        pytest.param(
            "no_client_certificate",
            "the server demands a client certificate: add sslcert=PATH and sslkey=PATH to the URL",
            id="client-certificate-not-given",
        ),
        pytest.param(
            "missing_client_certificate",
            "the client certificate file /nonexistent/client.pem (sslcert) does not exist; the server demands one",
            id="client-certificate-missing",
        ),
        pytest.param(
            "stranger",
            "the server refused the client certificate {stranger} (sslcert): it is not issued by a CA the server "
            "trusts",
            id="client-certificate-from-another-ca",
        ),
        pytest.param(
            "other_user",
            "the client certificate {other_user} (sslcert) is not for the user shepherd_mtls: its common name must "
            "be the URL's user",
            id="client-certificate-for-another-user",
        ),
        pytest.param(
            "loose_key",
            "the client key {loose_key} (sslkey) is readable by others, and libpq refuses such a key: "
            "chmod 600 {loose_key}",
            id="client-key-readable-by-others",
        ),
        pytest.param(
            "missing_key",
            "the client key file /nonexistent/client.key (sslkey) does not exist",
            id="client-key-missing",
        ),
    ],
)
async def test_each_tls_mistake_is_one_line_naming_database_url_and_the_cause(
    case, cause, tls_postgres, files, shepherd_cli
):
    server = tls_postgres
    client = server.client
    urls = {
        "other_ca": server.url(sslmode="verify-full", sslrootcert=files["other_ca"]),
        # Reached at the certificate's address, but by a name the certificate does not carry.
        "other_host": server.verify_full(hostaddr=HOST).replace(f"@{HOST}:", "@localhost:"),
        "missing_root": server.url(sslmode="verify-full", sslrootcert="/nonexistent/bmdb-ca.pem"),
        "not_pem_root": server.url(sslmode="verify-full", sslrootcert=files["not_pem"]),
        "no_root": server.url(sslmode="verify-full"),
        "no_client_certificate": server.verify_full("shepherd_mtls", "bmdb_mtls"),
        "missing_client_certificate": server.mutual(client=Issued(Path("/nonexistent/client.pem"), client.key)),
        "stranger": server.mutual(client=server.stranger),
        "other_user": server.mutual(client=server.other_user),
        "loose_key": server.mutual(client=Issued(client.certificate, Path(files["loose_key"]))),
        "missing_key": server.mutual(client=Issued(client.certificate, Path("/nonexistent/client.key"))),
    }
    # libpq looks for a CA and a client certificate under $HOME/.postgresql when the URL names none.
    env = {"SHEPHERD_DATABASE_URL": urls[case], "HOME": files["home"]}
    code, out, err = await shepherd_cli(env, "migrate")
    expected = cause.format(**files, stranger=server.stranger.certificate, other_user=server.other_user.certificate)
    assert_one_line(code, out, err, expected)


async def test_the_worker_and_the_heartbeat_writes_fail_on_one_line_too(tls_postgres):
    url = tls_postgres.url(database="bmdb", sslmode="verify-full", sslrootcert=str(tls_postgres.other_ca))
    cause = f"the server's certificate does not verify against the CA in {tls_postgres.other_ca} (sslrootcert)"
    # What `shepherd worker` and `shepherd heartbeat-server` open first.
    with pytest.raises(StartupError) as refused:
        await open_bmdb(url)
    message = str(refused.value)
    assert cause in message and message.endswith("(setting database_url)") and "\n" not in message
    assert PASSWORD not in message
    # A heartbeat server whose BMDB starts refusing: each heartbeat fails with the cause, on one line, for the log.
    bmdb = BMDB(url)
    try:
        with pytest.raises(HeartbeatsNotRecorded) as failed:
            await HeartbeatBatcher(bmdb).record(Heartbeat(uuid.uuid4(), b"k" * 32, datetime.datetime.now(datetime.UTC)))
    finally:
        await bmdb.close()
    message = str(failed.value)
    assert message.startswith("BMDB failed while recording heartbeats: cannot connect to BMDB at ")
    assert cause in message and "\n" not in message and PASSWORD not in message


def test_a_file_without_pem_is_told_whatever_reason_openssl_left_behind(tmp_path: Path):
    """libpq quotes the newest error in OpenSSL's queue for its thread, which may be another connection's."""
    not_pem = tmp_path / "not-a-certificate.pem"
    not_pem.write_text("hello\n")
    pem = tmp_path / "ca.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    url = f"postgresql://shepherd:secret@127.0.0.1:5432/bmdb?sslmode=verify-full&sslrootcert={not_pem}"
    for path, expected in ((not_pem, "it holds no PEM certificate or key"), (pem, "shutdown while in init")):
        libpq = f'connection failed: could not read root certificate file "{path}": shutdown while in init'
        line = connection_failure(url, Exception(libpq))
        assert line.endswith(f"cannot read the CA certificate file {path} (sslrootcert): {expected}"), line
        assert "secret" not in line
