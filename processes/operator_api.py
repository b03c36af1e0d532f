"""The operator API process: HTTP under /v1 for operators' reads and requests, each by a verified operator.

Every request shows an OIDC bearer token (foundation.operator_tokens); the policy file (operations.policy)
decides whether its operator may do its action to the machine's provider instance; an allowed request is done by
an OperatorClient that names the operator and signs every update it sends (operations.attestation), so the
machine's workflow records it as verified. The routes, their actions and bodies are one table (operator_api_routes),
from which the OpenAPI document is made too. Answers and errors are JSON; a line is logged for every request:
who, what, and how it ended, never the token.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from temporalio.client import Client

from bmdb.store import MachineRecord
from foundation.operator_proof import ProofSigner
from foundation.operator_tokens import IssuerUnavailable, OperatorIdentity, TokenRefused, TokenVerifier
from foundation.settings import Settings
from foundation.startup import connect_temporal
from lifecycle.contracts import MACHINE_WORKFLOW_TYPE, MaintenanceRequest, OperatorRequest, machine_workflow_id
from operations.attestation import Attestation
from operations.client import OperatorClient
from operations.machine_actions import OperatorRefused
from operations.machine_names import MachineNotFound, resolve_machine
from operations.machine_reads import MachineDetail, MachineView
from operations.policy import Confirmation, OneMachine, ReloadedPolicy, Requester, Selection, Target
from operations.policy_file import READ
from processes.api_signing_key import load_signing_key
from processes.operator_api_routes import ROUTES, BodyError, Route, openapi_document, read_body

log = logging.getLogger("shepherd.api")

# Far above any request body this API takes (a reason of 500 characters and two flags).
MAX_BODY_BYTES = 64 * 1024
# What a client waits before asking again when the issuer could not be asked for its keys.
ISSUER_RETRY_AFTER = "5"
_IDENTITY = web.RequestKey("identity", OperatorIdentity)


class ApiError(Exception):
    """A request the API will not or cannot do: its HTTP status, the reason said in the JSON body, headers."""

    def __init__(self, status: int, text: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(text)
        self.status, self.text, self.headers = status, text, headers or {}

    def response(self) -> web.Response:
        return web.json_response({"error": self.text}, status=self.status, headers=self.headers)


@dataclass(frozen=True)
class Documents:
    """How a machine reads in an answer: the JSON of `shepherd machines --json` and `shepherd status --json`,
    which the commands own, so an answer of the API and a command's output are one shape."""

    machine: Callable[[MachineView], dict[str, Any]]
    detail: Callable[[MachineDetail], dict[str, Any]]


class OperatorApi:
    """The API's handlers over what it stands on: the token verifier, the policy, the signer, Temporal and BMDB."""

    def __init__(
        self,
        settings: Settings,
        verifier: TokenVerifier,
        policy: ReloadedPolicy,
        signer: ProofSigner,
        temporal: Client,
        documents: Documents,
        *,
        database_url: str | None = None,
    ) -> None:
        self.settings, self.verifier, self.policy, self.signer = settings, verifier, policy, signer
        self.temporal, self.documents, self.database_url = temporal, documents, database_url
        # Reads and name lookups need no proof: one client, one BMDB pool, for every request.
        self.reads = OperatorClient(settings, temporal=temporal, database_url=database_url)

    async def close(self) -> None:
        await self.reads.close()
        await self.verifier.close()

    def application(self) -> web.Application:
        """The aiohttp application serving ROUTES."""
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._every_request])
        handlers: dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]] = {
            "openapi": self.openapi,
            "machines": self.machines,
            "machine": self.machine,
            "update": self.update,
        }
        for route in ROUTES:
            app.router.add_route(route.method, route.path, handlers[route.handler], name=route.operation)
        return app

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
            raise ApiError(
                401,
                "no bearer token: send Authorization: Bearer <access token> (shepherd login gets one)",
                {"WWW-Authenticate": 'Bearer realm="shepherd"'},
            )
        try:
            return await self.verifier.verify(token.strip())
        except TokenRefused as refused:
            raise ApiError(
                401, f"token refused: {refused}", {"WWW-Authenticate": 'Bearer realm="shepherd", error="invalid_token"'}
            ) from None
        except IssuerUnavailable as error:
            raise ApiError(503, f"tokens cannot be checked now: {error}", {"Retry-After": ISSUER_RETRY_AFTER}) from None

    def _decide(self, request: web.Request, action: str, target: Target) -> str | None:
        """The scope to keep the answer within (None: none); ApiError 403 saying why when refused."""
        identity = request[_IDENTITY]
        requester = Requester(identity.subject, identity.groups, verified_by=identity.verified_by)
        decision = self.policy.decide(requester, action, target)
        if not decision.allowed:
            raise ApiError(403, decision.refusal or f"{identity.subject} may not {action}")
        if decision.confirmation == Confirmation.SECOND_PERSON:
            raise ApiError(403, f"{action} needs a second person's approval, which this API does not offer yet")
        if decision.confirmation == Confirmation.TYPED:
            raise ApiError(403, f"{action} needs a typed confirmation, which this API does not offer yet")
        return decision.scope

    async def _machine(self, request: web.Request, action: str) -> MachineRecord:
        """The machine the path names, once the policy allows the action on it; 404 when there is none."""
        try:
            record = await resolve_machine(await self.reads.bmdb(), request.match_info["name"])
        except MachineNotFound as error:
            raise ApiError(404, str(error)) from None
        scope = self._decide(request, action, OneMachine(record.provider))
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

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document())

    async def machines(self, request: web.Request) -> web.Response:
        scope = self._decide(request, READ, Selection())
        views = await self.reads.fleet_view()
        if scope is not None:
            # Only machines with a workflow can be matched against a query: those without one are not shown.
            within = await self._scoped_workflows(scope)
            views = [v for v in views if machine_workflow_id(v.record.provider, v.record.provider_id) in within]
        return web.json_response([self.documents.machine(view) for view in views])

    async def machine(self, request: web.Request) -> web.Response:
        record = await self._machine(request, READ)
        detail = await self.reads.machine_detail(machine_workflow_id(record.provider, record.provider_id))
        return web.json_response(self.documents.detail(detail))

    async def update(self, request: web.Request) -> web.Response:
        route = _route_of(request)
        assert route.update is not None and route.action is not None
        try:
            body = read_body(route, await request.read())
        except BodyError as error:
            raise ApiError(400, str(error)) from None
        record = await self._machine(request, route.action)
        identity = request[_IDENTITY]
        asked: OperatorRequest | MaintenanceRequest
        if route.action == "maintenance":
            asked = MaintenanceRequest(body["on"], body.get("reason", ""), identity.subject, body.get("recover", False))
        else:
            asked = OperatorRequest(body["reason"], identity.subject)
        attestation = Attestation(identity.subject, identity.verified_by, self.signer)
        workflow_id = machine_workflow_id(record.provider, record.provider_id)
        # A client of this operator's own, sharing the API's connections: BMDB is not opened again per request.
        async with OperatorClient(
            self.settings, temporal=self.temporal, bmdb=await self.reads.bmdb(), attestation=attestation
        ) as operators:
            try:
                answer = await operators.ask(workflow_id, route.update, asked, then="ask again once it runs")
            except (OperatorRefused, MachineNotFound) as error:
                raise ApiError(409, str(error)) from None
        return web.json_response({"answer": answer})


def _route_of(request: web.Request) -> Route:
    name = request.match_info.route.name
    return next(route for route in ROUTES if route.operation == name)


def _tls_context(settings: Settings) -> ssl.SSLContext | None:
    if settings.api_tls_certificate_path is None or settings.api_tls_key_path is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(settings.api_tls_certificate_path, settings.api_tls_key_path)
    return context


async def run_operator_api(settings: Settings, documents: Documents, *, stop: asyncio.Event | None = None) -> None:
    """Serve the operator API until SIGTERM/SIGINT (or stop is set); settings checked by check_api()."""
    assert settings.api_signing_key_path is not None and settings.api_policy_path is not None
    signer = load_signing_key(settings.api_signing_key_path)
    policy = ReloadedPolicy(settings.api_policy_path)
    temporal = await connect_temporal(settings)
    verifier = TokenVerifier(settings.oidc_issuer, settings.oidc_audience)
    api = OperatorApi(settings, verifier, policy, signer, temporal, documents, database_url=settings.database_url)
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
