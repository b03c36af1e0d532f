"""Connections to the heartbeat port over real gRPC and TLS: capped per process and per address, and closed when
they never finish their handshake or carry no call for a while; the agents' own connections go on."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from bmdb.store import BMDB
from foundation.tls import LocalCertificates, local_certificates
from processes.heartbeat_connections import ConnectionGuard, parse_tcp_table
from processes.heartbeat_server import build_server
from processes.heartbeat_service import HeartbeatService
from proto import agent_api_pb2, agent_api_pb2_grpc
from tests.test_heartbeat_streams import Agent, Relay, now_ms, started_agents

Outcome = agent_api_pb2.HeartbeatResponse.Outcome

# The client's first bytes of an HTTP/2 connection: its preface and an empty SETTINGS frame.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"

# How long a connection is given to be closed: far more than it takes, so a loaded machine is no failure.
CLOSED_WITHIN = 30.0


@dataclass
class Served:
    port: int
    service: HeartbeatService
    certificates: LocalCertificates

    def channel(self, port: int | None = None) -> grpc.aio.Channel:
        """A gRPC channel to the server, or through a relay on port."""
        credentials = grpc.ssl_channel_credentials(root_certificates=self.certificates.ca_certificate.read_bytes())
        return grpc.aio.secure_channel(f"127.0.0.1:{port or self.port}", credentials)

    async def tls_connection(self, source: str = "127.0.0.1") -> ssl.SSLSocket:
        """A connection from source that finishes its TLS handshake and opens HTTP/2, then sends nothing more."""
        context = ssl.create_default_context(cafile=str(self.certificates.ca_certificate))
        context.set_alpn_protocols(["h2"])

        def connect() -> ssl.SSLSocket:
            raw = socket.create_connection(("127.0.0.1", self.port), source_address=(source, 0))
            connection = context.wrap_socket(raw, server_hostname="127.0.0.1")
            connection.sendall(HTTP2_PREFACE)
            return connection

        return await asyncio.to_thread(connect)


@pytest.fixture
def certificates(tmp_path: Path) -> LocalCertificates:
    return local_certificates(tmp_path / "tls")


@contextlib.asynccontextmanager
async def serving(bmdb: BMDB, certificates: LocalCertificates, **limits: Any) -> AsyncIterator[Served]:
    service = HeartbeatService(bmdb, interval=30.0, max_skew=60.0)
    server, port = build_server(
        service, "127.0.0.1:0", (certificates.server_certificate, certificates.server_key), **limits
    )
    await server.start()
    try:
        yield Served(port, service, certificates)
    finally:
        await server.stop(None)
        await service.close()


async def closed(connection: socket.socket) -> bool:
    """Whether the server closed the connection, waiting at most CLOSED_WITHIN for it; what it sent meanwhile
    (its HTTP/2 settings, a GOAWAY) is read and passed over."""

    def read_to_the_end() -> bool:
        connection.settimeout(CLOSED_WITHIN)
        try:
            while connection.recv(65536):
                pass
        except TimeoutError:
            return False
        except (ssl.SSLError, ConnectionResetError):
            pass  # cut without TLS's goodbye: closed all the same
        return True

    return await asyncio.to_thread(read_to_the_end)


def still_open(connection: socket.socket) -> bool:
    """Whether the connection is open now: nothing to read but what the server sent, and no end."""
    connection.setblocking(False)
    try:
        while connection.recv(65536):
            pass
    except (BlockingIOError, ssl.SSLWantReadError):
        return True
    except (ssl.SSLError, ConnectionResetError):
        return False
    finally:
        connection.setblocking(True)
    return False


async def accepted(stub: agent_api_pb2_grpc.AgentCallbackStub, agent: Agent) -> None:
    """A unary heartbeat of the agent, which the server accepts."""
    response = await stub.Heartbeat(agent.heartbeat(now_ms()))
    assert response.outcome == Outcome.ACCEPTED


async def exchanged(stream: grpc.aio.StreamStreamCall, agent: Agent) -> None:
    """A heartbeat of the agent on its stream, which the server accepts."""
    await stream.write(agent.heartbeat(now_ms()))
    response = await stream.read()
    assert isinstance(response, agent_api_pb2.HeartbeatResponse) and response.outcome == Outcome.ACCEPTED


async def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + CLOSED_WITHIN
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not so within {CLOSED_WITHIN:.0f}s: {what}")
        await asyncio.sleep(0.05)


async def test_connections_past_the_cap_are_closed_at_once_and_those_under_it_keep_working(bmdb, certificates):
    first, second = await started_agents(bmdb, 2)
    async with serving(bmdb, certificates, max_connections=2) as served:
        async with served.channel() as one, served.channel() as two:
            await accepted(agent_api_pb2_grpc.AgentCallbackStub(one), first)
            await accepted(agent_api_pb2_grpc.AgentCallbackStub(two), second)
            with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)):
                await served.tls_connection()
            await accepted(agent_api_pb2_grpc.AgentCallbackStub(one), first)
            await accepted(agent_api_pb2_grpc.AgentCallbackStub(two), second)


async def test_a_connection_that_never_starts_tls_is_closed_after_the_handshake_timeout(bmdb, certificates):
    async with serving(bmdb, certificates, handshake_timeout=1.0) as served:
        with socket.create_connection(("127.0.0.1", served.port)) as silent:
            assert await closed(silent)


async def test_a_connection_with_no_call_is_closed_when_idle_and_one_holding_a_stream_is_not(bmdb, certificates):
    unary, streaming = await started_agents(bmdb, 2)
    async with serving(bmdb, certificates, idle_timeout=1.0) as served:
        async with served.channel() as quiet, served.channel() as holding:
            await accepted(agent_api_pb2_grpc.AgentCallbackStub(quiet), unary)
            stream = agent_api_pb2_grpc.AgentCallbackStub(holding).Heartbeats()
            await exchanged(stream, streaming)
            assert quiet.get_state() == grpc.ChannelConnectivity.READY
            # The server's GOAWAY takes the quiet channel back to IDLE; it connects again at its next call.
            await asyncio.wait_for(quiet.wait_for_state_change(grpc.ChannelConnectivity.READY), CLOSED_WITHIN)
            connection = await served.tls_connection()
            assert await closed(connection), "a connection that opened HTTP/2 and no call"
            # The stream held its connection through all of that, longer than the idle timeout, and goes on.
            assert holding.get_state() == grpc.ChannelConnectivity.READY
            await exchanged(stream, streaming)
            await accepted(agent_api_pb2_grpc.AgentCallbackStub(quiet), unary)
            stream.cancel()


async def test_one_address_past_its_cap_loses_its_extra_connections_and_another_address_is_untouched(
    bmdb, certificates
):
    nearby, crowded = await started_agents(bmdb, 2)
    async with serving(bmdb, certificates) as served:
        guard = ConnectionGuard(served.port, 2, holding_streams=served.service.stream_peers.keys)
        relay = Relay("127.0.0.2", served.port)
        async with served.channel() as local, relay.listening() as relay_port, served.channel(relay_port) as relayed:
            # An agent at 127.0.0.1 with a stream and a connection of unary calls: two, its cap.
            stream = agent_api_pb2_grpc.AgentCallbackStub(local).Heartbeats()
            await exchanged(stream, nearby)
            async with served.channel() as unary_channel:
                await accepted(agent_api_pb2_grpc.AgentCallbackStub(unary_channel), nearby)
                # 127.0.0.2: three connections with no call, then the newest, an agent's with a stream.
                idle = [await served.tls_connection("127.0.0.2") for _ in range(3)]
                crowded_stream = agent_api_pb2_grpc.AgentCallbackStub(relayed).Heartbeats()
                await exchanged(crowded_stream, crowded)
                assert await guard.check() == {"127.0.0.2": 2}
                # Those without a stream go first: two of them, and the agent's stream stays.
                await until(lambda: [still_open(each) for each in idle].count(False) == 2, "two idle ones closed")
                assert [still_open(each) for each in idle].count(True) == 1
                await exchanged(crowded_stream, crowded)
                # 127.0.0.1 held no more than its cap: its stream and its calls go on.
                await exchanged(stream, nearby)
                await accepted(agent_api_pb2_grpc.AgentCallbackStub(unary_channel), nearby)
                assert await guard.check() == {}
                for connection in idle:
                    connection.close()
            stream.cancel()
            crowded_stream.cancel()


def tables(tmp_path: Path, tcp: str, tcp6: str, in_use: int) -> dict[str, Any]:
    (tmp_path / "tcp").write_text(tcp)
    (tmp_path / "tcp6").write_text(tcp6)
    (tmp_path / "sockstat").write_text(f"sockets: used 40\nTCP: inuse {in_use} orphan 0 tw 3 alloc 9 mem 1\n")
    (tmp_path / "sockstat6").write_text("TCP6: inuse 0\nUDP6: inuse 0\n")
    return {
        "tables": (tmp_path / "tcp", tmp_path / "tcp6"),
        "sockstats": (tmp_path / "sockstat", tmp_path / "sockstat6"),
    }


HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
TCP = HEADER + (
    # Port 8900 (22C4): the listening socket, two connections from 10.0.0.7, one from 10.0.0.8, one closed (no
    # inode), and a connection to another port from 10.0.0.7.
    "   0: 00000000:22C4 00000000:0000 0A 00000000:00000000 00:00000000 00000000  0  0 1001 1 0 100 0 0 10 0\n"
    "   1: 0100007F:22C4 0700000A:C350 01 00000000:00000000 02:000AFC21 00000000  0  0 1002 2 0 20 4 30 10 -1\n"
    "   2: 0100007F:22C4 0700000A:C351 01 00000000:00000000 02:000AFC21 00000000  0  0 1003 2 0 20 4 30 10 -1\n"
    "   3: 0100007F:22C4 0800000A:C352 01 00000000:00000000 02:000AFC21 00000000  0  0 1004 2 0 20 4 30 10 -1\n"
    "   4: 0100007F:22C4 0700000A:C353 06 00000000:00000000 03:00001226 00000000  0  0 0 3 0\n"
    "   5: 0100007F:0016 0700000A:C354 01 00000000:00000000 02:000AFC21 00000000  0  0 1005 2 0 20 4 30 10 -1\n"
)
TCP6 = HEADER + (
    # 2001:db8:1:2::7 and 2001:db8:1:2:ffff:ee::1, one /64; 2001:db8:1:3::7; and 10.0.0.8 on a dual-stack socket.
    "   0: 00000000000000000000000001000000:22C4 B80D0120020001000000000007000000:9C40 01 00000000:00000000"
    " 00:00000000 00000000  0  0 2001 1 0\n"
    "   1: 00000000000000000000000001000000:22C4 B80D012002000100EE00FFFF01000000:9C41 01 00000000:00000000"
    " 00:00000000 00000000  0  0 2002 1 0\n"
    "   2: 00000000000000000000000001000000:22C4 B80D0120030001000000000007000000:9C42 01 00000000:00000000"
    " 00:00000000 00000000  0  0 2003 1 0\n"
    "   3: 00000000000000000000000001000000:22C4 0000000000000000FFFF00000800000A:9C43 01 00000000:00000000"
    " 00:00000000 00000000  0  0 2004 1 0\n"
)


def test_the_kernels_tables_are_read_by_address_with_an_ipv6_host_as_its_64(tmp_path):
    connections = parse_tcp_table(TCP, 8900) + parse_tcp_table(TCP6, 8900)
    assert [(c.inode, c.peer) for c in connections] == [
        (1002, "ipv4:10.0.0.7:50000"),
        (1003, "ipv4:10.0.0.7:50001"),
        (1004, "ipv4:10.0.0.8:50002"),
        (2001, "ipv6:[2001:db8:1:2::7]:40000"),
        (2002, "ipv6:[2001:db8:1:2:ffff:ee:0:1]:40001"),
        (2003, "ipv6:[2001:db8:1:3::7]:40002"),
        (2004, "ipv4:10.0.0.8:40003"),
    ]
    guard = ConnectionGuard(8900, 1, **tables(tmp_path, TCP, TCP6, in_use=9))
    over = guard.over_cap()
    assert {address: [c.inode for c in each] for address, each in over.items()} == {
        "10.0.0.7": [1002, 1003],
        "10.0.0.8": [1004, 2004],
        "2001:db8:1:2::/64": [2001, 2002],
    }
    assert set(ConnectionGuard(8900, 1, ipv6_prefix=128, **tables(tmp_path, TCP, TCP6, 9)).over_cap()) == {
        "10.0.0.7",
        "10.0.0.8",
    }
    # With no more sockets in all than the cap, no address can be over it: the tables are not read.
    assert ConnectionGuard(8900, 9, **tables(tmp_path, TCP, TCP6, in_use=9)).over_cap() == {}
    assert ConnectionGuard(8900, 1, **tables(tmp_path, TCP, TCP6, in_use=1)).over_cap() == {}
    assert ConnectionGuard(8900, 0, **tables(tmp_path, TCP, TCP6, in_use=9)).over_cap() == {}, "0: no cap"
    # An address holds at most its streams' connections and every connection without a stream: nine sockets, eight
    # of them streaming and none from one address with more than one stream, leave no room for two from one.
    assert ConnectionGuard(8900, 2, **tables(tmp_path, TCP, TCP6, in_use=9)).over_cap(8, 1) == {}
    assert ConnectionGuard(8900, 1, **tables(tmp_path, TCP, TCP6, in_use=9)).over_cap(8, 0) == {}
    assert set(ConnectionGuard(8900, 1, **tables(tmp_path, TCP, TCP6, in_use=9)).over_cap(7, 0)) == set(over)
