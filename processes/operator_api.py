"""The operator API process: HTTP under /v1 for operators' reads and requests, each by a verified operator.

Every request shows an OIDC bearer token (foundation.operator_tokens) or, without one, a TLS client certificate
of the operator CA (foundation.operator_certificates); the policy file (operations.policy)
decides whether its operator may do its action to the machine's provider instance; an allowed request is done by
an OperatorClient that names the operator and signs every update it sends (operations.attestation), so the
machine's workflow records it as verified. The routes, their actions and bodies are one table (operator_api_routes),
from which the OpenAPI document is made too. Answers and errors are JSON; a line is logged for every request:
who, what, and how it ended, never the token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import ssl
from collections.abc import Awaitable, Callable
from datetime import timedelta

from aiohttp import web
from temporalio.client import Client

from bmdb.store import MachineRecord
from foundation.bmdb_tls import log_bmdb_tls_warnings
from foundation.operator_certificates import CertificateRefused, ask_client_certificates, peer_identity
from foundation.operator_proof import ProofSigner
from foundation.operator_tokens import IssuerUnavailable, OperatorIdentity, TokenRefused, TokenVerifier
from foundation.settings import Settings
from foundation.startup import connect_temporal
from lifecycle.contracts import MACHINE_WORKFLOW_TYPE, MaintenanceRequest, OperatorRequest, machine_workflow_id
from operations.attestation import Attestation
from operations.client import OperatorClient
from operations.machine_actions import OperatorRefused
from operations.machine_documents import detail_json, machine_json
from operations.machine_names import MachineNotFound, resolve_machine
from operations.policy import Confirmation, Decision, OneMachine, ReloadedPolicy, Selection, Target
from operations.policy_file import READ
from processes.api_signing_key import load_signing_key
from processes.operator_api_actions import machine_action
from processes.operator_api_approvals import Approvals
from processes.operator_api_errors import ApiError
from processes.operator_api_events import StreamSlots
from processes.operator_api_fleet import FleetHandlers
from processes.operator_api_requests import (
    Asked,
    NeedsApproval,
    approved_reason,
    body_json,
    checked_body,
    requester,
)
from processes.operator_api_routes import ROUTES, openapi_document

log = logging.getLogger("shepherd.api")

# Far above any request body this API takes (a reason of 500 characters and two flags).
MAX_BODY_BYTES = 64 * 1024
# What a client waits before asking again when the issuer could not be asked for its keys.
ISSUER_RETRY_AFTER = "5"
_IDENTITY = web.RequestKey("identity", OperatorIdentity)


class OperatorApi:
    """The API's handlers over what it stands on: the token verifier, the policy, the signer, Temporal and BMDB."""

    def __init__(
        self,
        settings: Settings,
        verifier: TokenVerifier | None,
        policy: ReloadedPolicy,
        signer: ProofSigner,
        temporal: Client,
        *,
        database_url: str | None = None,
    ) -> None:
        self.settings, self.verifier, self.policy, self.signer = settings, verifier, policy, signer
        self.temporal, self.database_url = temporal, database_url
        # Reads and name lookups need no proof: one client, one BMDB pool, for every request.
        self.reads = OperatorClient(settings, temporal=temporal, database_url=database_url)
        self.streams = StreamSlots(settings.api_max_streams)
        self.approvals = Approvals(self.reads.bmdb, policy, timedelta(seconds=settings.api_approval_wait))
        self.fleet = FleetHandlers(self)
        # Set when the API stops, so open event streams end instead of holding the shutdown up.
        self.closing = asyncio.Event()

    async def close(self) -> None:
        await self.reads.close()
        if self.verifier is not None:
            await self.verifier.close()

    def application(self) -> web.Application:
        """The aiohttp application serving ROUTES."""
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._every_request])
        handlers: dict[str, Callable[[Asked], Awaitable[web.StreamResponse]]] = {
            "openapi": self.openapi,
            "machines": self.machines,
            "machine": self.machine,
            "update": self.update,
            "action": self.action,
            "fleet": self.fleet.fleet,
            "fleetAction": self.fleet.fleet_action,
            "events": self.fleet.events,
            "machineEvents": self.fleet.machine_events,
            "bulk": self.fleet.bulk,
            "approvals": self.list_approvals,
            "decideApproval": self.decide_approval,
        }
        for route in ROUTES:
            # The event stream writes as it goes, to the request's own response.
            serve = (
                self.fleet.event_stream if route.handler == "eventStream" else self._serving(handlers[route.handler])
            )
            app.router.add_route(route.method, route.path, serve, name=route.operation)
        app.on_shutdown.append(self._closing)
        return app

    async def _closing(self, app: web.Application) -> None:
        self.closing.set()

    def _serving(
        self, handler: Callable[[Asked], Awaitable[web.StreamResponse]]
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """The aiohttp handler of a handler of Asked; a request the policy gives to two people waits for the second
        (202) instead."""

        async def serve(request: web.Request) -> web.StreamResponse:
            asked = await self.asked_of(request)
            try:
                return await handler(asked)
            except NeedsApproval as needs:
                return await self.approvals.ask(asked, needs)

        return serve

    async def operators_for(self, asked: Asked) -> OperatorClient:
        """A client of the verified operator's own, on the API's connections, whose BMDB events credit them."""
        identity = asked.identity
        attestation = Attestation(identity.subject, identity.verified_by, self.signer)
        bmdb = await self.reads.bmdb()
        return OperatorClient(self.settings, temporal=self.temporal, bmdb=bmdb, attestation=attestation)

    async def asked_of(self, request: web.Request) -> Asked:
        name = request.match_info.route.name
        route = next(route for route in ROUTES if route.operation == name)
        params, query = dict(request.match_info), dict(request.rel_url.query)
        return Asked(route, request[_IDENTITY], params, query, await request.read())

    async def list_approvals(self, asked: Asked) -> web.Response:
        """The requests waiting for a second operator; any operator who may read sees them."""
        self.decide(asked, READ, Selection())
        return web.json_response(await self.approvals.open())

    async def decide_approval(self, asked: Asked) -> web.StreamResponse:
        """Approve (doing the request as it was asked) or refuse a request waiting for a second operator."""
        return await self.approvals.decide(asked, self._perform)

    async def _perform(self, asked: Asked) -> web.StreamResponse:
        """Do an approved request: its route's handler, as it was asked, with its approver beside it."""
        handlers: dict[str, Callable[[Asked], Awaitable[web.StreamResponse]]] = {
            "update": self.update,
            "action": self.action,
            "fleetAction": self.fleet.fleet_action,
            "bulk": self.fleet.bulk,
        }
        return await handlers[asked.route.handler](asked)

    @web.middleware
    async def _every_request(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        who = "-"
        try:
            identity = await self._authenticate(request)
            who = f"{identity.subject} (verified: {identity.verified_by})"
            request[_IDENTITY] = identity
            response, outcome = await handler(request), "done"
        except ApiError as error:
            response, outcome = error.response(), error.text
        except web.HTTPException as error:  # no such route or method, a body past MAX_BODY_BYTES
            response, outcome = ApiError(error.status, error.reason).response(), error.reason
        log.info("%s %s %s: %d %s", who, request.method, request.path, response.status, outcome)
        return response

    async def _authenticate(self, request: web.Request) -> OperatorIdentity:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            # No token: the client certificate the TLS handshake verified, when the API asks for one. A token, when
            # there is one, decides, whatever certificate the connection shows.
            try:
                identity = peer_identity(request.transport.get_extra_info("ssl_object") if request.transport else None)
            except CertificateRefused as refused:
                raise ApiError(401, f"client certificate refused: {refused}") from None
            if identity is not None:
                return identity
            raise ApiError(
                401,
                "no bearer token: send Authorization: Bearer <access token> (shepherd login gets one)"
                + (" or a client certificate of the operator CA" if self.settings.api_client_ca_path else ""),
                {"WWW-Authenticate": 'Bearer realm="shepherd"'},
            )
        if self.verifier is None:
            raise ApiError(
                401,
                "token refused: this API takes no bearer tokens (no oidc_issuer is set); show a client certificate",
                {"WWW-Authenticate": 'Bearer realm="shepherd", error="invalid_token"'},
            )
        try:
            return await self.verifier.verify(token.strip())
        except TokenRefused as refused:
            raise ApiError(
                401, f"token refused: {refused}", {"WWW-Authenticate": 'Bearer realm="shepherd", error="invalid_token"'}
            ) from None
        except IssuerUnavailable as error:
            raise ApiError(503, f"tokens cannot be checked now: {error}", {"Retry-After": ISSUER_RETRY_AFTER}) from None

    def decision(self, asked: Asked, action: str, target: Target, *, approving: bool = True) -> Decision:
        """The policy's decision, with the typed confirmation it may need; ApiError 403 saying why when refused,
        NeedsApproval when it needs a second person, none has approved it yet and approving (a dry run is not)."""
        decision = self.policy.decide(requester(asked.identity), action, target)
        if not decision.allowed:
            raise ApiError(403, decision.refusal or f"{asked.identity.subject} may not {action}")
        if decision.confirmation == Confirmation.SECOND_PERSON and asked.approved_by is None and approving:
            raise NeedsApproval(action, target, _described(asked, action))
        return decision

    def decide(self, asked: Asked, action: str, target: Target, confirm: str | None = None) -> str | None:
        """The scope to keep the answer within (None: none); ApiError 403 saying why when refused, 428 saying what
        to type when the policy asks for confirm typed and the body's "confirm" is not it."""
        decision = self.decision(asked, action, target)
        if decision.confirmation == Confirmation.TYPED and (
            confirm is None or body_json(asked).get("confirm") != confirm
        ):
            what = f'send "confirm": "{confirm}"' if confirm else "it cannot be typed here"
            raise ApiError(428, f"{action} needs a typed confirmation: {what}")
        return decision.scope

    async def machine_record(self, asked: Asked, action: str) -> MachineRecord:
        """The machine the path names, once the policy allows the action on it; 404 when there is none."""
        try:
            record = await resolve_machine(await self.reads.bmdb(), asked.params["name"])
        except MachineNotFound as error:
            raise ApiError(404, str(error)) from None
        try:
            scope = self.decide(asked, action, OneMachine(record.provider), confirm=record.provider_id)
        except NeedsApproval as needs:
            raise dataclasses.replace(needs, machine_id=str(record.machine_id)) from None
        workflow_id = machine_workflow_id(record.provider, record.provider_id)
        if scope is not None and workflow_id not in await self._scoped_workflows(scope, workflow_id):
            raise ApiError(403, f"{workflow_id} is outside what the grants allowing {action} reach: {scope}")
        return record

    async def _scoped_workflows(self, scope: str, workflow_id: str | None = None) -> set[str]:
        """The machine workflows a grant's scope selects (of one id only, when given)."""
        query = f"WorkflowType = '{MACHINE_WORKFLOW_TYPE}' AND ({scope})"
        if workflow_id is not None:
            if "'" in workflow_id or "\\" in workflow_id:
                return set()  # cannot be quoted in a query, so cannot be shown to be in the scope
            query += f" AND WorkflowId = '{workflow_id}'"
        return {execution.id async for execution in self.temporal.list_workflows(query)}

    async def openapi(self, asked: Asked) -> web.Response:
        return web.json_response(openapi_document())

    async def machines(self, asked: Asked) -> web.Response:
        scope = self.decide(asked, READ, Selection())
        views = await self.reads.fleet_view()
        if scope is not None:
            # Only machines with a workflow can be matched against a query: those without one are not shown.
            within = await self._scoped_workflows(scope)
            views = [v for v in views if machine_workflow_id(v.record.provider, v.record.provider_id) in within]
        return web.json_response([machine_json(view) for view in views])

    async def machine(self, asked: Asked) -> web.Response:
        record = await self.machine_record(asked, READ)
        detail = await self.reads.machine_detail(machine_workflow_id(record.provider, record.provider_id))
        return web.json_response(detail_json(detail))

    async def update(self, asked: Asked) -> web.Response:
        route = asked.route
        assert route.update is not None and route.action is not None
        body = checked_body(asked)
        record = await self.machine_record(asked, route.action)
        subject = asked.identity.subject
        reason = approved_reason(asked, body.get("reason", ""))
        request: OperatorRequest | MaintenanceRequest
        if route.action == "maintenance":
            request = MaintenanceRequest(body["on"], reason, subject, body.get("recover", False))
        else:
            request = OperatorRequest(reason, subject, force=body.get("force") is True)
        workflow_id = machine_workflow_id(record.provider, record.provider_id)
        async with await self.operators_for(asked) as operators:
            try:
                answer = await operators.ask(workflow_id, route.update, request, then="ask again once it runs")
            except (OperatorRefused, MachineNotFound) as error:
                raise ApiError(409, str(error)) from None
        return web.json_response({"answer": answer})

    async def action(self, asked: Asked) -> web.Response:
        """A recovery, reimage, retry or host-key reset, done as the command does it (operator_api_actions)."""
        route = asked.route
        assert route.action is not None
        body = checked_body(asked)
        record = await self.machine_record(asked, route.action)
        async with await self.operators_for(asked) as operators:
            reason = approved_reason(asked, body["reason"])
            answer = await machine_action(operators, route.action, record, reason, body.get("expect_fingerprint"))
        return web.json_response({"answer": answer})


def _described(asked: Asked, action: str) -> str:
    """What a request asks, in words, for the approval a second operator reads."""
    target = asked.params.get("name") or asked.params.get("provider") or asked.params.get("action")
    where = body_json(asked).get("where")
    return f"{action} of {target}" + (f" where {where}" if isinstance(where, str) else "")


def _tls_context(settings: Settings) -> ssl.SSLContext | None:
    if settings.api_tls_certificate_path is None or settings.api_tls_key_path is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(settings.api_tls_certificate_path, settings.api_tls_key_path)
    if settings.api_client_ca_path is not None:
        ask_client_certificates(context, settings.api_client_ca_path)
    return context


async def run_operator_api(settings: Settings, *, stop: asyncio.Event | None = None) -> None:
    """Serve the operator API until SIGTERM/SIGINT (or stop is set); settings checked by check_api()."""
    assert settings.api_signing_key_path is not None and settings.api_policy_path is not None
    log_bmdb_tls_warnings(log, {"database_url": settings.database_url})
    signer = load_signing_key(settings.api_signing_key_path)
    policy = ReloadedPolicy(settings.api_policy_path)
    temporal = await connect_temporal(settings)
    # With an operator CA and no issuer, operators show client certificates alone.
    verifier = TokenVerifier(settings.oidc_issuer, settings.oidc_audience) if settings.oidc_issuer else None
    api = OperatorApi(settings, verifier, policy, signer, temporal, database_url=settings.database_url)
    runner = web.AppRunner(api.application(), access_log=None)
    await runner.setup()
    host, _, port = settings.api_listen.rpartition(":")
    tls = _tls_context(settings)
    try:
        await web.TCPSite(runner, host.strip("[]"), int(port), ssl_context=tls).start()
    except OSError as error:
        await runner.cleanup()
        await api.close()
        raise OSError(f"cannot listen on {settings.api_listen}: {error.strerror} (setting api_listen)") from None
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    log.info(
        "operator API on %s://%s, proofs signed with key %s",
        "https" if tls else "http",
        settings.api_listen,
        signer.key_id,
    )
    try:
        await stop.wait()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        await runner.cleanup()
        await api.close()
        log.info("operator API stopped")
