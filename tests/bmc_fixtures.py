"""sushy-emulator as a real Redfish BMC, with fake systems and Basic auth.

Import the fixtures into a test module to use them:
``from tests.bmc_fixtures import bmc_fixture, single_bmc_fixture  # noqa: F401``;
tests then take a ``bmc`` (several systems) or ``single_bmc`` (one system) argument.
Each emulator is started once per session on a free loopback port and accepts
one user, whose password is unique to the session.

The fake driver is slow on purpose, like hardware: a Restart shows Off at once
and On again 1 to 11 s later; On shows after the same kind of delay.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import bcrypt
import pytest
import requests

from tests.sshd_fixtures import free_port

EMULATOR = Path(sys.executable).parent / "sushy-emulator"
START_TIMEOUT = 20.0
USERNAME = "shepherd"


@dataclass(frozen=True)
class Bmc:
    url: str
    username: str
    password: str
    systems: dict[str, str]  # name -> path, e.g. "probe" -> /redfish/v1/Systems/<uuid>
    log: Path  # the emulator's output: a line for every request it was sent


def fake_system(name: str, power_state: str) -> dict[str, object]:
    return {
        "uuid": str(uuid.uuid4()),
        "name": name,
        "power_state": power_state,
        "external_notifier": False,
        "nics": [],
    }


def power_state(bmc: Bmc, name: str) -> str:
    """What the emulator says the system's power state is, read past the code under test."""
    answer = requests.get(bmc.url + bmc.systems[name], auth=(bmc.username, bmc.password), timeout=10)
    answer.raise_for_status()
    return str(answer.json()["PowerState"])


def reset_requests(bmc: Bmc, name: str) -> int:
    """How many power actions (ComputerSystem.Reset) the emulator was sent for the system, read from its log."""
    action = f"POST {bmc.systems[name]}/Actions/ComputerSystem.Reset "
    return bmc.log.read_text(errors="replace").count(action)


def wait_until_answering(process: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            # The service root is the one resource the emulator serves without credentials.
            if requests.get(f"{url}/redfish/v1/", timeout=1).ok:
                return
        except requests.RequestException:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"sushy-emulator did not answer at {url}: {log.read_text()}")
        time.sleep(0.1)


@contextlib.contextmanager
def running_bmc(directory: Path, systems: list[dict[str, object]]) -> Iterator[Bmc]:
    """sushy-emulator --fake with these systems, stopped on exit."""
    if not EMULATOR.exists():
        pytest.skip(f"sushy-emulator is not installed at {EMULATOR} (pip install sushy-tools)")
    password = f"bmc-pw-{secrets.token_hex(12)}"
    # 4 rounds, the least bcrypt takes: the emulator checks the hash on every request.
    digest = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()
    (directory / "htpasswd").write_text(f"{USERNAME}:{digest}\n")
    (directory / "emulator.conf").write_text(
        f"SUSHY_EMULATOR_AUTH_FILE = {str(directory / 'htpasswd')!r}\n"
        f"SUSHY_EMULATOR_STATE_DIR = {str(directory / 'state')!r}\n"
        f"SUSHY_EMULATOR_FAKE_SYSTEMS = {systems!r}\n"
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = directory / "emulator.log"
    with log_path.open("wb") as log:
        command = [str(EMULATOR), "--fake", "--config", str(directory / "emulator.conf"), "-i", "127.0.0.1"]
        # Virtual media the emulator downloads land in its temporary directory: here, not the host's /tmp.
        environment = {**os.environ, "TMPDIR": str(directory)}
        process = subprocess.Popen([*command, "-p", str(port)], stdout=log, stderr=log, env=environment)
    try:
        wait_until_answering(process, url, log_path)
        yield Bmc(
            url=url,
            username=USERNAME,
            password=password,
            systems={str(s["name"]): f"/redfish/v1/Systems/{s['uuid']}" for s in systems},
            log=log_path,
        )
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


# One system per test that changes power, so tests do not see each other's reboots.
BMC_SYSTEMS = [
    ("probe", "On"),
    ("reboot-on", "On"),
    ("reboot-off", "Off"),
    ("stays-off", "On"),
    ("escalate", "On"),
    ("restart-only", "On"),
    ("concurrent-1", "On"),
    ("concurrent-2", "On"),
    ("retire", "On"),
]


@pytest.fixture(scope="session", name="bmc")
def bmc_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bmc]:
    systems = [fake_system(name, state) for name, state in BMC_SYSTEMS]
    with running_bmc(tmp_path_factory.mktemp("bmc"), systems) as bmc:
        yield bmc


@pytest.fixture(scope="session", name="single_bmc")
def single_bmc_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bmc]:
    with running_bmc(tmp_path_factory.mktemp("single-bmc"), [fake_system("only", "On")]) as bmc:
        yield bmc
