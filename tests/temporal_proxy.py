"""nginx (Debian's nginx-light) in front of a Temporal server as a gRPC proxy that demands client certificates,
and, on ports of their own, an API key.

The certificates are made here, by foundation.tls's CertificateAuthority: a CA for the proxy's server certificate
and the clients, one client certificate it accepts, one expired, one from another CA, and that other CA.
"""

from __future__ import annotations

import datetime
import secrets
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from foundation.tls import CertificateAuthority, subject_alternative_name
from tests.certificates import Issued, write_issued
from tests.ports import free_ports

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
SERVER_NAME = "temporal.test"


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
    issued = authority.issue(name, valid_from, valid_until, subject_alternative_name(name) if server else None)
    return write_issued(directory, name, issued)


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


class TemporalProxy:
    """nginx passing gRPC to the Temporal server, on three TLS ports of 127.0.0.1.

    `address` demands a client certificate. `api_key_address` and `api_key_http_address` demand none but the
    header `authorization: Bearer <api_key>`, which the Temporal SDK sends for an API key; the first refuses
    anything else as a gRPC server does (status UNAUTHENTICATED), the second as a plain HTTP server does (401 and
    an HTML page, as an authenticating proxy in front of Temporal may answer).
    """

    def __init__(self, directory: Path, upstream: str, certificates: ProxyCertificates) -> None:
        self.directory = directory
        self.api_key = secrets.token_urlsafe(24)
        self.port, api_key_port, api_key_http_port = free_ports(3)
        self.address = f"127.0.0.1:{self.port}"
        self.api_key_address = f"127.0.0.1:{api_key_port}"
        self.api_key_http_address = f"127.0.0.1:{api_key_http_port}"
        server_tls = f"""
        ssl_certificate {certificates.server.certificate};
        ssl_certificate_key {certificates.server.key};"""
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
    # Empty, which lets a request through the `if`s below, only for the right key.
    map $http_authorization $api_key_refused {{
        default 1;
        "Bearer {self.api_key}" "";
    }}
    server {{
        listen {self.address} ssl http2;{server_tls}
        ssl_client_certificate {certificates.ca};
        ssl_verify_client on;
        location / {{
            grpc_pass grpc://{upstream};
        }}
    }}
    server {{
        listen {self.api_key_address} ssl http2;{server_tls}
        # `return` cannot set the content type inside `if`, so the refusal is answered from a named location.
        error_page 418 = @unauthenticated;
        location / {{
            if ($api_key_refused) {{
                return 418;
            }}
            grpc_pass grpc://{upstream};
        }}
        # A gRPC server's refusal is a response without a body: HTTP 200, the status in its headers.
        location @unauthenticated {{
            default_type application/grpc;
            add_header grpc-status 16 always;
            add_header grpc-message "invalid API key" always;
            return 200 "";
        }}
    }}
    server {{
        listen {self.api_key_http_address} ssl http2;{server_tls}
        location / {{
            if ($api_key_refused) {{
                return 401;
            }}
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
        for port in (self.port, api_key_port, api_key_http_port):
            self._wait_for(port)

    def _wait_for(self, port: int) -> None:
        for _ in range(100):
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"nginx exited: {self.process.stderr.read().decode() if self.process.stderr else ''}"
                )
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"nginx did not listen on port {port} within 5 s")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)
