"""The arithmetic and the parsing of bench.heartbeats' idle-agent memory, and its floor server answering over TLS."""

from __future__ import annotations

import argparse

import grpc
import pytest

from bench.heartbeat_floor import core_option
from bench.heartbeats import FloorProcess, PerAgent, calls, per_agent
from foundation.tls import local_certificates
from processes.heartbeat_server import SERVICE
from proto import agent_api_pb2


def test_an_agent_is_the_slope_between_counts_each_above_its_own_servers_memory_before():
    # 2,000 agents add 100 MiB over a server of 150 MiB; 10,000 add 500 MiB over a fresh one of 160 MiB: one more
    # agent costs 400 MiB / 8,000, and each count's own figure is 51.2 KiB.
    figure = per_agent({2_000: (150.0, 250.0), 10_000: (160.0, 660.0)})
    assert figure == PerAgent(slope=51.2, low=51.2, high=51.2)


def test_one_off_costs_leave_the_slope_and_show_in_the_spread():
    # 4 MiB paid once, whatever the count: the smallest count's own figure carries most of it, the slope none.
    figure = per_agent({1_000: (100.0, 104.0 + 50), 5_000: (100.0, 104.0 + 250), 3_000: (100.0, 104.0 + 150)})
    assert figure.slope == pytest.approx(51.2)
    assert figure.low == pytest.approx(254 * 1024 / 5_000)
    assert figure.high == pytest.approx(54 * 1024 / 1_000)


def test_one_count_is_its_own_slope():
    assert per_agent({2_000: (100.0, 200.0)}) == PerAgent(slope=51.2, low=51.2, high=51.2)


def test_calls_are_named_once_each_and_both_is_the_stream_then_unary():
    assert calls("both") == ["stream", "unary"]
    assert calls("stream, connect,connect-resumed") == ["stream", "connect", "connect-resumed"]
    for wrong in ("", "stream,stream", "streams", "stream,bogus"):
        with pytest.raises(argparse.ArgumentTypeError):
            calls(wrong)


def test_a_floor_option_is_a_core_options_name_and_an_integer():
    assert core_option("grpc.tsi.max_frame_size=8192") == ("grpc.tsi.max_frame_size", 8192)
    for wrong in ("grpc.tsi.max_frame_size", "tsi.max_frame_size=8192", "grpc.tsi.max_frame_size=8k"):
        with pytest.raises(argparse.ArgumentTypeError):
            core_option(wrong)


async def test_the_floor_holds_a_stream_over_the_servers_tls_and_accepts_every_heartbeat(tmp_path):
    certificates = local_certificates(tmp_path / "tls")
    floor = FloorProcess([("grpc.tsi.max_frame_size", 8192)])
    target = await floor.start((certificates.server_certificate, certificates.server_key))
    try:
        credentials = grpc.ssl_channel_credentials(certificates.ca_certificate.read_bytes())
        async with grpc.aio.secure_channel(target, credentials) as channel:
            stream = channel.stream_stream(
                f"/{SERVICE}/Heartbeats",
                request_serializer=agent_api_pb2.HeartbeatRequest.SerializeToString,
                response_deserializer=agent_api_pb2.HeartbeatResponse.FromString,
            )()
            for machine in ("a", "b"):
                await stream.write(agent_api_pb2.HeartbeatRequest(machine_id=machine))
                answer = await stream.read()
                assert answer.outcome == agent_api_pb2.HeartbeatResponse.Outcome.ACCEPTED
            await stream.done_writing()
            assert await stream.code() == grpc.StatusCode.OK
    finally:
        await floor.stop()
    assert floor.command is not None and floor.command.returncode == 0
