"""A fault injector in front of an HTTP service, for tests that need the service to fail on cue.

It passes every request on and every reply back, until a test tells it otherwise: ``refusing`` answers 503 in the
service's place and passes nothing on (a load balancer whose backends are away); ``losing_replies_to`` passes
requests of those methods on and answers 503 in place of the service's reply (a gateway that gave up while the
service did the work: the reply is lost, the work is done). When the service does not answer at all, the proxy
closes the connection without an answer, as a port forward to a stopped service does.

It is no part of what it stands in front of: the faults are made here, on purpose, and counted.
"""

from __future__ import annotations

import contextlib
import http.client
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# Headers about one connection, not the message: never passed on.
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "content-length"}
)
# What a load balancer answers with no backend to send a request to: a page, not the service's own error format.
BUSY_PAGE = b"<html><body><h1>503 Service Unavailable</h1>no backend of this service is up</body></html>\n"


@dataclass
class FaultInjectingProxy:
    """The proxy's switches and what it did with them; set the switches from the test, at any time."""

    host: str  # the service's
    port: int
    url: str = ""  # the proxy's own, for the client under test
    refusing: bool = False
    losing_replies_to: frozenset[str] = frozenset()  # HTTP methods, "PATCH", "PUT"
    refused: list[str] = field(default_factory=list)  # "METHOD path" of each request answered in the service's place
    lost: list[str] = field(default_factory=list)  # ... of each request passed on whose reply was lost


class _Handler(BaseHTTPRequestHandler):
    proxy: FaultInjectingProxy  # set on the subclass each proxy makes

    def _pass_on(self) -> None:
        proxy = self.proxy
        request = f"{self.command} {self.path}"
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if proxy.refusing:
            proxy.refused.append(request)
            self._busy()
            return
        upstream = http.client.HTTPConnection(proxy.host, proxy.port, timeout=60)
        headers = {name: value for name, value in self.headers.items() if name.lower() not in HOP_BY_HOP}
        try:
            upstream.request(self.command, self.path, body or None, headers)
            reply = upstream.getresponse()
            data = reply.read()
        except OSError:
            # Nothing answers behind the proxy: neither does it.
            self.close_connection = True
            return
        finally:
            upstream.close()
        if self.command in proxy.losing_replies_to:
            proxy.lost.append(request)
            self._busy()
            return
        self.send_response(reply.status, reply.reason)
        for name, value in reply.getheaders():
            if name.lower() not in HOP_BY_HOP:
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PUT = do_PATCH = do_POST = do_DELETE = _pass_on

    def _busy(self) -> None:
        self.send_response(503)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(BUSY_PAGE)))
        self.end_headers()
        self.wfile.write(BUSY_PAGE)

    def log_message(self, format: str, *args: object) -> None:
        pass  # the service's own log tells what reached it; the proxy's lists tell what did not


@contextlib.contextmanager
def fault_injecting_proxy(service_url: str) -> Iterator[FaultInjectingProxy]:
    """A proxy on a free loopback port in front of the service at service_url (http://host:port), passing
    everything on until told otherwise; stopped on leaving."""
    target = urllib.parse.urlsplit(service_url)
    assert target.hostname is not None and target.port is not None, service_url
    proxy = FaultInjectingProxy(target.hostname, target.port)
    handler = type("Handler", (_Handler,), {"proxy": proxy})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    proxy.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="fault-injecting-proxy", daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
