"""The agent's gRPC client (agent.grpc_channel) against grpcio's server, and against servers that misbehave.

The misbehaving servers speak HTTP/2 through h2 on a real TLS socket, so they can answer what grpcio never would:
a compressed or oversized message, an answer without a gRPC status, a reset, garbage, silence.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import h2.config
import h2.connection
import h2.errors
import h2.events
import pytest

from agent.grpc_channel import Channel
from agent.grpc_messages import MAX_MESSAGE_SIZE, RpcError
from foundation.tls import local_certificates

METHOD = "/test.Echo/Call"


def ca_der(tmp_path: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(local_certificates(tmp_path / "tls").ca_certificate.read_text())


def grpc_message(payload: bytes, *, compressed: bool = False, size: int | None = None) -> bytes:
    return bytes([int(compressed)]) + (len(payload) if size is None else size).to_bytes(4, "big") + payload


Answer = Callable[[h2.connection.H2Connection, int], None]


@contextmanager
def scripted_server(
    tmp_path: Path, *, answer: Answer | None = None, raw: Callable[[ssl.SSLSocket], None] | None = None
) -> Iterator[str]:
    """A TLS server on 127.0.0.1 whose every connection gets raw(connection), or HTTP/2 whose every call gets
    answer(h2 connection, stream id); yields its host:port."""
    certificates = local_certificates(tmp_path / "tls")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certificates.server_certificate, certificates.server_key)
    context.set_alpn_protocols(["h2"])
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(connection: ssl.SSLSocket) -> None:
        with connection:
            if raw is not None:
                raw(connection)
                return
            assert answer is not None
            http2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
            http2.initiate_connection()
            connection.sendall(http2.data_to_send())
            while not stop.is_set():
                data = connection.recv(65536)
                if not data:
                    return
                for event in http2.receive_data(data):
                    if isinstance(event, h2.events.RequestReceived):
                        answer(http2, event.stream_id)
                connection.sendall(http2.data_to_send())

    def accept() -> None:
        while not stop.is_set():
            try:
                client, _ = listener.accept()
                connection = context.wrap_socket(client, server_side=True)
            except OSError:
                continue
            threading.Thread(target=serve, args=(connection,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()


def answered(
    *, headers: list[tuple[str, str]], data: bytes = b"", trailers: list[tuple[str, str]] | None = None
) -> Answer:
    def answer(http2: h2.connection.H2Connection, stream_id: int) -> None:
        http2.send_headers(stream_id, [(":status", "200"), *headers], end_stream=not data and trailers is None)
        if data:
            http2.send_data(stream_id, data, end_stream=trailers is None)
        if trailers is not None:
            http2.send_headers(stream_id, trailers, end_stream=True)

    return answer


GRPC = [("content-type", "application/grpc")]


def call(endpoint: str, tmp_path: Path, timeout: float = 5.0) -> bytes:
    channel = Channel(endpoint, [ca_der(tmp_path)])
    try:
        return channel.unary(METHOD, b"ping", timeout)
    finally:
        channel.close()


def test_an_answer_with_its_status_in_the_trailers_is_returned(tmp_path):
    answer = answered(headers=GRPC, data=grpc_message(b"pong"), trailers=[("grpc-status", "0")])
    with scripted_server(tmp_path, answer=answer) as endpoint:
        assert call(endpoint, tmp_path) == b"pong"


def test_a_refusal_carries_its_status_its_decoded_message_and_its_trailing_metadata(tmp_path):
    trailers = [("grpc-status", "9"), ("grpc-message", "too%20far%20behind"), ("shepherd-server-time-ms", "42")]
    with scripted_server(tmp_path, answer=answered(headers=GRPC, trailers=trailers)) as endpoint:
        with pytest.raises(RpcError) as refused:
            call(endpoint, tmp_path)
    assert (refused.value.code, refused.value.details) == ("FAILED_PRECONDITION", "too far behind")
    assert refused.value.trailers["shepherd-server-time-ms"] == "42"


@pytest.mark.parametrize(
    ("answer", "code", "says"),
    [
        (answered(headers=GRPC, data=grpc_message(b"x", compressed=True), trailers=[("grpc-status", "0")]),
         "INTERNAL", "compressed message"),
        (answered(headers=GRPC, data=grpc_message(b"", size=MAX_MESSAGE_SIZE + 1), trailers=[("grpc-status", "0")]),
         "RESOURCE_EXHAUSTED", f"a message of {MAX_MESSAGE_SIZE + 1} bytes"),
        (answered(headers=[]), "UNKNOWN", "without a gRPC status (HTTP 200)"),
        (answered(headers=GRPC, trailers=[("grpc-status", "99")]), "UNKNOWN", "status 99"),
        (answered(headers=GRPC, trailers=[("grpc-status", "0")]), "INTERNAL", "succeeded without an answer"),
    ],
    ids=["compressed", "oversized", "no status", "unknown status", "no answer"],
)  # fmt: skip
def test_an_answer_the_agent_cannot_use_is_a_named_error(tmp_path, answer: Answer, code: str, says: str):
    with scripted_server(tmp_path, answer=answer) as endpoint:
        with pytest.raises(RpcError) as refused:
            call(endpoint, tmp_path)
    assert refused.value.code == code and says in refused.value.details


def test_an_http_error_from_a_proxy_is_told_by_its_http_status(tmp_path):
    def answer(http2: h2.connection.H2Connection, stream_id: int) -> None:
        http2.send_headers(stream_id, [(":status", "503"), ("content-type", "text/plain")], end_stream=True)

    with scripted_server(tmp_path, answer=answer) as endpoint:
        with pytest.raises(RpcError) as refused:
            call(endpoint, tmp_path)
    assert refused.value.code == "UNAVAILABLE" and "HTTP 503" in refused.value.details


def test_a_stream_reset_by_the_server_is_told_by_its_error_code(tmp_path):
    def answer(http2: h2.connection.H2Connection, stream_id: int) -> None:
        http2.reset_stream(stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)

    with scripted_server(tmp_path, answer=answer) as endpoint:
        with pytest.raises(RpcError) as refused:
            call(endpoint, tmp_path)
    assert (refused.value.code, refused.value.details) == (
        "UNAVAILABLE",
        "the server reset the stream (REFUSED_STREAM)",
    )


def silent(connection: ssl.SSLSocket) -> None:
    time.sleep(3)


def http1(connection: ssl.SSLSocket) -> None:
    connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    time.sleep(3)


def garbage(connection: ssl.SSLSocket) -> None:
    empty_settings = bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
    data_frame_on_the_connection = bytes([0, 0, 0, 0, 0, 0, 0, 0, 0])
    connection.sendall(empty_settings + data_frame_on_the_connection)
    time.sleep(3)


@pytest.mark.parametrize(
    ("raw", "code", "says"),
    [
        (http1, "UNAVAILABLE", "the server does not speak HTTP/2 (it began 'HTTP/1.1 400 Bad Request"),
        (garbage, "UNAVAILABLE", "HTTP/2 protocol error"),
        (lambda connection: None, "UNAVAILABLE", "closed the connection"),
        (silent, "DEADLINE_EXCEEDED", "no answer in time"),
    ],
    ids=["HTTP/1.1", "garbage", "closed at once", "silent"],
)  # fmt: skip
def test_a_server_that_does_not_speak_http2_fails_the_call_by_name(tmp_path, raw, code: str, says: str):
    with scripted_server(tmp_path, raw=raw) as endpoint:
        channel = Channel(endpoint, [ca_der(tmp_path)])
        with pytest.raises(RpcError) as failed:
            channel.unary(METHOD, b"ping", 0.5)
    assert failed.value.code == code and says in failed.value.details
    assert not channel.connected, "the next call connects again"


def test_a_server_certificate_from_another_ca_is_refused(tmp_path):
    answer = answered(headers=GRPC, data=grpc_message(b"pong"), trailers=[("grpc-status", "0")])
    with scripted_server(tmp_path, answer=answer) as endpoint:
        other = ssl.PEM_cert_to_DER_cert(local_certificates(tmp_path / "other").ca_certificate.read_text())
        with pytest.raises(RpcError) as refused:
            Channel(endpoint, [other]).unary(METHOD, b"ping", 5.0)
    assert refused.value.code == "UNAVAILABLE" and "certificate" in refused.value.details


def test_nothing_listening_is_unavailable_and_names_the_endpoint():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        endpoint = f"127.0.0.1:{taken.getsockname()[1]}"
    with pytest.raises(RpcError) as refused:
        Channel(endpoint).unary(METHOD, b"ping", 5.0)
    assert refused.value.code == "UNAVAILABLE" and refused.value.details.startswith(f"cannot connect to {endpoint}")


@pytest.mark.parametrize("endpoint", ["no-port", "host:", "host:0", "host:70000", ":443", "bücher.example:443"])
def test_an_endpoint_that_is_no_ascii_host_and_port_is_refused_before_any_connection(endpoint: str):
    with pytest.raises(ValueError, match="heartbeat endpoint"):
        Channel(endpoint)


def test_an_ipv6_endpoint_in_brackets_is_parsed():
    channel = Channel("[::1]:8443")
    assert (channel.host, channel.port) == ("::1", 8443)


def test_waiting_answers_the_servers_pings_and_sleeping_does_not(tmp_path):
    """The server's keepalive pings: answered while the agent waits between heartbeats, so the server keeps the
    connection (grpcio's server drops one whose pings go unanswered for its keepalive timeout)."""
    acknowledged: list[float] = []

    def pinging_server(connection: ssl.SSLSocket) -> None:
        # Answers every message on a stream, then pings a moment later.
        http2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
        http2.initiate_connection()
        connection.sendall(http2.data_to_send())
        connection.settimeout(0.02)
        ping_at = None
        while True:
            if ping_at is not None and time.monotonic() >= ping_at:
                http2.ping(b"keepaliv")
                ping_at = None
                connection.sendall(http2.data_to_send())
            try:
                data = connection.recv(65536)
            except TimeoutError:
                continue
            if not data:
                return
            for event in http2.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    http2.send_headers(event.stream_id, [(":status", "200"), *GRPC])
                elif isinstance(event, h2.events.DataReceived):
                    http2.send_data(event.stream_id, grpc_message(b"pong"))
                    ping_at = time.monotonic() + 0.2
                elif isinstance(event, h2.events.PingAckReceived):
                    acknowledged.append(time.monotonic())
            connection.sendall(http2.data_to_send())

    with scripted_server(tmp_path, raw=pinging_server) as endpoint:
        channel = Channel(endpoint, [ca_der(tmp_path)])
        stream = channel.open_stream(METHOD)
        for wait, acknowledgements in ((channel.wait, 1), (time.sleep, 1), (channel.wait, 3)):
            stream.send(b"ping", time.monotonic() + 5)
            assert stream.receive(time.monotonic() + 5) == b"pong"
            wait(1.5)
            assert len(acknowledged) == acknowledgements
        channel.close()
