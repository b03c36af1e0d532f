"""The agents' side of bench.heartbeats, in a process of its own so the server's cost is measured alone.

Signs every request beforehand (the agents' keys are derived from their
number, as bench.heartbeats registered them), says "ready" on standard output,
waits for a line on standard input, sends them back to back with at most
--concurrency in flight over --channels connections for --seconds, and prints
what it saw as one JSON line. Run by bench.heartbeats, not by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.heartbeat import signed_heartbeat
from processes.heartbeat_server import SERVICE

CALL_TIMEOUT = 10.0
# Requests signed per machine at most: a run longer than the fleet needs sends each machine's again, a millisecond
# later, so it is not a replay.
ROUNDS = 4


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


async def send(args: argparse.Namespace, requests: list[bytes], ca: bytes | None) -> LoadSeen:
    options = [("grpc.use_local_subchannel_pool", 1)]
    if ca is not None:
        credentials = grpc.ssl_channel_credentials(root_certificates=ca)
        channels = [grpc.aio.secure_channel(args.target, credentials, options=options) for _ in range(args.channels)]
    else:
        channels = [grpc.aio.insecure_channel(args.target, options=options) for _ in range(args.channels)]
    await asyncio.gather(*(channel.channel_ready() for channel in channels))
    # Raw bytes both ways: the agents' serializing is done beforehand and the answers need no parsing.
    calls = [
        channel.unary_unary(f"/{SERVICE}/Heartbeat", request_serializer=None, response_deserializer=None)
        for channel in channels
    ]
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    latencies: list[float] = []
    rejected: Counter[str] = Counter()
    pending = iter(requests)
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

    await asyncio.gather(*(in_turn(slot) for slot in range(args.concurrency)))
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


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.heartbeat_load", description=__doc__)
    parser.add_argument("--target", required=True)
    parser.add_argument("--ca", help="CA certificate file; plain text without it")
    parser.add_argument("--machines", type=int, required=True)
    parser.add_argument("--requests", type=int, required=True, help="requests to sign beforehand")
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--channels", type=int, required=True)
    args = parser.parse_args()
    requests = signed_requests(args.machines, min(args.requests, args.machines * ROUNDS))
    ca = Path(args.ca).read_bytes() if args.ca else None
    print(json.dumps(asdict(asyncio.run(send(args, requests, ca)))), flush=True)


if __name__ == "__main__":
    main()
