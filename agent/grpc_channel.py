"""A gRPC client for the agent: calls on one HTTP/2 connection over TLS, in the agent's own thread.

The agent sends one small message every half minute and waits for one answer. grpcio's client does that with
threads of its own (a channel poller, an event engine, timers) that wake several times a second whether or not a
call is open: about 1.5 ms of CPU a second on an idle machine, and 17 MiB of native code in the agent executable.
Here the agent blocks in one ``recv`` on its socket between heartbeats, which wakes only when the server writes
(an answer, or a keepalive ping that h2 answers), so an idle agent spends no CPU. h2 keeps the HTTP/2 state
(framing, header compression, flow control, pings); this module adds the request headers, and
agent.grpc_messages the rest gRPC puts on top: the five-byte message prefix and the status in the trailers.

Kept free of the rest of Shepherd: it runs inside the agent executable.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable, Sequence

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions

from agent.grpc_messages import (
    MAX_MESSAGE_SIZE,
    PREFIX_SIZE,
    RESET_STATUS,
    CallStream,
    RpcError,
    error_name,
    framed,
)

RECEIVE_SIZE = 65536


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """(host, port) of ``host:port`` or ``[v6 address]:port``; the host in ASCII (an international name in its
    xn-- form), so neither the resolver nor TLS needs the idna codec, which the agent executable leaves out."""
    host, sep, port = endpoint.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"the heartbeat endpoint must be host:port, got {endpoint!r}")
    if not host.isascii():
        raise ValueError(f"the heartbeat endpoint's host must be ASCII (an international name as xn--), got {host!r}")
    return host, int(port)


def tls_context(ca_certificates_der: Sequence[bytes]) -> ssl.SSLContext:
    """TLS that trusts every CA given (DER) as a root, or the machine's trust store when none is; offers HTTP/2."""
    if ca_certificates_der:
        context = ssl.create_default_context(cadata=b"".join(ca_certificates_der))
    else:
        context = ssl.create_default_context()
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2"])
    return context


class Channel:
    """Calls to one gRPC server, on one HTTP/2 connection opened at the first call and again after it broke.

    Not thread-safe: the agent's one thread makes every call and waits between them in wait().
    """

    def __init__(
        self,
        endpoint: str,
        ca_certificates_der: Sequence[bytes] = (),
        *,
        connect_timeout: float = 10.0,
        user_agent: str = "shepherd-agent",
    ) -> None:
        self.host, self.port = parse_endpoint(endpoint)
        self.authority = endpoint
        self.connect_timeout = connect_timeout
        self.user_agent = user_agent
        self._tls = tls_context(ca_certificates_der)
        self._socket: ssl.SSLSocket | None = None
        self._http2: h2.connection.H2Connection | None = None
        self._streams: dict[int, CallStream] = {}
        # Why the last connection ended, for whoever still waits on it.
        self._lost = RpcError("UNAVAILABLE", "not connected")
        # The connection's first bytes, until they show the server's HTTP/2 preface (a SETTINGS frame).
        self._preface: bytes | None = None

    @property
    def connected(self) -> bool:
        """Whether an HTTP/2 connection is open."""
        return self._http2 is not None

    def unary(self, method: str, request: bytes, timeout: float) -> bytes:
        """Send request to method and return its answer, within timeout seconds; RpcError else."""
        deadline = time.monotonic() + timeout
        call = self.open_stream(method, timeout=timeout)
        try:
            call.send(request, deadline, end=True)
            self._read_until(lambda: call.stream.ended, deadline, call.stream_id)
            if (error := call.stream.status()) is not None:
                raise error
            answer = call.stream.message()
            if answer is None:
                raise RpcError("INTERNAL", "the call succeeded without an answer")
            return answer
        finally:
            call.close()

    def open_stream(self, method: str, *, timeout: float | None = None) -> Call:
        """A call to a streaming method; it connects at its first send."""
        return Call(self, method, timeout)

    def wait(self, seconds: float) -> None:
        """Let seconds pass, answering what the server sends meanwhile (keepalive pings) on an open connection."""
        deadline = time.monotonic() + seconds
        if self._http2 is not None:
            try:
                self._read_until(lambda: False, deadline, None)
            except RpcError:
                pass  # the connection broke or timed out; the next call connects again
        remaining = deadline - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)

    def close(self) -> None:
        """Close the connection; calls still waiting on it fail with CANCELLED."""
        self._drop(RpcError("CANCELLED", "the channel was closed"))

    def _start(self, method: str, timeout: float | None, deadline: float) -> int:
        """Open a stream for a call to method on the connection, connecting first when there is none."""
        http2 = self._http2 or self._connect(deadline)
        stream_id = http2.get_next_available_stream_id()
        headers = [
            (":method", "POST"),
            (":scheme", "https"),
            (":path", method),
            (":authority", self.authority),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            ("user-agent", self.user_agent),
        ]
        if timeout is not None:
            headers.append(("grpc-timeout", f"{max(1, int(timeout * 1000))}m"))
        http2.send_headers(stream_id, headers)
        self._streams[stream_id] = CallStream()
        self._flush(deadline)
        return stream_id

    def _send(self, stream_id: int, message: bytes, deadline: float, *, end: bool) -> None:
        """Send one message on a stream, as far as the server's flow-control window lets it go at a time."""
        stream = self._streams.get(stream_id)
        if stream is None or stream.ended:
            raise (stream.status() if stream else None) or RpcError("UNAVAILABLE", "the stream has ended")
        data = framed(message)
        while data:
            http2 = self._connection()
            window = min(http2.local_flow_control_window(stream_id), http2.max_outbound_frame_size)
            if window <= 0:
                self._read_until(lambda: self._window(stream_id) > 0, deadline, stream_id)
                continue
            chunk, data = data[:window], data[window:]
            http2.send_data(stream_id, chunk, end_stream=end and not data)
            self._flush(deadline)

    def _window(self, stream_id: int) -> int:
        if self._http2 is None or stream_id not in self._streams or self._streams[stream_id].ended:
            return 1  # nothing more to wait for: the send finds out why
        return int(self._http2.local_flow_control_window(stream_id))

    def _receive(self, stream_id: int, deadline: float) -> bytes | None:
        """The next message on a stream, or None when the stream ended OK without another; RpcError else."""
        stream = self._streams[stream_id]
        self._read_until(lambda: stream.ended or stream.has_message(), deadline, stream_id)
        message = stream.message()
        if message is not None:
            return message
        if (error := stream.status()) is not None:
            raise error
        return None

    def _cancel(self, stream_id: int) -> None:
        if self._streams.pop(stream_id, None) is None or self._http2 is None:
            return
        # Also a stream the server ended: this side of it is closed too, so h2 forgets it.
        try:
            self._http2.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
            self._flush(time.monotonic() + 1.0)
        except (RpcError, h2.exceptions.H2Error):
            pass  # the connection is gone or the stream closed meanwhile: nothing left to cancel

    def _connect(self, deadline: float) -> h2.connection.H2Connection:
        where = f"{self.host}:{self.port}"
        timeout = max(0.001, min(self.connect_timeout, deadline - time.monotonic()))
        try:
            # Bytes: a str host would go through the idna codec (see parse_endpoint).
            raw = socket.create_connection((self.host.encode(), self.port), timeout=timeout)  # type: ignore[arg-type]
        except OSError as error:
            raise RpcError("UNAVAILABLE", f"cannot connect to {where}: {error.strerror or error}") from None
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            tls = self._tls.wrap_socket(raw, server_hostname=self.host.encode())
        except ssl.SSLCertVerificationError as error:
            raw.close()
            raise RpcError("UNAVAILABLE", f"TLS with {where}: {error.verify_message}") from None
        except (ssl.SSLError, OSError) as error:
            raw.close()
            raise RpcError("UNAVAILABLE", f"TLS with {where} failed: {error}") from None
        if tls.selected_alpn_protocol() not in (None, "h2"):
            tls.close()
            raise RpcError("UNAVAILABLE", f"{where} speaks {tls.selected_alpn_protocol()}, not HTTP/2")
        http2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        http2.initiate_connection()
        self._socket, self._http2 = tls, http2
        self._preface = b""
        self._flush(deadline)
        return http2

    def _connection(self) -> h2.connection.H2Connection:
        if self._http2 is None:
            raise self._lost
        return self._http2

    def _flush(self, deadline: float) -> None:
        http2, sock = self._connection(), self._socket
        assert sock is not None
        data = http2.data_to_send()
        if not data:
            return
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.sendall(data)
        except TimeoutError:
            raise self._drop(RpcError("DEADLINE_EXCEEDED", "the server took no data in time")) from None
        except (ssl.SSLEOFError, BrokenPipeError, ConnectionResetError):
            raise self._drop(RpcError("UNAVAILABLE", "the server closed the connection")) from None
        except OSError as error:
            raise self._drop(RpcError("UNAVAILABLE", f"sending failed: {error.strerror or error}")) from None

    def _read_until(self, done: Callable[[], bool], deadline: float, stream_id: int | None) -> None:
        """Read from the connection and act on what came until done() or the deadline, raising RpcError when the
        connection broke or, with a stream_id, when the deadline passed first."""
        while not done():
            http2, sock = self._connection(), self._socket
            assert sock is not None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if stream_id is None:
                    return
                # A server that stopped answering may be gone without having closed the connection: the next call
                # connects again rather than waiting on it.
                raise self._drop(RpcError("DEADLINE_EXCEEDED", "no answer in time"))
            try:
                sock.settimeout(remaining)
                data = sock.recv(RECEIVE_SIZE)
            except TimeoutError:
                continue
            except OSError as error:
                raise self._drop(RpcError("UNAVAILABLE", f"the connection broke: {error.strerror or error}")) from None
            if not data:
                raise self._drop(RpcError("UNAVAILABLE", "the server closed the connection"))
            self._check_preface(data)
            try:
                events = http2.receive_data(data)
            except h2.exceptions.ProtocolError as error:
                raise self._drop(RpcError("UNAVAILABLE", f"HTTP/2 protocol error from the server: {error}")) from None
            for event in events:
                self._on(event)
            if self._http2 is not None:
                self._flush(deadline)  # pings' and settings' acknowledgements, window updates

    def _check_preface(self, data: bytes) -> None:
        """Fail at once when the server's first frame is no SETTINGS frame: h2 would wait for the rest of a
        "frame" as long as an HTTP/1.1 answer's first bytes say it is."""
        if self._preface is None:
            return
        self._preface += data
        if len(self._preface) < 9:
            return
        if self._preface[3] != 0x4:
            began = self._preface[:24].decode("ascii", "replace")
            raise self._drop(RpcError("UNAVAILABLE", f"the server does not speak HTTP/2 (it began {began!r})"))
        self._preface = None

    def _on(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.ConnectionTerminated):
            self._drop(RpcError("UNAVAILABLE", f"the server closed the connection ({error_name(event.error_code)})"))
            return
        stream = self._streams.get(getattr(event, "stream_id", 0) or 0)
        if stream is None:
            return  # a stream cancelled meanwhile, or the connection itself (pings, settings: h2 answers those)
        if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
            stream.headers.update(event.headers)  # type: ignore[arg-type]  # str pairs with header_encoding set
        elif isinstance(event, h2.events.DataReceived):
            stream.data += event.data
            assert self._http2 is not None
            self._http2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            if len(stream.data) > MAX_MESSAGE_SIZE + PREFIX_SIZE:
                stream.failure = RpcError("RESOURCE_EXHAUSTED", f"the server sent over {MAX_MESSAGE_SIZE} bytes")
                stream.ended = True
        elif isinstance(event, h2.events.StreamEnded):
            stream.ended = True
        elif isinstance(event, h2.events.StreamReset) and not stream.ended:
            # After its trailers a server may reset the stream (NO_ERROR) to stop this side sending: the status
            # in the trailers stands.
            name = RESET_STATUS.get(event.error_code, "INTERNAL")  # type: ignore[call-overload]
            stream.failure = RpcError(name, f"the server reset the stream ({error_name(event.error_code)})")
            stream.ended = True

    def _drop(self, error: RpcError) -> RpcError:
        """Close the connection; every stream on it ends with error, which is returned to be raised."""
        if self._socket is not None:
            try:
                self._socket.close()
            except OSError:
                pass
        self._socket = self._http2 = None
        self._lost = error
        for stream in self._streams.values():
            if not stream.ended:
                stream.failure, stream.ended = error, True
        return error


class Call:
    """One call's stream: send messages, receive the answers in order, cancel it when done."""

    def __init__(self, channel: Channel, method: str, timeout: float | None) -> None:
        self.channel = channel
        self.method = method
        self.timeout = timeout
        self.stream_id: int | None = None

    @property
    def stream(self) -> CallStream:
        """The call's stream on the channel; only once the call has sent."""
        assert self.stream_id is not None
        return self.channel._streams[self.stream_id]

    def send(self, message: bytes, deadline: float, *, end: bool = False) -> None:
        """Send one message on the call, opening its stream at the first; end: the last message."""
        if self.stream_id is None:
            self.stream_id = self.channel._start(self.method, self.timeout, deadline)
        self.channel._send(self.stream_id, message, deadline, end=end)

    def receive(self, deadline: float) -> bytes | None:
        """The next answer, or None when the server ended the call OK without one; RpcError else."""
        if self.stream_id is None:
            raise RpcError("INTERNAL", "nothing was sent on the call")
        return self.channel._receive(self.stream_id, deadline)

    def close(self) -> None:
        """Cancel the call's stream, if it was opened."""
        if self.stream_id is not None:
            self.channel._cancel(self.stream_id)
