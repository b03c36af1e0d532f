"""Property-based fuzzing of the parsers that face the network or the operator.

Heartbeat requests (anyone who reaches the heartbeat port), takeover replies (whatever runs on a machine), and
the inventory and settings files (an operator's typing): any input gives a valid result or the parser's own
clean error, never another exception and never a hang.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bmdb.store import BMDB
from foundation.setting_values import SettingsError
from foundation.settings import Settings
from lifecycle.machine_text import MAX_TEXT, machine_text, machine_warnings
from lifecycle.takeover_failures import TakeoverError, TakeoverTarget, parse_reply
from processes.heartbeat_service import HeartbeatRejected, HeartbeatService
from proto import agent_api_pb2, takeover_pb2
from providers.bmc_secrets import BmcSecretRules
from providers.inventory import InventoryError, load_inventory

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# Longer than any parse may take: a parse that does not finish within it hangs.
HANG = 10.0


class LoopWithService:
    """A heartbeat service on a real BMDB, driven from synchronous hypothesis examples on one event loop."""

    def __init__(self, url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.bmdb = BMDB(url, pool_size=2)
        self.service = HeartbeatService(self.bmdb, interval=30.0, max_skew=60.0)
        self.known = uuid.uuid4()

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coroutine, HANG))

    def close(self) -> None:
        self.run(self.bmdb.close())
        self.loop.close()


@pytest.fixture(scope="module")
def heartbeats(bmdb_url_module: str) -> Iterator[LoopWithService]:
    driver = LoopWithService(bmdb_url_module)
    machine_id, _ = driver.run(driver.bmdb.admit_machine("sim", "node-0001"))
    driver.known = machine_id
    driver.run(driver.bmdb.record_agent_started(machine_id, datetime.now(UTC), b"k" * 32))
    yield driver
    driver.close()


def _check(driver: LoopWithService, data: bytes) -> None:
    try:
        response = driver.run(driver.service.check_and_record(data))
    except HeartbeatRejected as rejection:
        assert str(rejection) and rejection.result in {"malformed", "stale", "unauthenticated", "replayed"}
        return
    assert isinstance(response, agent_api_pb2.HeartbeatResponse)


@FUZZ
@given(data=st.binary(max_size=1200))
def test_any_bytes_on_the_heartbeat_port_are_a_clean_refusal(heartbeats, data):
    _check(heartbeats, data)


@FUZZ
@given(messages=st.lists(st.binary(max_size=1200), max_size=5))
def test_any_bytes_on_a_heartbeat_stream_are_answered_each_with_a_refusal(heartbeats, messages):
    """What the Heartbeats stream answers each message: a response with a refusal's outcome and why."""
    for data in messages:
        answer = agent_api_pb2.HeartbeatResponse.FromString(
            heartbeats.run(heartbeats.service._answer(data, "192.0.2.1", "ipv4:192.0.2.1:1"))
        )
        Outcome = agent_api_pb2.HeartbeatResponse.Outcome
        assert answer.outcome in {Outcome.MALFORMED, Outcome.STALE, Outcome.NOT_ACCEPTED, Outcome.REPLAYED}
        assert answer.message
        assert (answer.server_time_unix_ms > 0) == (answer.outcome == Outcome.STALE)


@FUZZ
@given(
    machine=st.one_of(st.text(max_size=60), st.uuids().map(str), st.just("known")),
    sent_at=st.one_of(st.integers(min_value=-(2**63), max_value=2**63 - 1), st.just(0)),
    nonce=st.binary(max_size=40),
    signature=st.binary(max_size=80),
)
def test_any_heartbeat_request_is_a_clean_refusal_without_its_agents_key(
    heartbeats, machine, sent_at, nonce, signature
):
    machine_id = str(heartbeats.known) if machine == "known" else machine
    request = agent_api_pb2.HeartbeatRequest(
        machine_id=machine_id, sent_at_unix_ms=sent_at, nonce=nonce, signature=signature
    )
    _check(heartbeats, request.SerializeToString())


TARGET = TakeoverTarget(machine_id="m", address="192.0.2.1", port=22, username="root")


@FUZZ
@given(stdout=st.binary(max_size=4096))
def test_any_takeover_reply_is_a_success_or_a_takeover_error(stdout):
    try:
        success = parse_reply(stdout, TARGET)
    except TakeoverError as error:
        assert str(error).startswith("takeover of machine m at 192.0.2.1:22 failed: ")
        assert "\n" not in str(error) and len(str(error)) < 1000
        return
    assert isinstance(success, takeover_pb2.TakeoverSuccess)


@FUZZ
@given(
    warnings=st.lists(st.text(max_size=2000), max_size=40),
    message=st.text(max_size=5000),
)
def test_what_a_machine_says_is_one_bounded_printable_line(warnings, message):
    kept = machine_warnings(warnings)
    assert len(kept) <= 11 and all(len(w) <= MAX_TEXT and w.isprintable() for w in kept)
    line = machine_text(message)
    assert len(line) <= MAX_TEXT and line.isprintable() and "\n" not in line


SETTING_NAMES = [*sorted(Settings.__dataclass_fields__), "providers", "no_such_setting", "machines"]
TOML_VALUES = st.one_of(
    st.integers(min_value=-(10**20), max_value=10**20).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(
        lambda f: {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(repr(f), repr(f))
    ),
    st.booleans().map(lambda b: str(b).lower()),
    st.text(max_size=30).map(lambda t: '"' + t.replace("\\", "\\\\").replace('"', '\\"') + '"'),
    st.sampled_from(['"30s"', '"5m"', '"-1h"', '"0"', "[]", "{}", '["a", 1]', '"postgresql://u:p@h/db"']),
)


def toml_documents() -> st.SearchStrategy[str]:
    line = st.tuples(st.sampled_from(SETTING_NAMES), TOML_VALUES).map(lambda kv: f"{kv[0]} = {kv[1]}")
    structured = st.lists(line, max_size=12).map("\n".join)
    return st.one_of(structured, st.text(max_size=400))


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "file.toml"


@FUZZ
@given(document=toml_documents())
def test_any_settings_file_gives_settings_or_a_settings_error(scratch, document):
    scratch.write_text(document)
    try:
        Settings.resolve({}, config_path=scratch)[0].check()
    except SettingsError as error:
        assert str(error).startswith("setting ")


INVENTORY_KEYS = st.sampled_from(
    [
        *("id", "ssh", "user", "bmc", "type", "url", "host", "port", "username", "password_file", "password_env"),
        *("insecure_http", "x"),
    ]
)
INVENTORY_VALUES = st.one_of(
    TOML_VALUES,
    st.sampled_from(['"rack1-node01"', '"10.0.0.1:22"', '"[::1]:2222"', '"redfish"', '"ipmi"', '"http://b"', "623"]),
)


def inventories() -> st.SearchStrategy[str]:
    pair = st.tuples(INVENTORY_KEYS, INVENTORY_VALUES).map(lambda kv: f"{kv[0]} = {kv[1]}")
    table = st.tuples(st.sampled_from(["[[machines]]", "[machines.bmc]", "[other]", ""]), st.lists(pair, max_size=5))
    structured = st.lists(table, max_size=5).map(lambda ts: "\n".join(h + "\n" + "\n".join(ps) for h, ps in ts))
    return st.one_of(structured, st.text(max_size=400))


@FUZZ
@given(document=inventories())
def test_any_inventory_gives_machines_or_an_inventory_error(scratch, document):
    scratch.write_text(document)
    try:
        machines = load_inventory(scratch, secrets=BmcSecretRules(scratch.parent, "BMC_PASSWORD_", {}))
    except InventoryError as error:
        assert str(error).startswith("provider static: ")
        return
    assert all(m.id for m in machines)
