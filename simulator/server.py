"""The simulator: an HTTP provider API over a fleet of simulated machines."""

from __future__ import annotations

import asyncio
import logging
import random
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import asyncssh
from aiohttp import web
from temporalio.common import MetricMeter

from simulator.machine import SimulatedMachine
from simulator.state import FleetState, MachineRecord, SimulatorConfig, StateFiles

log = logging.getLogger("simulator")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def _json_object(request: web.Request) -> dict[str, Any] | web.Response:
    """The request's body, a JSON object, or the 400 answer that says what it is instead."""
    try:
        body = await request.json()
    except ValueError:  # not JSON, or not UTF-8
        return _error(400, "the body is not JSON")
    if not isinstance(body, dict):
        return _error(400, "the body must be a JSON object")
    return body


def _public_key_problem(key: Any) -> str | None:
    """What makes field ssh_public_key unusable as root's key on a machine, or None for one OpenSSH public key line."""
    if not isinstance(key, str) or not key:
        return "field ssh_public_key must be a non-empty string"
    try:
        imported = asyncssh.import_public_key(key)
    except asyncssh.KeyImportError:
        return "field ssh_public_key is not an OpenSSH public key"
    # asyncssh reads PEM, RFC 4716 and private keys too, and the first of several lines, but a machine compares a
    # login's key with the type and base64 of the line it was given: any other form would lock root out.
    one_line = len(key.strip().splitlines()) == 1
    if not one_line or imported.export_public_key("openssh").split()[:2] != key.encode().split()[:2]:
        return "field ssh_public_key must be one OpenSSH public key line (type, base64, comment)"
    return None


def _new_host_key() -> str:
    """A new private host key for a machine's SSH server, in OpenSSH form."""
    return asyncssh.generate_private_key("ssh-ed25519").export_private_key("openssh").decode()


class Simulator:
    """The simulator: provider and admin HTTP APIs over its capacity slots, and an SSH server per created machine."""

    def __init__(self, config: SimulatorConfig, meter: MetricMeter = MetricMeter.noop) -> None:
        self.config = config.check()
        self._api_requests = meter.create_counter(
            "shepherd_sim_api_requests_total", "Provider API requests, by method, route and status"
        )
        self._machines_gauge = meter.create_gauge("shepherd_sim_machines", "Simulated machines, by status")
        self._reboots = meter.create_counter("shepherd_sim_reboots_total", "Reboots asked for through the API")
        # Reboots of each machine since the simulator started, for /admin/state: a machine rebooted twice shows.
        self.reboots: dict[str, int] = {}
        self._reimages = meter.create_counter(
            "shepherd_sim_reimages_total", "Reimages done through the API, repeats of one under way not counted"
        )
        self._agent_kills = meter.create_counter(
            "shepherd_sim_agent_kills_total", "Agents killed through the admin API"
        )
        self.faults = config.faults
        self.slots = config.slot_ids()
        # A slot's place, for its location: a listing of 100,000 slots must not search the list for each.
        self._slot_index = {slot: index for index, slot in enumerate(self.slots)}
        self.state_files = StateFiles(config.state_dir / "sim-state.json")
        self.state = FleetState()
        self.machines: dict[str, SimulatedMachine] = {}
        self.random = random.Random()
        self._runner: web.AppRunner | None = None
        self._port = config.api_port
        # One change of the fleet's records at a time: a creation, a reimage or a release.
        self._change_lock = asyncio.Lock()

    @property
    def api_url(self) -> str:
        """The URL of the simulator's HTTP API, with the port it listens on."""
        return f"http://{self.config.api_host}:{self._port}"

    async def start(self) -> None:
        """Load the fleet, bring up its machines' SSH servers and serve the HTTP APIs."""
        self.config.state_dir.mkdir(parents=True, exist_ok=True)
        self.state = self.state_files.load()
        for record in self.state.machines.values():
            await self._bring_up(record)
        # The machines' ports as they came up, and the journal folded into the snapshot.
        self.state_files.save(self.state)
        app = web.Application(middlewares=[self._metrics_middleware, self._fault_middleware])
        app.add_routes(
            [
                web.get("/healthz", self._healthz),
                web.get("/v1/machines", self._list),
                web.post("/v1/machines", self._create),
                web.get("/v1/machines/{id}", self._get),
                web.post("/v1/machines/{id}/reboot", self._reboot),
                web.post("/v1/machines/{id}/reimage", self._reimage),
                web.delete("/v1/machines/{id}", self._release),
                web.get("/admin/state", self._admin_state),
                web.post("/admin/faults", self._admin_faults),
                web.post("/admin/machines/{id}/kill-agent", self._admin_kill_agent),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.api_host, self.config.api_port)
        await site.start()
        self._port = self._runner.addresses[0][1]
        log.info("simulator API on %s with %d slots, %d machines", self.api_url, len(self.slots), len(self.machines))

    async def stop(self) -> None:
        """Stop serving the HTTP APIs and shut every machine down."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for machine in self.machines.values():
            await machine.shutdown()
        self.machines.clear()

    async def _bring_up(self, record: MachineRecord) -> SimulatedMachine:
        machine = SimulatedMachine(
            record.machine_id,
            self.config.state_dir / "machines" / record.machine_id,
            record.host_key,
            record.ssh_public_key,
            self.config.ssh_host,
            record.ssh_port,
            exec_delay=lambda: self.faults.exec_delay,
        )
        # Bind first so the machine has its port even while it refuses SSH.
        await machine.start_ssh()
        record.ssh_port = machine.ssh_port
        if self.faults.refuses(record.machine_id):
            await machine.stop_ssh()
        self.machines[record.machine_id] = machine
        return machine

    def view(self, slot: str) -> dict[str, Any]:
        """The slot as the provider API shows it: free capacity, or the machine created in it."""
        machine = self.machines.get(slot)
        index = self._slot_index[slot]
        location = f"sim-rack-{index // 10 + 1}"
        if machine is None:
            return {
                "id": slot,
                "availability": "KnownUnused",
                "address": None,
                "ssh_port": None,
                "location": location,
                "status": "capacity",
            }
        return {
            "id": slot,
            "availability": "KnownUsed",
            "address": self.config.ssh_host,
            "ssh_port": machine.ssh_port,
            "location": location,
            "status": machine.status,
            "last_reset_at": machine.last_reset_at.isoformat() if machine.last_reset_at else None,
        }

    async def apply_faults(self, changes: dict[str, Any]) -> None:
        """Change the fault knobs, then stop or start each machine's SSH server as the refusals now say."""
        self.faults = self.faults.updated(changes)
        for machine in self.machines.values():
            if self.faults.refuses(machine.machine_id):
                await machine.stop_ssh()
            elif machine.status == "active" and not machine.listening:
                await machine.start_ssh()

    # --- HTTP ---------------------------------------------------------------

    @web.middleware
    async def _metrics_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as error:
            status = error.status
            raise
        finally:
            resource = request.match_info.route.resource
            route = resource.canonical if resource is not None else "unknown"
            self._api_requests.add(1, {"method": request.method, "route": route, "status": str(status)})
            for machine_status in ("active", "rebooting", "reimaging"):
                count = sum(1 for m in self.machines.values() if m.status == machine_status)
                self._machines_gauge.set(count, {"status": machine_status})

    @web.middleware
    async def _fault_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v1/"):
            log.info("%s %s", request.method, request.path)
            if self.faults.api_latency:
                await asyncio.sleep(self.faults.api_latency)
            if self.random.random() < self.faults.api_error_rate:
                return _error(503, "simulated provider outage")
            if self.random.random() < self.faults.api_malformed_rate:
                return web.Response(status=200, text="<html>simulated garbage</html>", content_type="text/html")
        return await handler(request)

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _list(self, request: web.Request) -> web.Response:
        return web.json_response({"machines": [self.view(slot) for slot in self.slots]})

    async def _get(self, request: web.Request) -> web.Response:
        slot = request.match_info["id"]
        if slot not in self._slot_index:
            return _error(404, f"no machine {slot}")
        return web.json_response(self.view(slot))

    async def _create(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        if isinstance(body, web.Response):
            return body
        for name in ("capacity_id", "idempotency_key"):
            if not isinstance(body.get(name), str) or not body[name]:
                return _error(400, f"field {name} must be a non-empty string")
        if problem := _public_key_problem(body.get("ssh_public_key")):
            return _error(400, problem)
        slot, key, public_key = body["capacity_id"], body["idempotency_key"], body["ssh_public_key"]
        async with self._change_lock:
            existing = self.state.by_idempotency_key(key)
            if existing is not None:
                if existing.machine_id != slot:
                    return _error(409, f"idempotency key {key} was used for {existing.machine_id}, not {slot}")
                return web.json_response(self.view(slot), status=200)
            if slot not in self._slot_index:
                return _error(404, f"no capacity slot {slot}")
            if slot in self.state.machines:
                return _error(409, f"capacity slot {slot} is already in use by another request")
            record = MachineRecord(slot, key, public_key, _new_host_key())
            await self._bring_up(record)
            # On disk before the answer: a machine answered as created outlives a crash of the simulator.
            self.state_files.append(self.state, self.state.create(record))
        log.info("created machine %s (idempotency key %s)", slot, key)
        return web.json_response(self.view(slot), status=201)

    async def _reboot(self, request: web.Request) -> web.Response:
        slot = request.match_info["id"]
        machine = self.machines.get(slot)
        if machine is None:
            return _error(404, f"no machine {slot}")
        self._reboots.add(1)
        self.reboots[slot] = self.reboots.get(slot, 0) + 1
        await machine.reboot(self.config.boot_seconds, lambda: self.faults.refuses(slot))
        if self.faults.reboot_answer_delay:
            await asyncio.sleep(self.faults.reboot_answer_delay)
        return web.json_response(self.view(slot), status=202)

    async def _reimage(self, request: web.Request) -> web.Response:
        """Reimage a machine: a reboot onto a fresh disk, with a new host key and the body's ssh_public_key for root.

        Answered once SSH is down for the boot, as a reboot is. Asked again while that boot is under way, with the
        same key, it does nothing more: the Reimager contract has a repeat start no second reimage.
        """
        slot = request.match_info["id"]
        if slot not in self.machines:
            return _error(404, f"no machine {slot}")
        body = await _json_object(request)
        if isinstance(body, web.Response):
            return body
        if problem := _public_key_problem(body.get("ssh_public_key")):
            return _error(400, problem)
        public_key: str = body["ssh_public_key"]
        async with self._change_lock:
            machine = self.machines.get(slot)
            if machine is None:  # released while the body was read
                return _error(404, f"no machine {slot}")
            record = self.state.machines[slot]
            if machine.status == "reimaging":
                if record.ssh_public_key.split()[:2] != public_key.split()[:2]:
                    return _error(409, f"machine {slot} is being reimaged with another key; ask again once it is up")
                return web.json_response(self.view(slot), status=202)
            record = replace(record, ssh_public_key=public_key, host_key=_new_host_key())
            await machine.reimage(
                record.host_key, public_key, self.config.boot_seconds, lambda: self.faults.refuses(slot)
            )
            self._reimages.add(1)
            # On disk before the answer: the new keys are the machine's after a restart of the simulator.
            self.state_files.append(self.state, self.state.reimage(record))
        log.info("reimaged machine %s: a fresh disk and a new host key, booting", slot)
        return web.json_response(self.view(slot), status=202)

    async def _release(self, request: web.Request) -> web.Response:
        """Take a machine back: it goes down, its disk is wiped, and its slot is free capacity again."""
        slot = request.match_info["id"]
        async with self._change_lock:
            machine = self.machines.pop(slot, None)
            if machine is None:
                return _error(404, f"no machine {slot}")
            await machine.shutdown()
            shutil.rmtree(machine.root_fs.parent, ignore_errors=True)
            self.state_files.append(self.state, self.state.release(slot))
        log.info("released machine %s: its slot is free capacity again", slot)
        return web.json_response(self.view(slot), status=200)

    async def _admin_state(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "slots": len(self.slots),
                "machines": sorted(self.state.machines),
                "creations": self.state.creations,
                "reimages": self.state.reimages,
                "reboots": self.reboots,
                "idempotency_keys": sorted(m.idempotency_key for m in self.state.machines.values()),
                "faults": {**self.faults.__dict__},
            }
        )

    async def _admin_kill_agent(self, request: web.Request) -> web.Response:
        """Kill what runs on the machine without rebooting it: an agent that died."""
        machine = self.machines.get(request.match_info["id"])
        if machine is None:
            return _error(404, f"no machine {request.match_info['id']}")
        killed = machine.kill_processes()
        self._agent_kills.add(killed)
        return web.json_response({"killed": killed})

    async def _admin_faults(self, request: web.Request) -> web.Response:
        try:
            await self.apply_faults(await request.json())
        except (ValueError, TypeError, AttributeError) as error:
            return _error(400, str(error))
        return web.json_response({**self.faults.__dict__})
