"""OpenStack Ironic standalone as its users run it: SQLite, one all-in-one process, no Keystone, no message bus.

Import the fixture into a test module to use it: ``from tests.ironic_fixtures import ironic_fixture  # noqa: F401``;
tests then take an ``ironic`` argument. The server is started once per module on a free loopback port with
``fake-hardware`` nodes enabled (and ``redfish`` ones, for nodes whose BMC is sushy-emulator, with the HTTP server
that its conductor publishes virtual media on: ``Ironic.files``). The helpers here talk to Ironic's REST API with
requests, past the code under test, to set nodes up and to look at what Shepherd did.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import functools
import gzip
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import requests

from tests.sshd_fixtures import free_port

BIN = Path(sys.executable).parent
START_TIMEOUT = 60.0
MICROVERSION = {"X-OpenStack-Ironic-API-Version": "1.56"}
# A direct deploy of a fake-hardware node waits for an agent that never calls back: it fails after this long.
CALLBACK_TIMEOUT = 2

# The known-good standalone configuration; every *_interfaces list is set, or Ironic loads the ipmitool vendor
# interface and refuses to start without the ipmitool binary. A node enrolled with inspect_interface = agent is
# inspected as Ironic's in-band inspection does it; its boot is left to a PXE environment of the site's
# (require_managed_boot = false), since a fake-hardware node's boot interface boots no ramdisk.
CONFIG = """\
[DEFAULT]
auth_strategy = {auth_strategy}
{basic_auth}
enabled_hardware_types = fake-hardware,redfish
enabled_power_interfaces = fake,redfish
enabled_management_interfaces = fake,redfish
enabled_deploy_interfaces = fake,ramdisk,direct
enabled_boot_interfaces = fake,redfish-virtual-media
enabled_network_interfaces = noop
enabled_inspect_interfaces = no-inspect,fake,redfish,agent
enabled_vendor_interfaces = no-vendor,fake,redfish
enabled_console_interfaces = no-console,fake
enabled_raid_interfaces = no-raid,fake
enabled_bios_interfaces = no-bios,fake,redfish
enabled_rescue_interfaces = no-rescue,fake
enabled_firmware_interfaces = no-firmware,fake,redfish
rpc_transport = none
host = localhost
use_stderr = true
[api]
host_ip = 127.0.0.1
port = {port}
[database]
connection = sqlite:///{state}/ironic.sqlite
[dhcp]
dhcp_provider = none
[conductor]
automated_clean = false
deploy_callback_timeout = {callback_timeout}
check_provision_state_interval = 1
sync_power_state_interval = -1
[inspector]
require_managed_boot = false
[deploy]
http_url = {files_url}
http_root = {state}/httpboot
[oslo_concurrency]
lock_path = {state}/locks
"""


@dataclass
class FileServer:
    """The HTTP server of Ironic's conductor ([deploy] http_url, serving http_root): Python's http.server on loopback.
    Ironic publishes there what a BMC downloads for virtual media (a node's config drive); a test puts there what its
    nodes boot (a boot ISO)."""

    root: Path
    url: str
    log: Path  # a line for every request
    process: subprocess.Popen[bytes]

    def downloads(self, path: str) -> int:
        """How many times path (such as /boot.iso) was downloaded."""
        return self.log.read_text(errors="replace").count(f'"GET {path} HTTP/')


@dataclass
class Ironic:
    url: str  # the API's root, without /v1
    state: Path  # its SQLite database and locks
    log: Path
    process: subprocess.Popen[bytes]
    auth: tuple[str, str] | None = None  # HTTP basic credentials, when it asks for them
    files: FileServer | None = None  # its HTTP server, for what BMCs download

    def api(self, method: str, path: str, body: Any = None, *, ok: tuple[int, ...] = (200, 201, 202, 204)) -> Any:
        """One call to the API, past the code under test; its JSON answer."""
        answer = requests.request(
            method, f"{self.url}/v1{path}", json=body, headers=MICROVERSION, auth=self.auth, timeout=30
        )
        if answer.status_code not in ok:
            raise AssertionError(f"{method} {path}: HTTP {answer.status_code}: {answer.text[:300]}")
        return answer.json() if answer.content else None

    def node(self, node_id: str) -> dict[str, Any]:
        """The node as Ironic holds it."""
        return dict(self.api("GET", f"/nodes/{node_id}"))

    def wait_for(self, node_id: str, state: str, timeout: float = 30.0) -> dict[str, Any]:
        """The node once it reached the provision state; AssertionError with its last state after timeout."""
        deadline = time.monotonic() + timeout
        while True:
            node = self.node(node_id)
            # A failed state keeps the target it failed to reach.
            settled = node.get("target_provision_state") is None or state.endswith("failed")
            if node["provision_state"] == state and settled:
                return node
            if time.monotonic() > deadline:
                raise AssertionError(f"node {node_id} is {node['provision_state']}, not {state}: {node['last_error']}")
            time.sleep(0.2)

    def enroll(self, *, state: str = "available", **fields: Any) -> str:
        """A new node taken to state (enroll, manageable or available); its UUID."""
        owner = fields.pop("owner", None)
        body = {"driver": "fake-hardware", **fields}
        node_id = str(self.api("POST", "/nodes", body)["uuid"])
        if owner is not None:
            # Ironic takes an owner only as a change: a create with one is refused to a project-less admin.
            self.api("PATCH", f"/nodes/{node_id}", [{"op": "add", "path": "/owner", "value": owner}])
        if state == "enroll":
            return node_id
        self.api("PUT", f"/nodes/{node_id}/states/provision", {"target": "manage"})
        self.wait_for(node_id, "manageable")
        if state == "available":
            self.api("PUT", f"/nodes/{node_id}/states/provision", {"target": "provide"})
            self.wait_for(node_id, "available")
        return node_id

    def inspect(self, node_id: str, inventory: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        """Inspect a manageable node (inspect_interface agent) through Ironic's own inspection: Ironic starts it and
        waits in inspect wait; the inventory is posted to /v1/continue_inspection as the ramdisk's agent posts what it
        found, standing in for the machine; Ironic's hooks process and store it. The node once it is manageable."""
        self.api("PUT", f"/nodes/{node_id}/states/provision", {"target": "inspect"})
        deadline = time.monotonic() + timeout
        while self.node(node_id)["provision_state"] != "inspect wait":
            if time.monotonic() > deadline:
                raise AssertionError(f"node {node_id} never waited for its inspection: {self.node(node_id)}")
            time.sleep(0.1)
        while True:
            answer = requests.post(
                f"{self.url}/v1/continue_inspection",
                params={"node_uuid": node_id},
                json={"inventory": inventory},
                headers={"X-OpenStack-Ironic-API-Version": "1.84"},
                auth=self.auth,
                timeout=30,
            )
            # The conductor may still hold the node's lock from entering inspect wait: Ironic asks to retry, as the
            # ramdisk's agent does.
            if answer.status_code != 409 or "is locked" not in answer.text or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if answer.status_code != 202:
            raise AssertionError(f"continue_inspection: HTTP {answer.status_code}: {answer.text[:300]}")
        while (node := self.node(node_id))["provision_state"] in ("inspect wait", "inspecting"):
            if time.monotonic() > deadline:
                raise AssertionError(f"node {node_id} is still {node['provision_state']}")
            time.sleep(0.1)
        if node["provision_state"] != "manageable":
            raise AssertionError(
                f"node {node_id} is {node['provision_state']} after its inspection: {node['last_error']}"
            )
        return node

    def deploy_as_someone_else(self, node_id: str) -> str:
        """Claim and deploy the node as another user of Ironic would (a Nova instance, say); its instance UUID."""
        instance = str(uuid.uuid4())
        patch = [
            {"op": "add", "path": "/instance_uuid", "value": instance},
            {"op": "add", "path": "/instance_info/image_source", "value": "http://127.0.0.1:9/theirs.qcow2"},
        ]
        self.api("PATCH", f"/nodes/{node_id}", patch)
        self.api("PUT", f"/nodes/{node_id}/states/provision", {"target": "active"})
        self.wait_for(node_id, "active")
        return instance

    def config_drive(self, node_id: str) -> bytes:
        """The config drive Ironic built for the node's deploy, read from its database: the API masks it."""
        with contextlib.closing(sqlite3.connect(self.state / "ironic.sqlite")) as database:
            row = database.execute("SELECT instance_info FROM nodes WHERE uuid = ?", (node_id,)).fetchone()
        drive = json.loads(row[0])["configdrive"]
        # Given as JSON, Ironic keeps it so and builds the ISO at deploy time; given as an ISO, it keeps that.
        return json.dumps(drive).encode() if isinstance(drive, dict) else gzip.decompress(base64.b64decode(drive))

    def requests_logged(self, text: str) -> int:
        """How many lines of Ironic's log mention text: a request, a state change."""
        return self.log.read_text(errors="replace").count(text)


@contextlib.contextmanager
def running_ironic(
    directory: Path, *, basic_auth: tuple[str, str] | None = None, port: int | None = None
) -> Iterator[Ironic]:
    """An Ironic on a free loopback port (or port) with its state in directory, kept from an earlier run there, and
    the HTTP server its conductor publishes virtual media on; with basic_auth, it asks for that user."""
    (directory / "locks").mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    files_port = free_port()
    settings = ""
    if basic_auth is not None:
        users = directory / "htpasswd"
        hashed = bcrypt.hashpw(basic_auth[1].encode(), bcrypt.gensalt(rounds=4)).decode()
        users.write_text(f"{basic_auth[0]}:{hashed}\n")
        settings = f"http_basic_auth_user_file = {users}"
    config = directory / "ironic.conf"
    config.write_text(
        CONFIG.format(
            auth_strategy="http_basic" if basic_auth else "noauth",
            basic_auth=settings,
            port=port,
            state=directory,
            callback_timeout=CALLBACK_TIMEOUT,
            files_url=f"http://127.0.0.1:{files_port}",
        )
    )
    if not (directory / "ironic.sqlite").exists():
        shutil.copyfile(_empty_database(), directory / "ironic.sqlite")
    files = serving_files(directory / "httpboot", files_port)
    log = directory / "ironic.log"
    with log.open("ab") as output:
        # A session of its own: its conductor and API are forked workers, stopped with it as one group.
        command = [str(BIN / "ironic"), "--config-file", str(config)]
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    ironic = Ironic(f"http://127.0.0.1:{port}", directory, log, process, basic_auth, files)
    try:
        wait_until_answering(ironic)
        yield ironic
    finally:
        files.process.terminate()
        files.process.wait()
        # Killed, not asked to stop: Ironic's graceful stop takes seconds a test need not wait, and its state is
        # SQLite's, whole after every commit, as after a power loss of its host.
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@functools.cache
def _empty_database() -> Path:
    """Ironic's SQLite database with its schema and no node, made once a process by ironic-dbsync; every Ironic
    started afresh gets a copy."""
    directory = Path(tempfile.mkdtemp(prefix="ironic-schema-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    config = directory / "ironic.conf"
    config.write_text(f"[database]\nconnection = sqlite:///{directory}/ironic.sqlite\n")
    create_schema = [str(BIN / "ironic-dbsync"), "--config-file", str(config), "create_schema"]
    subprocess.run(create_schema, check=True, capture_output=True, timeout=120)
    return directory / "ironic.sqlite"


def serving_files(root: Path, port: int) -> FileServer:
    """Python's http.server serving root on the loopback port, started; RuntimeError with its log if it does not
    answer."""
    root.mkdir(exist_ok=True)
    log = root.parent / "httpboot.log"
    with log.open("ab") as output:
        command = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--directory", str(root), str(port)]
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    files = FileServer(root, f"http://127.0.0.1:{port}", log, process)
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            requests.head(files.url, timeout=2)
            return files
        except requests.RequestException:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"http.server did not answer at {files.url}: {log.read_text()[-3000:]}")
        time.sleep(0.05)


def wait_until_answering(ironic: Ironic) -> None:
    """Return once the API answers a node listing; RuntimeError with Ironic's log if it died or took too long."""
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            answer = requests.get(f"{ironic.url}/v1/nodes", headers=MICROVERSION, auth=ironic.auth, timeout=2)
            if answer.ok:
                return
        except requests.RequestException:
            pass
        if ironic.process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"Ironic did not answer at {ironic.url}: {ironic.log.read_text()[-3000:]}")
        time.sleep(0.2)


# A module's own: every module that imports the fixture gets an Ironic of its own anyway, and an idle one still
# polls its nodes every second, so each stops once its module is over.
@pytest.fixture(scope="module", name="ironic")
def ironic_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ironic]:
    with running_ironic(tmp_path_factory.mktemp("ironic")) as ironic:
        yield ironic
