"""The Temporal checks: the connection in effect, the namespace, the search attributes, the workers polling each
task queue, each fleet schedule and the server's clock."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial

from temporalio.api.enums.v1 import NamespaceState, TaskQueueKind, TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest, DescribeTaskQueueRequest, GetSystemInfoRequest
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from foundation.settings import Settings
from foundation.startup import (
    StartupError,
    connect_temporal,
    missing_search_attributes,
    search_attributes_missing,
)
from foundation.temporal_connection import TemporalConfigError, load_temporal_connection
from lifecycle.contracts import SEARCH_ATTRIBUTES, machine_task_queue, provider_task_queue
from operations.client import OperatorClient
from operations.fleet_control import FleetError
from shepherd.commands.doctor_checks.checkup import Checkup
from shepherd.commands.doctor_checks.clocks import ClockReading, clock_verdict
from shepherd.commands.doctor_checks.verdicts import Verdict, fail, ok, plural, warn
from shepherd.commands.fleet import schedule_line
from shepherd.commands.machines import age

# The workflow doctor starts to read the Temporal server's clock: on a task queue no worker polls, so it never
# runs, terminated as soon as its start time is read, and closed by its timeout should the termination fail.
CLOCK_PROBE_WORKFLOW = "ShepherdDoctorClockProbe"
CLOCK_PROBE_TASK_QUEUE = "shepherd-doctor-clock-probe"
CLOCK_PROBE_TIMEOUT = timedelta(minutes=1)
# A worker polls again as soon as a poll ends, and the server ends one that found no task after a minute: a poller
# unseen for two minutes has stopped, or (for activities) has no free slot to poll with. The server goes on listing
# it until five minutes after its last poll.
POLLER_GONE_AFTER = timedelta(minutes=2)
# Identities named in a line, the latest first; --json lists every one.
POLLERS_SHOWN = 3
TASK_QUEUE_TYPES = {
    "workflow": TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
    "activity": TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
}


def _source(part: str, source: str) -> str:
    return f"{part}: the default" if source == "default" else f"{part} from {source}"


@dataclass(frozen=True)
class Poller:
    """A worker Temporal lists as polling a task queue: its identity (pid@host unless set) and its last poll."""

    identity: str
    last_poll: datetime


async def task_queue_pollers(client: Client, task_queue: str, kind: str) -> list[Poller]:
    """The workers Temporal lists as polling task_queue for tasks of kind ("workflow" or "activity"), latest first."""
    described = await client.workflow_service.describe_task_queue(
        DescribeTaskQueueRequest(
            namespace=client.namespace,
            task_queue=TaskQueue(name=task_queue, kind=TaskQueueKind.TASK_QUEUE_KIND_NORMAL),
            task_queue_type=TASK_QUEUE_TYPES[kind],
        )
    )
    pollers = [Poller(poller.identity, poller.last_access_time.ToDatetime(UTC)) for poller in described.pollers]
    return sorted(pollers, key=lambda poller: poller.last_poll, reverse=True)


def worker_task_queues(settings: Settings) -> list[tuple[str, str, str]]:
    """(check, task queue, kind of task) of every queue Shepherd's workers poll, as build_workers lays them out: the
    workflows on task_queue, and each provider instance's activities on a queue of its own and its SSH work on
    another."""
    queue = settings.task_queue
    checks = [("workers", queue, "workflow")]
    for instance in settings.provider_instances:
        checks.append((f"workers {instance.name}", provider_task_queue(queue, instance.name), "activity"))
        checks.append((f"workers {instance.name} machines", machine_task_queue(queue, instance.name), "activity"))
    return checks


def shown_identities(pollers: Sequence[Poller]) -> str:
    """'a@h1, b@h2, c@h3 and 2 more': a line stays readable however many workers poll."""
    named = ", ".join(poller.identity for poller in pollers[:POLLERS_SHOWN])
    more = len(pollers) - POLLERS_SHOWN
    return f"{named} and {more} more" if more > 0 else named


class TemporalChecks(Checkup):
    """The checks of Temporal, in the order they depend on each other."""

    async def temporal_checks(self) -> None:
        """Check Temporal: the connection first, then what needs its namespace."""
        await self.check("temporal", self.temporal)
        await self.check("temporal namespace", self.namespace, needs=["temporal"])
        await self.check("search attributes", self.search_attributes, needs=["temporal namespace"])
        for name, task_queue, kind in worker_task_queues(self.settings):
            await self.check(name, partial(self.workers, task_queue, kind), needs=["temporal namespace"])
        for instance in self.settings.provider_instances:
            await self.check(f"fleet {instance.name}", partial(self.fleet, instance.name), needs=["temporal namespace"])
        await self.check("temporal clock", self.temporal_clock, needs=["temporal namespace"])

    async def temporal(self) -> Verdict:
        """Whether Temporal answers at the address in effect, over TLS or not; its client serves the next checks."""
        try:
            connection = load_temporal_connection(self.settings, self.environ)
        except TemporalConfigError as error:
            fail(str(error))
        try:
            client = await connect_temporal(self.settings, environ=self.environ)
        except StartupError as error:
            fail(str(error), address=connection.address)
        self.connection, self.client = connection, client
        info = await client.workflow_service.get_system_info(GetSystemInfoRequest())
        over = "TLS" if connection.uses_tls else "plain text"
        where = _source("address", connection.source("address"))
        if self.embedded is not None:
            where += f"; the embedded stack of `shepherd dev` in {self.embedded}"
        return ok(
            f"reachable at {connection.address} over {over} ({where}), server {info.server_version or 'unknown'}",
            address=connection.address,
            address_source=connection.source("address"),
            tls=connection.uses_tls,
            server_version=info.server_version,
        )

    async def namespace(self) -> Verdict:
        """Whether the namespace exists and takes new workflows, and its retention."""
        assert self.client is not None and self.connection is not None
        namespace, where = self.connection.namespace, _source("namespace", self.connection.source("namespace"))
        try:
            described = await self.client.workflow_service.describe_namespace(
                DescribeNamespaceRequest(namespace=namespace)
            )
        except RPCError as error:
            if error.status == RPCStatusCode.NOT_FOUND:
                fail(
                    f"{namespace!r} does not exist at {self.connection.address} ({where}): create it with `temporal "
                    f"operator namespace create --namespace {namespace}`, or name another (TEMPORAL_NAMESPACE)",
                    namespace=namespace,
                )
            fail(f"cannot describe namespace {namespace!r} ({where}): {error.message}", namespace=namespace)
        state = described.namespace_info.state
        retention = described.config.workflow_execution_retention_ttl.ToTimedelta()
        facts = {"namespace": namespace, "retention_seconds": retention.total_seconds()}
        if state == NamespaceState.NAMESPACE_STATE_DELETED:
            fail(f"{namespace!r} is being deleted ({where})", **facts)
        days = retention.total_seconds() / 86400
        kept = plural(int(days), "day") if days.is_integer() else f"{retention.total_seconds() / 3600:g}h"
        detail = f"{namespace} ({where}), retention {kept}"
        if state == NamespaceState.NAMESPACE_STATE_DEPRECATED:
            return warn(f"{detail}: deprecated, so it takes no new workflows", **facts)
        return ok(detail, **facts)

    async def search_attributes(self) -> Verdict:
        """Whether the namespace has Shepherd's search attributes."""
        assert self.client is not None and self.connection is not None
        namespace = self.connection.namespace
        names = [key.name for key in SEARCH_ATTRIBUTES]
        try:
            missing = await missing_search_attributes(self.client, namespace, SEARCH_ATTRIBUTES)
        except StartupError as error:
            fail(str(error))
        if missing:
            fail(search_attributes_missing(namespace, missing), missing=missing)
        return ok(f"{', '.join(names)} registered in {namespace}", missing=[])

    async def workers(self, task_queue: str, kind: str) -> Verdict:
        """Whether workers poll the task queue for tasks of that kind."""
        assert self.client is not None
        pollers = await task_queue_pollers(self.client, task_queue, kind)
        now = datetime.now(UTC)
        polling = [poller for poller in pollers if now - poller.last_poll <= POLLER_GONE_AFTER]
        gone = [poller for poller in pollers if poller not in polling]
        facts = {
            "task_queue": task_queue,
            "kind": kind,
            "pollers": [poller.identity for poller in polling],
            "gone": [poller.identity for poller in gone],
        }
        start = "start `shepherd worker`"
        if not pollers:
            fail(f"no worker polls task queue {task_queue}: {start}", **facts)
        last = f"last poll {age(pollers[0].last_poll, now)} ago"
        if not polling:
            by = f"{last}, by {shown_identities(gone)}"
            if kind == "activity":
                # A worker whose activity slots are all taken does not poll until one frees: busy, not gone.
                return warn(
                    f"no poll of task queue {task_queue} for a while ({by}): its workers are stopped, or busy in "
                    f"every activity slot (max_concurrent_activities); if stopped, {start}",
                    **facts,
                )
            fail(f"no worker polls task queue {task_queue} ({by}): {start}", **facts)
        polled = f"{plural(len(polling), 'poller')} of {kind} tasks on task queue {task_queue}"
        return ok(f"{polled}: {shown_identities(polling)}; {last}", **facts)

    async def fleet(self, provider: str) -> Verdict:
        """The provider instance's fleet schedule and its last pass."""
        assert self.client is not None
        operators = OperatorClient(self.settings, temporal=self.client)
        try:
            line, facts = await schedule_line(operators, provider)
        except FleetError as error:
            fail(str(error), schedule_id=None)
        passes = await operators.last_passes(provider, 1)
        if not passes:
            last = "no passes yet"
            facts["last_pass"] = None
        else:
            newest = passes[0]
            started = newest.started_at.strftime("%Y-%m-%d %H:%M:%S UTC") if newest.started_at else "-"
            last = f"last pass {started}: {newest.outcome}" + (f" ({newest.why})" if newest.why else "")
            facts["last_pass"] = {
                "started_at": newest.started_at.isoformat() if newest.started_at else None,
                "outcome": newest.outcome,
                "why": newest.why,
            }
        detail = f"{line.removeprefix('schedule ')}; {last}"
        if facts["paused"]:
            return warn(f"{detail}: no passes until `shepherd fleet --resume`", **facts)
        if passes and passes[0].outcome not in ("completed", "running"):
            return warn(f"{detail}: see `shepherd fleet --provider {provider}`", **facts)
        return ok(detail, **facts)

    async def temporal_clock(self) -> Verdict:
        """How far the Temporal server's clock is from this host's."""
        assert self.client is not None
        before = time.time()
        handle = await self.client.start_workflow(
            CLOCK_PROBE_WORKFLOW,
            id=f"shepherd-doctor-clock-{uuid.uuid4().hex[:12]}",
            task_queue=CLOCK_PROBE_TASK_QUEUE,
            execution_timeout=CLOCK_PROBE_TIMEOUT,
            static_summary="shepherd doctor: reads the server's clock; never runs, terminated at once",
        )
        after = time.time()
        try:
            described = await handle.describe()
        finally:
            with suppress(RPCError):
                await handle.terminate(reason="shepherd doctor: the clock was read")
        assert described.start_time is not None
        how = "the start time the server gave a workflow doctor started and terminated"
        return clock_verdict("Temporal's", ClockReading(before, described.start_time, after), how)
