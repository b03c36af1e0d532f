"""The operator API's handlers of the fleet, the event log, the event stream and bulk requests.

Each answers what the matching command prints with --json (operations.documents), as the policy allows: a fleet
schedule is a provider instance's as a whole (WholeProvider), an event is its machine's (the caller's scope holds it
or not), a bulk request is decided over its selection and again for each machine (operator_api_bulk).
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any, Protocol

from aiohttp import web
from temporalio.client import Client

from bmdb.store import BMDB, BMDBUnavailable, MachineRecord
from foundation.settings import Settings
from operations.client import OperatorClient
from operations.documents import done_line, events_document, provider_document, release_lines
from operations.fleet_control import FleetAction, FleetError
from operations.machine_actions import MAX_REASON_LENGTH
from operations.policy import Decision, Selection, Target, WholeProvider
from operations.policy_file import EVENTS_STREAM, READ, RELEASE_RECOVERIES
from processes.operator_api_bulk import bulk_request, run_bulk
from processes.operator_api_errors import ApiError
from processes.operator_api_events import LogFollower, StreamSlots, comment, follow, last_event_id, visible
from processes.operator_api_requests import Asked, approved_reason, checked_body
from processes.operator_api_routes import MAX_EVENTS

DEFAULT_EVENTS, DEFAULT_PASSES, MAX_PASSES = 50, 5, 100
# The fleet actions, by the last part of their path.
_FLEET_VERBS = {"pause": "fleet-pause", "resume": "fleet-resume", "trigger": "fleet-trigger"}


class ApiCore(Protocol):
    """What these handlers stand on of the operator API (processes.operator_api.OperatorApi)."""

    settings: Settings
    temporal: Client
    reads: OperatorClient
    streams: StreamSlots
    closing: asyncio.Event

    def decision(self, asked: Asked, action: str, target: Target, *, approving: bool = True) -> Decision: ...
    def decide(self, asked: Asked, action: str, target: Target, confirm: str | None = None) -> str | None: ...
    async def machine_record(self, asked: Asked, action: str) -> MachineRecord: ...
    async def asked_of(self, request: web.Request) -> Asked: ...
    async def operators_for(self, asked: Asked) -> OperatorClient: ...


class FleetHandlers:
    """The operator API's handlers of /v1/fleet, /v1/events, /v1/machines/{name}/events and /v1/bulk."""

    def __init__(self, api: ApiCore) -> None:
        self.api = api

    def _provider(self, name: str) -> str:
        names = [instance.name for instance in self.api.settings.provider_instances]
        if name not in names:
            raise ApiError(404, f"no provider instance {name!r}; there are {', '.join(names)}")
        return name

    async def fleet(self, asked: Asked) -> web.Response:
        query = asked.query
        passes = _whole(query.get("passes"), "passes", DEFAULT_PASSES, MAX_PASSES)
        providers = [instance.name for instance in self.api.settings.provider_instances]
        if "provider" in query:
            providers = [self._provider(query["provider"])]
        shown, refusals = [], []
        for provider in providers:
            try:
                self.api.decision(asked, READ, WholeProvider(provider))
            except ApiError as refused:
                refusals.append(refused)
                continue
            shown.append(provider)
        if not shown:
            raise refusals[0]
        try:
            return web.json_response({"providers": [await self._provider_document(p, passes) for p in shown]})
        except FleetError as error:
            raise ApiError(503, str(error)) from None

    async def _provider_document(self, provider: str, passes: int) -> dict[str, Any]:
        state = await self.api.reads.schedule(provider)
        return provider_document(provider, state, await self.api.reads.last_passes(provider, passes))

    async def fleet_action(self, asked: Asked) -> web.Response:
        route = asked.route
        assert route.action is not None
        body = checked_body(asked)
        provider = self._provider(asked.params["provider"])
        self.api.decide(asked, route.action, WholeProvider(provider), confirm=provider)
        note = " ".join(body.get("note", "").split())
        if len(note) > MAX_REASON_LENGTH:
            raise ApiError(400, f"field 'note': {len(note)} characters long, at most {MAX_REASON_LENGTH} are kept")
        passes = _whole(asked.query.get("passes"), "passes", DEFAULT_PASSES, MAX_PASSES)
        subject = asked.identity.subject
        done, released = None, []
        async with await self.api.operators_for(asked) as operators:
            try:
                if route.action == RELEASE_RECOVERIES:
                    reason = approved_reason(asked, body["reason"])
                    released = release_lines(await operators.release_recoveries([provider], subject, reason))
                else:
                    verb = next(v for v, a in _FLEET_VERBS.items() if a == route.action)
                    action = FleetAction(**{verb: True}, note=note, by=subject)
                    if await operators.apply(provider, action):
                        done = done_line(provider, action)
                    await operators.log_fleet_action([provider], action)
                document = await self._provider_document(provider, passes)
            except (FleetError, BMDBUnavailable) as error:
                raise ApiError(503, str(error)) from None
        # As `shepherd fleet --json` prints it, and the lines the command prints of what was done.
        return web.json_response({"providers": [document], "done": done, "released": released})

    async def machine_events(self, asked: Asked) -> web.Response:
        record = await self.api.machine_record(asked, READ)
        limit = _whole(asked.query.get("limit"), "limit", DEFAULT_EVENTS, MAX_EVENTS)
        actions = _flag(asked.query.get("actions"), "actions")
        _, events = await self.api.reads.events(str(record.machine_id), limit, actions=actions)
        return web.json_response(events_document(record, events))

    async def events(self, asked: Asked) -> web.Response:
        query = asked.query
        limit = _whole(query.get("limit"), "limit", DEFAULT_EVENTS, MAX_EVENTS)
        provider = self._provider(query["provider"]) if "provider" in query else None
        since = None
        if "since" in query:
            try:
                since = datetime.fromisoformat(query["since"])
            except ValueError:
                raise ApiError(400, f"since must be an ISO 8601 time, got {query['since']!r}") from None
            if since.tzinfo is None:
                raise ApiError(400, f"since must name its time zone (such as +00:00 or Z), got {query['since']!r}")
        scope = self.api.decision(asked, READ, Selection()).scope
        bmdb = await self.api.reads.bmdb()
        if _flag(query.get("fleet"), "fleet"):
            # The fleet's own events alone, as `shepherd events` without a machine lists them.
            if provider is not None or since is not None or _flag(query.get("actions"), "actions"):
                raise ApiError(400, "fleet=true lists the fleet's own events: without provider, since or actions")
            events = await bmdb.list_events(None, limit)
        else:
            events = await bmdb.list_fleet_log(
                provider=provider, since=since, limit=limit, actions=_flag(query.get("actions"), "actions")
            )
        return web.json_response(events_document(None, await visible(self.api.temporal, scope, events)))

    async def event_stream(self, request: web.Request) -> web.StreamResponse:
        after = last_event_id(request.headers.get("Last-Event-ID"))
        scope = self.api.decision(await self.api.asked_of(request), EVENTS_STREAM, Selection()).scope
        self.api.streams.take()
        try:
            follower = LogFollower(after if after is not None else await (await self.api.reads.bmdb()).last_event_id())
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store", "X-Accel-Buffering": "no"}
            )
            await response.prepare(request)
            await response.write(comment(f"the event log after event {follower.after}"))

            async def keep(events: list[Any]) -> list[Any]:
                return await visible(self.api.temporal, scope, events)

            try:
                await follow(response, follower, self._stream_bmdb, keep, self.api.closing)
            except ConnectionResetError:
                pass  # the client went
            return response
        finally:
            self.api.streams.give_back()

    async def _stream_bmdb(self) -> BMDB:
        return await self.api.reads.bmdb()

    async def bulk(self, asked: Asked) -> web.Response:
        body = checked_body(asked)
        action = asked.params["action"]
        if "reason" in body:
            body["reason"] = approved_reason(asked, body["reason"])
        bulk = bulk_request(action, body, asked.identity.subject)

        def decide(target: Target) -> Decision:
            # A dry run does nothing, so it needs no second person; the request itself waits for one.
            try:
                return self.api.decision(asked, action, target, approving=not bulk.dry_run)
            except ApiError as refused:
                return Decision(False, refusal=refused.text)

        async with await self.api.operators_for(asked) as operators:
            return web.json_response(await run_bulk(bulk, decide, operators))


def _whole(text: str | None, name: str, default: int, most: int) -> int:
    if text is None:
        return default
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise ApiError(400, f"{name} must be a whole number from 1 to {most}, got {text!r}")
    return int(text)


def _flag(text: str | None, name: str) -> bool:
    if text is None or text == "false":
        return False
    if text == "true":
        return True
    raise ApiError(400, f"{name} must be true or false, got {text!r}")
