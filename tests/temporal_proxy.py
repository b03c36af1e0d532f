"""nginx (Debian's nginx-light) in front of a Temporal server as a gRPC proxy that demands client certificates.

The certificates are made here, by foundation.tls's CertificateAuthority: a CA for the proxy's server certificate
and the clients, one client certificate it accepts, one expired, one from another CA, and that other CA.
"""

from __future__ import annotations

import datetime
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from foundation.tls import CertificateAuthority, subject_alternative_name

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
SERVER_NAME = "temporal.test"


@dataclass(frozen=True)
class Issued:
    certificate: Path
    key: Path


@dataclass(frozen=True)
class ProxyCertificates:
    ca: Path
    other_ca: Path
    server: Issued
    client: Issued
    expired_client: Issued
    stranger_client: Issued


def _issue(
    authority: CertificateAuthority, directory: Path, name: str, *, server: bool = False, expired: bool = False
) -> Issued:
    now = datetime.datetime.now(datetime.UTC)
    if expired:
        valid_from, valid_until = now - datetime.timedelta(days=10), now - datetime.timedelta(days=1)
    else:
        valid_from, valid_until = now - datetime.timedelta(days=1), now + datetime.timedelta(days=30)
    certificate, key = authority.issue(
        name, valid_from, valid_until, subject_alternative_name(name) if server else None
    )
    issued = Issued(directory / f"{name}.pem", directory / f"{name}.key")
    issued.certificate.write_bytes(certificate)
    issued.key.write_bytes(key)
    return issued


def make_certificates(directory: Path) -> ProxyCertificates:
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    valid_from, valid_until = now - datetime.timedelta(days=1), now + datetime.timedelta(days=30)
    authority = CertificateAuthority("fleet CA", valid_from, valid_until)
    other = CertificateAuthority("someone else's CA", valid_from, valid_until)
    (directory / "ca.pem").write_bytes(authority.certificate_pem)
    (directory / "other-ca.pem").write_bytes(other.certificate_pem)
    return ProxyCertificates(
        ca=directory / "ca.pem",
        other_ca=directory / "other-ca.pem",
        server=_issue(authority, directory, SERVER_NAME, server=True),
        client=_issue(authority, directory, "worker"),
        expired_client=_issue(authority, directory, "expired-worker", expired=True),
        stranger_client=_issue(other, directory, "stranger"),
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class TemporalProxy:
    """nginx on 127.0.0.1:port, TLS with client certificates required, passing gRPC to the Temporal server."""

    def __init__(self, directory: Path, upstream: str, certificates: ProxyCertificates) -> None:
        self.directory = directory
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        config = directory / "nginx.conf"
        config.write_text(
            f"""
pid {directory}/nginx.pid;
error_log {directory}/error.log warn;
worker_processes 1;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {directory}/body;
    server {{
        listen 127.0.0.1:{self.port} ssl http2;
        ssl_certificate {certificates.server.certificate};
        ssl_certificate_key {certificates.server.key};
        ssl_client_certificate {certificates.ca};
        ssl_verify_client on;
        location / {{
            grpc_pass grpc://{upstream};
        }}
    }}
}}
"""
        )
        self.process = subprocess.Popen(
            [NGINX, "-e", str(directory / "error.log"), "-p", str(directory), "-c", str(config), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for _ in range(100):
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"nginx exited: {self.process.stderr.read().decode() if self.process.stderr else ''}"
                )
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("nginx did not listen within 5 s")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)
