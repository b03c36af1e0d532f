"""The agents' side of bench.heartbeats, in a process of its own so the server's cost is measured alone.

Signs every request beforehand (the agents' keys are derived from their
number, as bench.heartbeats registered them), says "ready" on standard output,
waits for a line on standard input, sends them back to back with at most
--concurrency in flight over --channels connections for --seconds, and prints
what it saw as one JSON line. With --call unary each heartbeat is a Heartbeat
call; with --call stream, --concurrency Heartbeats streams share the
connections, and each sends its next heartbeat when the last is answered. With
--call connect each heartbeat is a Heartbeat call on a connection of its own,
opened for it (a TLS handshake) and closed after its answer, as an agent that
holds no connection between heartbeats; --call connect-resumed the same, its
TLS sessions resumed from a cache the connections share.

With --idle N it holds N idle agents instead, spread over --channels
connections: each sends one heartbeat, as a unary call (--call unary) or on a
stream it keeps open (--call stream), then the process says "open" and holds
the connections, and the streams, until a line on standard input: what an
idle fleet costs the server. Run by bench.heartbeats, not by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import resource
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from grpc.experimental.session_cache import ssl_session_cache_lru

from agent.heartbeat import signed_heartbeat
from processes.heartbeat_server import SERVICE
from proto import agent_api_pb2

Outcome = agent_api_pb2.HeartbeatResponse.Outcome

CALL_TIMEOUT = 10.0
# Requests signed per machine at most: a run longer than the fleet needs sends each machine's again, a millisecond
# later, so it is not a replay.
ROUNDS = 4
# The calls that open a connection for each heartbeat and close it after the answer: without TLS session
# resumption, and with it (a cache of the sessions the server handed out, shared by the load's connections).
CONNECTING = ("connect", "connect-resumed")
# Idle agents sending their first heartbeat at once.
IDLE_SLICE = 500


def agent_key(n: int) -> Ed25519PrivateKey:
    """Machine n's agent key, the same in both processes."""
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"bench-agent-%d" % n).digest())


def machine_id(n: int) -> uuid.UUID:
    return uuid.UUID(bytes=hashlib.sha256(b"bench-machine-%d" % n).digest()[:16], version=4)


def signed_requests(machines: int, count: int) -> list[bytes]:
    """count serialized heartbeats, machine after machine, each machine's later one a millisecond newer."""
    now_ms = int(time.time() * 1000)
    agents = [(str(machine_id(n)), agent_key(n)) for n in range(min(machines, count))]
    return [
        signed_heartbeat(*agents[sent % len(agents)], now_ms=now_ms + sent // len(agents)).SerializeToString()
        for sent in range(count)
    ]


@dataclass
class LoadSeen:
    """What the load process saw: for how long it sent, accepted and rejected requests, latencies in seconds."""

    elapsed: float
    accepted: int
    rejected: dict[str, int]
    ran_out: bool
    p50: float
    p99: float


def open_channels(
    args: argparse.Namespace, ca: bytes | None, count: int, session_cache: Any = None
) -> list[grpc.aio.Channel]:
    # A subchannel pool each, so every channel is a connection of its own.
    options: list[tuple[str, Any]] = [("grpc.use_local_subchannel_pool", 1)]
    if session_cache is not None:
        options.append(("grpc.ssl_session_cache", session_cache))
    if ca is not None:
        credentials = grpc.ssl_channel_credentials(root_certificates=ca)
        return [grpc.aio.secure_channel(args.target, credentials, options=options) for _ in range(count)]
    return [grpc.aio.insecure_channel(args.target, options=options) for _ in range(count)]


def heartbeat_methods(channels: list[grpc.aio.Channel], call: str) -> list[Any]:
    """Each channel's unary Heartbeat or its Heartbeats stream, on raw bytes both ways: the agents' serializing is
    done beforehand and the answers need little parsing."""
    if call == "unary":
        return [
            channel.unary_unary(f"/{SERVICE}/Heartbeat", request_serializer=None, response_deserializer=None)
            for channel in channels
        ]
    return [
        channel.stream_stream(f"/{SERVICE}/Heartbeats", request_serializer=None, response_deserializer=None)
        for channel in channels
    ]


async def send(args: argparse.Namespace, requests: list[bytes], ca: bytes | None) -> LoadSeen:
    # An agent that connects for each heartbeat holds no connection before it: none are opened beforehand.
    channels = [] if args.call in CONNECTING else open_channels(args, ca, args.channels)
    await asyncio.gather(*(channel.channel_ready() for channel in channels))
    # One cache for every connection, as one agent keeps its TLS session from one heartbeat to its next.
    session_cache = ssl_session_cache_lru(args.concurrency) if args.call == "connect-resumed" else None
    latencies: list[float] = []
    rejected: Counter[str] = Counter()
    pending = iter(requests)
    calls = opened = heartbeat_methods(channels, "unary" if args.call in CONNECTING else args.call)
    if args.call == "stream":
        streams = [opened[slot % len(opened)]() for slot in range(args.concurrency)]
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    start = time.perf_counter()
    deadline = start + args.seconds

    async def in_turn(slot: int) -> None:
        call = calls[slot % len(calls)]
        for request in pending:
            if time.perf_counter() >= deadline:
                return
            sent = time.perf_counter()
            try:
                await call(request, timeout=CALL_TIMEOUT)
            except grpc.aio.AioRpcError as error:
                rejected[error.code().name] += 1
                continue
            latencies.append(time.perf_counter() - sent)

    async def connection_each(slot: int) -> None:
        for request in pending:
            if time.perf_counter() >= deadline:
                return
            sent = time.perf_counter()
            (channel,) = open_channels(args, ca, 1, session_cache)
            (call,) = heartbeat_methods([channel], "unary")
            try:
                await call(request, timeout=CALL_TIMEOUT)
            except grpc.aio.AioRpcError as error:
                rejected[error.code().name] += 1
                continue
            finally:
                await channel.close()
            latencies.append(time.perf_counter() - sent)

    async def on_stream(slot: int) -> None:
        stream = streams[slot]
        accepted = b""
        for request in pending:
            if time.perf_counter() >= deadline:
                break
            sent = time.perf_counter()
            await stream.write(request)
            answer = await stream.read()
            if answer is grpc.aio.EOF:
                rejected["stream ended"] += 1
                return
            if answer != accepted:
                outcome = agent_api_pb2.HeartbeatResponse.FromString(answer).outcome
                if outcome != Outcome.ACCEPTED:
                    rejected[Outcome.Name(outcome)] += 1
                    continue
                accepted = answer  # every accepted answer is the same bytes
            latencies.append(time.perf_counter() - sent)
        await stream.done_writing()

    if args.call == "unary":
        await asyncio.gather(*(in_turn(slot) for slot in range(args.concurrency)))
    elif args.call in CONNECTING:
        await asyncio.gather(*(connection_each(slot) for slot in range(args.concurrency)))
    else:
        await asyncio.gather(*(on_stream(slot) for slot in range(args.concurrency)))
    elapsed = time.perf_counter() - start
    for channel in channels:
        await channel.close()
    latencies.sort()
    return LoadSeen(
        elapsed=elapsed,
        accepted=len(latencies),
        rejected=dict(rejected),
        ran_out=elapsed < args.seconds,
        p50=latencies[len(latencies) // 2] if latencies else 0.0,
        p99=latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] if latencies else 0.0,
    )


async def hold_idle(args: argparse.Namespace, requests: list[bytes], ca: bytes | None) -> None:
    """Hold --idle agents over --channels connections, one heartbeat each, until told on standard input."""
    channels = open_channels(args, ca, args.channels)
    calls = opened = heartbeat_methods(channels, args.call)
    streams: list[grpc.aio.StreamStreamCall] = []
    refused: Counter[str] = Counter()

    async def first_heartbeat(n: int) -> None:
        request = requests[n % len(requests)]
        if args.call == "unary":
            try:
                answer = await calls[n % len(calls)](request, timeout=CALL_TIMEOUT)
            except grpc.aio.AioRpcError as error:
                refused[error.code().name] += 1
                return
        else:
            stream = opened[n % len(opened)]()
            streams.append(stream)
            try:
                await stream.write(request)
                answer = await stream.read()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                refused[(await stream.code()).name] += 1
                return
        if answer is grpc.aio.EOF:
            # The stream ended unanswered: how it ended says why (a TLS or HTTP/2 failure is not a refusal).
            refused[f"ended {(await stream.code()).name}: {await stream.details()}"] += 1
        elif agent_api_pb2.HeartbeatResponse.FromString(answer).outcome != Outcome.ACCEPTED:
            refused["not accepted"] += 1

    # In slices, so the server is not asked for thousands of TLS handshakes at once.
    for first in range(0, args.idle, IDLE_SLICE):
        await asyncio.gather(*(first_heartbeat(n) for n in range(first, min(first + IDLE_SLICE, args.idle))))
    print(json.dumps({"open": args.idle - sum(refused.values()), "refused": dict(refused)}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    for stream in streams:
        stream.cancel()
    for channel in channels:
        await channel.close()


def raise_open_files_limit() -> None:
    """Up to the hard limit: an idle fleet is a connection an agent, and each is a file descriptor."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.heartbeat_load", description=__doc__)
    parser.add_argument("--target", required=True)
    parser.add_argument("--ca", help="CA certificate file; plain text without it")
    parser.add_argument("--machines", type=int, required=True)
    parser.add_argument("--requests", type=int, required=True, help="requests to sign beforehand")
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--channels", type=int, required=True)
    parser.add_argument("--call", choices=("unary", "stream", *CONNECTING), default="unary")
    parser.add_argument("--idle", type=int, default=0, help="hold this many idle agents instead")
    args = parser.parse_args()
    if args.idle:
        raise_open_files_limit()
        requests = signed_requests(args.machines, min(args.idle, args.machines))
        ca = Path(args.ca).read_bytes() if args.ca else None
        asyncio.run(hold_idle(args, requests, ca))
        return
    requests = signed_requests(args.machines, min(args.requests, args.machines * ROUNDS))
    ca = Path(args.ca).read_bytes() if args.ca else None
    print(json.dumps(asdict(asyncio.run(send(args, requests, ca)))), flush=True)


if __name__ == "__main__":
    main()
