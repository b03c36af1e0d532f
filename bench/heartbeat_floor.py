"""The floor of bench.heartbeats' idle-agent memory: a bare gRPC server, in a process of its own, that holds
agents as the heartbeat server does and does nothing else.

It is built by the heartbeat server's own build_server, so its TLS (the same certificate files, served the same
way) and its core options are the server's, but its handler answers every heartbeat as accepted without looking
at it: no keys, no BMDB, no checks. What an idle agent costs it is what gRPC and the TLS connection cost, which no
code of ours can take away. --option NAME=VALUE adds a gRPC core option (an integer) to the server's, to price a
core option on the floor without changing the product's server. Prints the port it listens on, then serves until
its standard input closes. Run by bench.heartbeats, not by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any, cast

import grpc

from processes.heartbeat_server import build_server
from processes.heartbeat_service import HeartbeatService
from proto import agent_api_pb2

ACCEPTED = agent_api_pb2.HeartbeatResponse(outcome=agent_api_pb2.HeartbeatResponse.Outcome.ACCEPTED)
ACCEPTED_BYTES = ACCEPTED.SerializeToString()


class BareService:
    """The heartbeat service's two calls, of the same shape (read and written through the context), answering
    every heartbeat as accepted; what build_server reads of a HeartbeatService."""

    max_streams = 1_000_000
    max_in_flight = 1_000

    async def handle(self, request_bytes: bytes, context: grpc.aio.ServicerContext) -> agent_api_pb2.HeartbeatResponse:
        return ACCEPTED

    async def stream(self, requests: object, context: grpc.aio.ServicerContext) -> None:
        while await context.read() is not grpc.aio.EOF:
            await context.write(ACCEPTED_BYTES)


def core_option(text: str) -> tuple[str, int]:
    name, separator, value = text.partition("=")
    if not separator or not name.startswith("grpc."):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE with a gRPC core option's name")
    try:
        return name, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the value is not an integer") from None


def with_options(extra: list[tuple[str, int]]) -> None:
    """Add extra to the options of every grpc.aio.server made from now on in this process: build_server's own
    come first, so an extra one of the same name is the one gRPC's core keeps."""
    make = grpc.aio.server

    def server(*args: Any, options: list[tuple[str, Any]] | None = None, **kwargs: Any) -> grpc.aio.Server:
        return make(*args, options=[*(options or []), *extra], **kwargs)

    grpc.aio.server = server


async def serve(args: argparse.Namespace) -> None:
    with_options(args.option)
    tls = None if args.certificate is None else (Path(args.certificate), Path(args.key))
    # Duck-typed: build_server reads the two handlers and the two caps, which BareService has.
    server, port = build_server(cast(HeartbeatService, BareService()), "127.0.0.1:0", tls)
    await server.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(None)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.heartbeat_floor", description=__doc__)
    parser.add_argument("--certificate", help="PEM certificate chain; plain text without it")
    parser.add_argument("--key", help="PEM private key of --certificate")
    parser.add_argument("--option", type=core_option, action="append", default=[], help="NAME=VALUE, repeatable")
    args = parser.parse_args()
    if (args.certificate is None) != (args.key is None):
        parser.error("--certificate and --key go together")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
