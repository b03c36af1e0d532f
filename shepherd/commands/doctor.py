"""``shepherd doctor``: what an operator runs first when something is wrong, one line a check.

Temporal (the connection in effect, the namespace, the search attributes, the workers polling each task queue,
each fleet schedule, the server's clock), BMDB (reachable, schema, clock), the heartbeat endpoint as the agents
see it (TLS with their CA, the certificate's expiry), the SSH key, the agent executable and every provider
instance. Each check has a time limit, so doctor never hangs; a check that needs another is skipped, naming it,
when that one failed. Exit 1 when any check failed; warnings do not fail.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import ssl
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from functools import partial
from pathlib import Path
from typing import Any, NoReturn, TextIO

from cryptography import x509
from cryptography.x509.oid import NameOID
from temporalio.api.enums.v1 import NamespaceState, TaskQueueKind, TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest, DescribeTaskQueueRequest, GetSystemInfoRequest
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from bmdb.local_postgres import LocalPostgres
from bmdb.migrate import head_revision, schema_problem, schema_revision
from bmdb.store import BMDB, BMDBUnavailable
from foundation.executables import NotAnExecutable, read_agent_executable
from foundation.provider_instances import ProviderInstance
from foundation.setting_values import SettingsError, parse_endpoint
from foundation.settings import Settings
from foundation.settings_report import redact_url
from foundation.ssh_identity import SSHIdentityError, load_ssh_key
from foundation.startup import (
    StartupError,
    connect_temporal,
    missing_search_attributes,
    search_attributes_missing,
)
from foundation.temporal_connection import TemporalConfigError, TemporalConnection, load_temporal_connection
from foundation.tls import days_left, load_ca_certificates
from lifecycle.contracts import SEARCH_ATTRIBUTES, provider_task_queue
from operations.client import OperatorClient
from operations.fleet_control import FleetError
from providers import Availability, ProviderError
from providers.registry import open_provider
from shepherd.commands.base import EXIT_FAILURE, EXIT_OK, Subcommands, add_common, duration_arg
from shepherd.commands.dev import DevOptions, dev_settings, embedded_environment
from shepherd.commands.fleet import schedule_line
from shepherd.commands.machines import age

# Each check's time limit unless --timeout says otherwise: longer than any healthy answer, short enough to wait.
DEFAULT_TIMEOUT = 10.0
# A certificate closer than this to its end is a warning: time to renew before the agents are locked out.
CERTIFICATE_WARN_DAYS = 30
# Clocks kept by NTP agree within milliseconds; a second apart means time keeping is broken on one of them.
CLOCK_WARN_SECONDS = 1.0
# Far below what the heartbeat checks tolerate (heartbeat_max_skew, 5 minutes by default), yet clearly wrong.
CLOCK_FAIL_SECONDS = 30.0
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
# What the embedded stack keeps in its state dir, by which doctor recognizes it (shepherd dev writes both).
EMBEDDED_TEMPORAL_STATE = "temporal.db"
EMBEDDED_PROVIDERS_FILE = "dev-providers.toml"


class Status(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIPPED = "skipped"

    @property
    def shown(self) -> str:
        # A failure stands out in a column of lower-case words.
        return "FAIL" if self is Status.FAIL else self.value


@dataclass(frozen=True)
class Check:
    """One line of doctor's report: which check, how it went, what it saw, and facts for --json."""

    name: str
    status: Status
    detail: str
    facts: Mapping[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        return f"{self.status.shown:<7} {self.name}: {self.detail}"

    def document(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status.value, "detail": self.detail, **self.facts}


class Failed(Exception):
    """Raised by a probe: the check failed, for the reason in the message; facts go to --json."""

    def __init__(self, detail: str, **facts: Any) -> None:
        super().__init__(detail)
        self.facts = facts


def fail(detail: str, **facts: Any) -> NoReturn:
    raise Failed(detail, **facts)


@dataclass(frozen=True)
class Verdict:
    """What a probe found when it did not fail: ok or warn, the detail and facts."""

    status: Status
    detail: str
    facts: Mapping[str, Any] = field(default_factory=dict)


def ok(detail: str, **facts: Any) -> Verdict:
    return Verdict(Status.OK, detail, facts)


def warn(detail: str, **facts: Any) -> Verdict:
    return Verdict(Status.WARN, detail, facts)


@dataclass(frozen=True)
class ClockReading:
    """Another clock read between two readings of this host's (seconds since the epoch)."""

    before: float
    remote: datetime
    after: float

    @property
    def offset(self) -> float:
        """How far the other clock is ahead of this host's (negative: behind), from the middle of the bracket."""
        return self.remote.timestamp() - (self.before + self.after) / 2

    @property
    def uncertainty(self) -> float:
        """The other clock was read somewhere within the bracket: the offset is right to within half of it."""
        return (self.after - self.before) / 2


def clock_verdict(whose: str, reading: ClockReading, how: str) -> Verdict:
    """Ok, warn or fail by how far apart the clocks surely are: the offset less its uncertainty."""
    offset, uncertainty = reading.offset, reading.uncertainty
    facts = {"offset_seconds": round(offset, 6), "uncertainty_seconds": round(uncertainty, 6)}
    direction = "ahead of" if offset >= 0 else "behind"
    detail = f"{whose} clock is {abs(offset):.3f}s {direction} this host's (± {uncertainty:.3f}s; {how})"
    surely = abs(offset) - uncertainty
    advice = "keep both in step with NTP (chrony, systemd-timesyncd)"
    if surely > CLOCK_FAIL_SECONDS:
        fail(f"{detail}: more than {CLOCK_FAIL_SECONDS:g}s apart; {advice}", **facts)
    if surely > CLOCK_WARN_SECONDS:
        return warn(f"{detail}: more than {CLOCK_WARN_SECONDS:g}s apart; {advice}", **facts)
    if uncertainty > CLOCK_WARN_SECONDS:
        return warn(f"{detail}: the round trip was too slow to tell within {CLOCK_WARN_SECONDS:g}s", **facts)
    return ok(detail, **facts)


def _source(part: str, source: str) -> str:
    return f"{part}: the default" if source == "default" else f"{part} from {source}"


def _common_name(name: x509.Name) -> str:
    names = name.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else name.rfc4514_string()


def _certificate_names(certificate: x509.Certificate) -> list[str]:
    try:
        alternatives = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return [_common_name(certificate.subject)]
    return [str(name) for name in alternatives.get_values_for_type(x509.DNSName)] + [
        str(address) for address in alternatives.get_values_for_type(x509.IPAddress)
    ]


def _count(number: int, thing: str) -> str:
    return f"{number} {thing}" if number == 1 else f"{number} {thing}s"


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
    workflows on task_queue, and each provider instance's activities on a queue of its own."""
    queue = settings.task_queue
    return [("workers", queue, "workflow")] + [
        (f"workers {instance.name}", provider_task_queue(queue, instance.name), "activity")
        for instance in settings.provider_instances
    ]


def shown_identities(pollers: Sequence[Poller]) -> str:
    """'a@h1, b@h2, c@h3 and 2 more': a line stays readable however many workers poll."""
    named = ", ".join(poller.identity for poller in pollers[:POLLERS_SHOWN])
    more = len(pollers) - POLLERS_SHOWN
    return f"{named} and {more} more" if more > 0 else named


def _expiry(certificate: x509.Certificate) -> tuple[str, dict[str, Any]]:
    """'expires in 41 days (2027-01-04 10:00 UTC)' or 'expired 3 days ago (...)', and the facts for --json."""
    left = days_left(certificate)
    end = f"{certificate.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
    facts = {"not_after": certificate.not_valid_after_utc.isoformat(), "days_left": math.floor(left)}
    if left < 0:
        ago = math.floor(-left)
        return (f"expired {_count(ago, 'day')} ago" if ago else "expired today") + f" ({end})", facts
    return f"expires in {_count(math.floor(left), 'day')} ({end})", facts


async def _tls_handshake(host: str, port: int, context: ssl.SSLContext) -> tuple[bytes, str | None]:
    """The peer's certificate (DER) and the protocol it chose by ALPN, after a TLS handshake with context."""
    _, writer = await asyncio.open_connection(host, port, ssl=context, server_hostname=host)
    try:
        tls = writer.get_extra_info("ssl_object")
        return tls.getpeercert(binary_form=True), tls.selected_alpn_protocol()
    finally:
        writer.close()
        # A server that drops the connection without a TLS goodbye is no concern here.
        with suppress(OSError, ssl.SSLError):
            await writer.wait_closed()


def _grpc_tls_context(context: ssl.SSLContext) -> ssl.SSLContext:
    # gRPC clients, the agents among them, refuse a server that does not choose HTTP/2 by ALPN.
    context.set_alpn_protocols(["h2"])
    return context


class Doctor:
    """Runs the checks, each within the time limit, and keeps their lines in the order they are reported."""

    def __init__(
        self, settings: Settings, *, timeout: float, environ: Mapping[str, str], embedded: Path | None = None
    ) -> None:
        self.settings = settings
        self.timeout = timeout
        # Where the Temporal configuration is read from: the embedded stack ignores the operator's.
        self.environ = environ
        self.embedded = embedded
        self.checks: dict[str, Check] = {}
        self.client: Client | None = None
        self.connection: TemporalConnection | None = None
        self.bmdb: BMDB | None = None
        self.peer_certificate: bytes = b""
        self.stack = AsyncExitStack()

    async def check(self, name: str, probe: Callable[[], Awaitable[Verdict]], needs: Sequence[str] = ()) -> None:
        blocked = [need for need in needs if self.checks[need].status in (Status.FAIL, Status.SKIPPED)]
        if blocked:
            failed = list(dict.fromkeys(root for need in blocked for root in self._failed_roots(need)))
            why = f"needs {', '.join(blocked)}"
            why += ", which failed" if failed == blocked else f"; {', '.join(failed)} failed"
            self.checks[name] = Check(name, Status.SKIPPED, why, {"needs": blocked, "failed": failed})
            return
        try:
            verdict = await asyncio.wait_for(probe(), self.timeout)
        except Failed as failure:
            self.checks[name] = Check(name, Status.FAIL, str(failure), failure.facts)
        except TimeoutError:
            detail = f"no answer within {self.timeout:g}s (--timeout)"
            self.checks[name] = Check(name, Status.FAIL, detail, {"timeout_seconds": self.timeout})
        except Exception as error:  # a doctor reports what it did not foresee, as a failure, and goes on
            self.checks[name] = Check(name, Status.FAIL, f"{type(error).__name__}: {error}")
        else:
            self.checks[name] = Check(name, verdict.status, verdict.detail, verdict.facts)

    def _failed_roots(self, name: str) -> list[str]:
        """The failed checks that a check failed or was skipped for: itself, or those its needs were skipped for."""
        check = self.checks[name]
        if check.status is Status.FAIL:
            return [name]
        return [root for need in check.facts.get("needs", ()) for root in self._failed_roots(need)]

    def order(self) -> list[str]:
        """Every check's name, in the order of the report: one part after the other, each as it depends."""
        instances = [instance.name for instance in self.settings.provider_instances]
        return [
            "temporal",
            "temporal namespace",
            "search attributes",
            *(name for name, _, _ in worker_task_queues(self.settings)),
            *(f"fleet {name}" for name in instances),
            "temporal clock",
            "bmdb",
            "bmdb schema",
            "bmdb clock",
            "heartbeat endpoint",
            "heartbeat endpoint certificate",
            "ssh key",
            "agent executable",
            *(f"provider {name}" for name in instances),
        ]

    async def run(self) -> list[Check]:
        """Every check; the parts that do not depend on each other at once."""
        async with self.stack:
            await asyncio.gather(
                self.temporal_checks(),
                self.bmdb_checks(),
                self.endpoint_checks(),
                self.local_checks(),
                self.providers(),
            )
        return [self.checks[name] for name in self.order()]

    # --- Temporal ------------------------------------------------------------

    async def temporal_checks(self) -> None:
        await self.check("temporal", self.temporal)
        await self.check("temporal namespace", self.namespace, needs=["temporal"])
        await self.check("search attributes", self.search_attributes, needs=["temporal namespace"])
        for name, task_queue, kind in worker_task_queues(self.settings):
            await self.check(name, partial(self.workers, task_queue, kind), needs=["temporal namespace"])
        for instance in self.settings.provider_instances:
            await self.check(f"fleet {instance.name}", partial(self.fleet, instance.name), needs=["temporal namespace"])
        await self.check("temporal clock", self.temporal_clock, needs=["temporal namespace"])

    async def temporal(self) -> Verdict:
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
        kept = _count(int(days), "day") if days.is_integer() else f"{retention.total_seconds() / 3600:g}h"
        detail = f"{namespace} ({where}), retention {kept}"
        if state == NamespaceState.NAMESPACE_STATE_DEPRECATED:
            return warn(f"{detail}: deprecated, so it takes no new workflows", **facts)
        return ok(detail, **facts)

    async def search_attributes(self) -> Verdict:
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
        polled = f"{_count(len(polling), 'poller')} of {kind} tasks on task queue {task_queue}"
        return ok(f"{polled}: {shown_identities(polling)}; {last}", **facts)

    async def fleet(self, provider: str) -> Verdict:
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

    # --- BMDB ----------------------------------------------------------------

    async def bmdb_checks(self) -> None:
        await self.check("bmdb", self.open_bmdb)
        await self.check("bmdb schema", self.bmdb_schema, needs=["bmdb"])
        await self.check("bmdb clock", self.bmdb_clock, needs=["bmdb"])

    async def open_bmdb(self) -> Verdict:
        url = self.settings.database_url
        local = ""
        if url is None:
            data = self.settings.state_dir / "postgres"
            if not data.is_dir():
                fail(
                    f"database_url is unset and there is no local PostgreSQL in {data}: set SHEPHERD_DATABASE_URL, "
                    "or run `shepherd dev`"
                )
            # Joins the embedded stack's PostgreSQL when it runs, as every command does; started otherwise.
            postgres = LocalPostgres(data)
            url = await asyncio.to_thread(postgres.start)
            self.stack.callback(postgres.stop)
            local = f" (the local PostgreSQL in {data})"
        bmdb = BMDB(url, pool_size=1)
        self.stack.push_async_callback(bmdb.close)
        try:
            await bmdb.ping()
        except BMDBUnavailable as error:
            fail(f"{error} (setting database_url)", url=redact_url(url))
        self.bmdb = bmdb
        return ok(f"reachable at {redact_url(url)}{local}", url=redact_url(url))

    async def bmdb_schema(self) -> Verdict:
        assert self.bmdb is not None
        revision, head = await schema_revision(self.bmdb), head_revision()
        problem = schema_problem(self.bmdb.url, revision)
        if problem is not None:
            fail(problem, revision=revision, head=head)
        return ok(f"at the newest migration, {head}", revision=revision, head=head)

    async def bmdb_clock(self) -> Verdict:
        assert self.bmdb is not None
        before, remote, after = await self.bmdb.read_clock()
        how = "SELECT clock_timestamp() between two readings of this host's clock"
        return clock_verdict("BMDB's", ClockReading(before, remote, after), how)

    # --- the heartbeat endpoint, as the agents reach it --------------------

    async def endpoint_checks(self) -> None:
        await self.check("heartbeat endpoint", self.endpoint)
        await self.check("heartbeat endpoint certificate", self.endpoint_certificate, needs=["heartbeat endpoint"])

    def _endpoint(self) -> tuple[str, int]:
        endpoint = self.settings.agent_endpoint
        if not endpoint:
            fail("agent_endpoint is not set (SHEPHERD_AGENT_ENDPOINT): agents have nowhere to send heartbeats")
        try:
            return parse_endpoint(endpoint)
        except ValueError as error:
            fail(f"agent_endpoint {error}")

    async def endpoint(self) -> Verdict:
        endpoint = self.settings.agent_endpoint
        host, port = self._endpoint()
        # Any certificate: whether the agents trust it is the next check's question.
        context = _grpc_tls_context(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        try:
            self.peer_certificate, protocol = await _tls_handshake(host, port, context)
        except ConnectionRefusedError:
            fail(f"nothing listens at {endpoint} (connection refused): is a heartbeat server, or its proxy, there?")
        except socket.gaierror as error:
            fail(f"cannot resolve {host} of agent_endpoint {endpoint}: {error.strerror}")
        except ssl.SSLError as error:
            fail(
                f"{endpoint} does not answer TLS ({error.reason or error}); agents always use TLS: serve it there, or "
                "put a TLS-terminating proxy before a plain-text heartbeat server"
            )
        except OSError as error:
            fail(f"cannot connect to {endpoint}: {error.strerror or error}")
        if protocol != "h2":
            fail(
                f"{endpoint} answers TLS but not with HTTP/2 (ALPN h2), which the agents' gRPC requires: let the "
                "proxy in front pass HTTP/2 through",
                alpn=protocol,
            )
        return ok(f"{endpoint} answers TLS with HTTP/2, as the agents' gRPC needs", alpn=protocol)

    async def endpoint_certificate(self) -> Verdict:
        host, port = self._endpoint()
        ca = self.settings.agent_endpoint_ca_certificate_path
        if ca is None:
            trust = "the system trust store (agent_endpoint_ca_certificate_path unset)"
            context = ssl.create_default_context()
        else:
            trust = f"the agents' CA {ca}"
            try:
                # The very certificates the worker gives the agents, read the way it reads them.
                context = ssl.create_default_context(cadata=b"".join(load_ca_certificates(ca)))
            except SettingsError as error:
                fail(str(error))
        try:
            der, _ = await _tls_handshake(host, port, _grpc_tls_context(context))
        except ssl.SSLCertVerificationError as error:
            presented = x509.load_der_x509_certificate(self.peer_certificate)
            expiry, facts = _expiry(presented)
            reason = str(error.verify_message or error.reason)
            seen = (
                f"it is for {', '.join(_certificate_names(presented))}, issued by {_common_name(presented.issuer)}, "
                f"{expiry}"
            )
            fail(
                f"not verifiable with {trust}: {reason}; {seen}{_certificate_advice(reason, host)}",
                verify_error=reason,
                issuer=presented.issuer.rfc4514_string(),
                **facts,
            )
        certificate = x509.load_der_x509_certificate(der)
        expiry, facts = _expiry(certificate)
        detail = f"{expiry}, verified for {host} with {trust}"
        facts["issuer"] = certificate.issuer.rfc4514_string()
        if facts["days_left"] < CERTIFICATE_WARN_DAYS:
            return warn(f"{detail}: under {CERTIFICATE_WARN_DAYS} days, renew it", **facts)
        return ok(detail, **facts)

    # --- this host's files -------------------------------------------------

    async def local_checks(self) -> None:
        await self.check("ssh key", self.ssh_key)
        await self.check("agent executable", self.agent_executable)

    async def ssh_key(self) -> Verdict:
        path = self.settings.effective_ssh_key_path
        try:
            key = load_ssh_key(path)
        except FileNotFoundError:
            return warn(
                f"no key at {path} (ssh_key_path): a worker creates one when it starts, and machines must then "
                "trust it (`shepherd ssh-key`); on a worker's host, check state_dir and ssh_key_path",
                path=str(path),
            )
        except SSHIdentityError as error:
            fail(str(error), path=str(path))
        except OSError as error:
            fail(f"SSH key {path}: {error.strerror or error}", path=str(path))
        mode = f"{path.stat().st_mode & 0o777:04o}"
        return ok(f"{path}: ed25519 {key.get_fingerprint()}, mode {mode}", path=str(path), mode=mode)

    async def agent_executable(self) -> Verdict:
        paths = self.settings.agent_executable_paths
        if not paths:
            fail("agent_executable_path is not set (SHEPHERD_AGENT_EXECUTABLE_PATH): workers have no agent to upload")
        shown, facts = [], []
        for path in paths:
            if not path.exists():
                fail(f"{path} does not exist (agent_executable_path)", path=str(path))
            if not path.is_file():
                fail(f"{path} is not a regular file (agent_executable_path)", path=str(path))
            if not os.access(path, os.R_OK):
                fail(f"{path} cannot be read by this user (agent_executable_path)", path=str(path))
            size = path.stat().st_size
            try:
                # What a worker checks before it hands the file out (an empty one among others): a file it would
                # refuse fails every takeover.
                agent = read_agent_executable(path)
            except NotAnExecutable as error:
                fail(f"{error} (agent_executable_path)", path=str(path), size_bytes=size)
            size_text = f"{size / 1_000_000:.1f} MB" if size >= 1_000_000 else f"{math.ceil(size / 1000)} kB"
            shown.append(f"{path}, {size_text}, sha256 {agent.sha256[:16]}, for {agent.target.describe()}")
            facts.append(
                {"path": str(path), "size_bytes": size, "sha256": agent.sha256, "runs_on": agent.target.describe()}
            )
        if len(facts) == 1:
            return ok(shown[0], **facts[0])
        return ok("; ".join(shown), executables=facts)

    # --- providers -------------------------------------------------------------

    async def providers(self) -> None:
        for instance in self.settings.provider_instances:
            await self.check(f"provider {instance.name}", partial(self.provider, instance))

    async def provider(self, instance: ProviderInstance) -> Verdict:
        try:
            provider = open_provider(instance, self.settings)
        except SettingsError as error:
            fail(str(error), type=instance.type)
        try:
            # Listing is every provider's cheapest call, and the one each fleet pass makes.
            machines = await provider.list_machines()
        except ProviderError as error:
            fail(str(error).removeprefix(f"provider {instance.name}: "), type=instance.type)
        finally:
            await provider.close()
        counts = Counter(machine.availability for machine in machines)
        kinds = {"in_use": Availability.KNOWN_USED, "possibly_in_use": Availability.POSSIBLY_USED}
        kinds["free"] = Availability.KNOWN_UNUSED
        parts = [f"{counts[kind]} {name.replace('_', ' ')}" for name, kind in kinds.items() if counts[kind]]
        return ok(
            f"type {instance.type}, answered: {_count(len(machines), 'machine')} listed"
            + (f" ({', '.join(parts)})" if parts else ""),
            type=instance.type,
            listed=len(machines),
            **{name: counts[kind] for name, kind in kinds.items()},
        )


def _certificate_advice(reason: str, host: str) -> str:
    """What to do about a certificate the agents cannot verify, by OpenSSL's reason."""
    if "expired" in reason:
        return ": renew it"
    if "not yet valid" in reason:
        return ": check the clocks of this host and of the server"
    if "mismatch" in reason:
        return f": issue it for {host}, or set agent_endpoint to a name it is issued for"
    if "issuer" in reason or "self-signed" in reason or "self signed" in reason:
        return ": give the agents the CA that issued it (agent_endpoint_ca_certificate_path), or use one theirs issued"
    return ""


def embedded_stack(settings: Settings) -> Settings | None:
    """The settings of the embedded stack (`shepherd dev`) whose state is in the state dir, when BMDB is its
    local PostgreSQL; None otherwise. The stack's settings are its own (dev_settings), not the environment's."""
    state = settings.state_dir.resolve()
    if settings.database_url is not None or not (state / EMBEDDED_TEMPORAL_STATE).exists():
        return None
    providers: tuple[ProviderInstance, ...] = ()
    if (state / EMBEDDED_PROVIDERS_FILE).is_file():
        providers = Settings.resolve({}, config_path=state / EMBEDDED_PROVIDERS_FILE)[0].providers
    inventories = [
        Path(str(i.options["inventory"])) for i in providers if i.type == "static" and "inventory" in i.options
    ]
    # `shepherd dev --inventory` takes --agent-endpoint; doctor takes it as SHEPHERD_AGENT_ENDPOINT.
    options = DevOptions(
        inventory=inventories[0] if inventories else None,
        agent_endpoint=(settings.agent_endpoint or None) if inventories else None,
    )
    return dev_settings(settings, state, options)


def report(checks: Sequence[Check], *, as_json: bool, embedded: Path | None, out: TextIO) -> int:
    """Print the checks, a line each (or as JSON); 1 when any failed."""
    counts = Counter(check.status for check in checks)
    code = EXIT_FAILURE if counts[Status.FAIL] else EXIT_OK
    if as_json:
        document = {
            "ok": code == EXIT_OK,
            "embedded_stack": str(embedded) if embedded is not None else None,
            "summary": {status.value: counts[status] for status in Status},
            "checks": [check.document() for check in checks],
        }
        json.dump(document, out, indent=2)
        out.write("\n")
        return code
    for check in checks:
        print(check.line(), file=out)
    summary = ", ".join(f"{counts[status]} {status.value}" for status in Status if counts[status])
    print(f"{len(checks)} checks: {summary}", file=out)
    return code


def register(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "doctor", help="check Temporal, BMDB, the heartbeat endpoint, keys and providers: run first when in doubt"
    )
    add_common(parser)
    parser.add_argument(
        "--timeout",
        type=duration_arg,
        default=DEFAULT_TIMEOUT,
        help="time limit of each check (default %(default)gs); a check that takes longer fails",
    )
    parser.add_argument("--json", action="store_true", help="a JSON document instead of lines")
    parser.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace, out: TextIO | None = None) -> int:
    environ: Mapping[str, str] = os.environ
    embedded = embedded_stack(settings)
    if embedded is not None:
        # The stack's processes reach its own dev server in plain text, whatever the shell sets.
        settings, environ = embedded, embedded_environment(os.environ)
    where = embedded.state_dir if embedded is not None else None
    doctor = Doctor(settings, timeout=args.timeout, environ=environ, embedded=where)
    checks = asyncio.run(doctor.run())
    return report(checks, as_json=args.json, embedded=where, out=out or sys.stdout)
