"""nginx (Debian's nginx-light) in front of a Temporal server as a gRPC proxy that demands client certificates.

The certificates are made here: a CA for the proxy's server certificate and the clients, one client certificate
it accepts, one expired, one from another CA, and that other CA.
"""

from __future__ import annotations

import datetime
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

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


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


class _Authority:
    def __init__(self, name: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.certificate = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(self.key, hashes.SHA256())
        )

    def write(self, path: Path) -> Path:
        path.write_bytes(self.certificate.public_bytes(serialization.Encoding.PEM))
        return path

    def issue(self, directory: Path, name: str, *, server: bool = False, expired: bool = False) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        start, end = (
            (now - datetime.timedelta(days=10), now - datetime.timedelta(days=1))
            if expired
            else (
                now - datetime.timedelta(days=1),
                now + datetime.timedelta(days=30),
            )
        )
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(self.certificate.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
        )
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        certificate = builder.sign(self.key, hashes.SHA256())
        issued = Issued(directory / f"{name}.pem", directory / f"{name}.key")
        issued.certificate.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        issued.key.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        return issued


def make_certificates(directory: Path) -> ProxyCertificates:
    directory.mkdir(parents=True, exist_ok=True)
    authority, other = _Authority("fleet CA"), _Authority("someone else's CA")
    return ProxyCertificates(
        ca=authority.write(directory / "ca.pem"),
        other_ca=other.write(directory / "other-ca.pem"),
        server=authority.issue(directory, SERVER_NAME, server=True),
        client=authority.issue(directory, "worker"),
        expired_client=authority.issue(directory, "expired-worker", expired=True),
        stranger_client=other.issue(directory, "stranger"),
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
