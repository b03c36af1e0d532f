"""pyghmi's fakebmc as real IPMI BMCs, one machine each (tests/fake_ipmi_bmc.py, in a process of its own).

Import the fixture into a test module to use it: ``from tests.ipmi_fixtures import ipmi_fixture  # noqa: F401``;
tests then take an ``ipmi`` argument. The BMCs start once per session on free UDP ports of 127.0.0.1 and accept
one user, whose password is unique to the session. A power change shows in the power state 0.2 s after the BMC
took it, as on hardware.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from providers.ipmi import IpmiEndpoint

SERVER = Path(__file__).with_name("fake_ipmi_bmc.py")
START_TIMEOUT = 20.0
# Longer than a logout may take to reach the BMC and show in its log.
SETTLE_TIMEOUT = 5.0
USERNAME = "shepherd"
MACHINE = "rack2-node3"


@dataclass(frozen=True)
class IpmiBmcs:
    username: str
    password: str
    ports: dict[str, int]  # BMC name -> its UDP port on 127.0.0.1
    log: Path  # what every BMC was asked and answered, a line each

    def endpoint(self, name: str, *, password: str | None = None, machine: str = MACHINE) -> IpmiEndpoint:
        return IpmiEndpoint(
            machine=machine,
            host="127.0.0.1",
            port=self.ports[name],
            username=self.username,
            password=self.password if password is None else password,
        )

    def events(self, name: str) -> list[str]:
        """What the BMC was asked and answered, in order ("login shepherd", "status on", "control shutdown"), once
        its last session is closed: a client's logout is a message it does not wait on."""
        deadline = time.monotonic() + SETTLE_TIMEOUT
        while True:
            lines = self.log.read_text(errors="replace").splitlines()
            events = [line.removeprefix(f"{name} ") for line in lines if line.startswith(f"{name} ")]
            logins = sum(event.startswith("login ") for event in events)
            if logins == events.count("logout") or time.monotonic() > deadline:
                return events
            time.sleep(0.02)


def in_order(events: list[str], expected: list[str]) -> bool:
    """Whether the events hold the expected ones in this order, others between them allowed."""
    remaining = iter(events)
    return all(any(event == wanted for event in remaining) for wanted in expected)


@contextlib.contextmanager
def running_bmcs(directory: Path, specs: dict[str, str]) -> Iterator[IpmiBmcs]:
    """The fake BMCs of specs (name -> "on" or "off", then quirks: see fake_ipmi_bmc.py), stopped on exit."""
    password = f"ipmi-pw-{secrets.token_hex(6)}"  # IPMI 2.0 passwords are at most 20 bytes
    ports_file = directory / "ports.json"
    log_path = directory / "bmc.log"
    environment = {**os.environ, "FAKE_BMC_USER": USERNAME, "FAKE_BMC_PASSWORD": password, "PYTHONUNBUFFERED": "1"}
    with log_path.open("wb") as log:
        arguments = [f"{name}={spec}" for name, spec in specs.items()]
        process = subprocess.Popen(
            [sys.executable, str(SERVER), str(ports_file), *arguments], stdout=log, stderr=log, env=environment
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not ports_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fake IPMI BMCs did not start: {log_path.read_text()}")
            time.sleep(0.05)
        ports = {name: int(port) for name, port in json.loads(ports_file.read_text()).items()}
        yield IpmiBmcs(username=USERNAME, password=password, ports=ports, log=log_path)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


# One BMC per test that changes power, so tests do not see each other's power changes.
IPMI_BMCS = {
    "probe": "on",
    "reboot-on": "on",
    "reboot-off": "off",
    "escalate": "on,ignores-soft-off",
    "stays-off": "on,never-on",
    "retire": "on",
    "concurrent": "on",
    "refused": "on",
    "static": "on",
    "static-retire": "on",
    "any-cipher-suite": "on,any-cipher-suite",
}


@pytest.fixture(scope="session", name="ipmi")
def ipmi_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IpmiBmcs]:
    with running_bmcs(tmp_path_factory.mktemp("ipmi-bmcs"), IPMI_BMCS) as bmcs:
        yield bmcs
