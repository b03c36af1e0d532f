"""The operator client through the operator API: the same reads and requests as OperatorClient, over HTTPS to
`shepherd api`, as the operator logged in with `shepherd login` (or shown by a client certificate).

The commands use it when api_url is set, so an operator's action is checked by the API's policy and recorded as
verified; they print what they print when they reach Temporal and BMDB themselves, since the API answers with the
same documents and lines (operations.machine_documents).
"""

from __future__ import annotations

import json
import ssl
from types import TracebackType
from typing import Any
from urllib.parse import quote

import aiohttp

from foundation.login_tokens import TokenCacheError
from foundation.oidc_client import LoginError
from foundation.oidc_issuer import IssuerUnavailable
from foundation.operator_login import access_token
from foundation.settings import Settings
from lifecycle.contracts import (
    DECOMMISSION_UPDATE,
    RELEASE_UPDATE,
    RESTART_AGENT_UPDATE,
    SET_MAINTENANCE_UPDATE,
    MaintenanceRequest,
    OperatorRequest,
    RecoveryRequest,
)
from operations.connections import OperatorError
from operations.machine_documents import DocumentError, detail_from_json, view_from_json
from operations.machine_reads import MachineDetail, MachineView

# Far above any answer a person reads; bounds what a wrong or hostile server can make a command hold.
MAX_ANSWER_BYTES = 64 * 1024 * 1024
# An operator waits this long for an answer; the API itself waits for a workflow's update far less.
REQUEST_TIMEOUT = 120.0

# The route under /v1/machines/{name}/ of each update the commands send.
_UPDATE_ROUTES = {
    SET_MAINTENANCE_UPDATE: "maintenance",
    RESTART_AGENT_UPDATE: "restart-agent",
    DECOMMISSION_UPDATE: "decommission",
    RELEASE_UPDATE: "release",
}


class ApiRefused(OperatorError):
    """The operator API answered with an error; the message is its reason, with what to do where one helps."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status


class ApiOperatorClient:
    """An operator's reads and requests, through the operator API at settings.api_url."""

    def __init__(self, settings: Settings, *, confirm: str | None = None) -> None:
        self.settings = settings
        # What the operator typed back for the API's policy, sent with every request that acts.
        self.confirm = confirm
        self.base = settings.api_url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ApiOperatorClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def fleet_view(self) -> list[MachineView]:
        """Every machine the operator may read, as `shepherd machines` lists them."""
        answer = await self.call("GET", "/v1/machines")
        if not isinstance(answer, list):
            raise self._malformed("/v1/machines", "is not a list of machines")
        return [self._read(view_from_json, document, "/v1/machines") for document in answer]

    async def machine_detail(self, name: str) -> MachineDetail:
        """The machine of that name whole, as `shepherd status` shows it."""
        path = f"/v1/machines/{_segment(name)}"
        return self._read(detail_from_json, await self.call("GET", path), path)

    async def ask(self, name: str, update: str, request: OperatorRequest | MaintenanceRequest, *, then: str) -> str:
        """Send the update to the machine of that name; its answer, or ApiRefused with the workflow's reason."""
        route = _UPDATE_ROUTES.get(update)
        if route is None:
            raise OperatorError(f"the operator API does not send {update}")
        body: dict[str, Any] = {"reason": request.reason} if request.reason else {}
        if isinstance(request, OperatorRequest) and request.force:
            body["force"] = True
        if isinstance(request, MaintenanceRequest):
            body |= {"on": bool(request.on)} | ({"recover": True} if request.recover else {})
        return await self._answer(f"/v1/machines/{_segment(name)}/{route}", body)

    async def recover(self, name: str, request: RecoveryRequest) -> str:
        """Ask the machine of that name for a recovery reboot or a reimage; what happens."""
        route = "reimage" if request.reimage else "recover"
        return await self._answer(f"/v1/machines/{_segment(name)}/{route}", {"reason": request.reason})

    async def reset_host_key(self, name: str, reason: str, by: str = "unknown", expect: str | None = None) -> str:
        """Forget the pinned host key of the machine of that name (only a key with the fingerprint expect is
        pinned next, when given); what happened. by is the API's to say."""
        body = {"reason": reason} | ({"expect_fingerprint": expect} if expect is not None else {})
        return await self._answer(f"/v1/machines/{_segment(name)}/reset-host-key", body)

    async def events_document(self, name: str | None, limit: int, *, actions: bool = False) -> dict[str, Any]:
        """The event log of the machine of that name, or the fleet's, as `shepherd events --json` prints it."""
        params = {"limit": str(limit), "actions": "true" if actions else "false"}
        if name is not None:
            path = f"/v1/machines/{_segment(name)}/events"
        else:
            path = "/v1/events"
            if not actions:
                params["fleet"] = "true"
        return self._document(path, await self.call("GET", path, params=params))

    async def fleet_document(self, provider: str | None, passes: int) -> dict[str, Any]:
        """The fleet schedules (of one provider instance) and their last passes, as `shepherd fleet --json`."""
        params = {"passes": str(passes)} | ({"provider": provider} if provider is not None else {})
        return self._document("/v1/fleet", await self.call("GET", "/v1/fleet", params=params))

    async def fleet_action(self, provider: str, verb: str, body: dict[str, Any], *, passes: int) -> dict[str, Any]:
        """Pause, resume or trigger a provider instance's schedule, or release its held recoveries (verb: the
        path's last part); the schedule after it with its last passes, and the lines saying what was done."""
        path = f"/v1/fleet/{_segment(provider)}/{verb}"
        return self._document(path, await self.call("POST", path, body, params={"passes": str(passes)}))

    async def bulk(self, action: str, body: dict[str, Any]) -> dict[str, Any]:
        """One action on every machine a query selects (or, with dry_run, the machines it would be)."""
        path = f"/v1/bulk/{_segment(action)}"
        return self._document(path, await self.call("POST", path, body))

    def _document(self, path: str, answer: Any) -> dict[str, Any]:
        if not isinstance(answer, dict):
            raise self._malformed(path, "is not a JSON object")
        return answer

    async def _answer(self, path: str, body: dict[str, Any]) -> str:
        answer = await self.call("POST", path, body | ({"confirm": self.confirm} if self.confirm is not None else {}))
        if not isinstance(answer, dict) or not isinstance(answer.get("answer"), str):
            raise self._malformed(path, 'has no "answer" line')
        return str(answer["answer"])

    async def call(self, method: str, path: str, body: Any = None, params: dict[str, str] | None = None) -> Any:
        """One request to the API, as the logged-in operator; its JSON answer, or ApiRefused saying why not."""
        session = await self._open()
        headers = {"Accept": "application/json"}
        if self.settings.api_client_certificate_path is None:
            headers["Authorization"] = f"Bearer {await self._token()}"
        data = None if body is None else json.dumps(body).encode()
        if data is not None:
            headers["Content-Type"] = "application/json"
        url = self.base + path
        try:
            async with session.request(method, url, data=data, headers=headers, params=params) as response:
                raw = await response.content.read(MAX_ANSWER_BYTES + 1)
                status = response.status
        except aiohttp.ClientSSLError as error:
            raise OperatorError(f"the operator API at {self.base} is not who it should be: {error}") from None
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            problem = str(error) or type(error).__name__
            raise OperatorError(f"cannot reach the operator API at {self.base} (api_url): {problem}") from None
        if len(raw) > MAX_ANSWER_BYTES:
            raise self._malformed(path, f"is over {MAX_ANSWER_BYTES} bytes")
        try:
            answer = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise self._malformed(path, f"is not JSON (HTTP {status})") from None
        if status >= 400:
            raise ApiRefused(status, _refusal(status, answer))
        return answer

    async def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
            connector = aiohttp.TCPConnector(ssl=_tls(self.settings))
            self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        return self._session

    async def _token(self) -> str:
        try:
            return await access_token(self.settings)
        except (LoginError, IssuerUnavailable, TokenCacheError) as error:
            raise OperatorError(f"no token for the operator API at {self.base}: {error}") from None

    def _read(self, read: Any, document: Any, path: str) -> Any:
        try:
            return read(document)
        except DocumentError as error:
            raise self._malformed(path, f"does not read: {error}") from None

    def _malformed(self, path: str, problem: str) -> OperatorError:
        return OperatorError(f"the operator API's answer to {path} {problem}; is {self.base} a Shepherd API?")


def _segment(name: str) -> str:
    """A machine name as one path segment, whatever it holds."""
    return quote(name, safe="")


def _refusal(status: int, answer: Any) -> str:
    error = answer.get("error") if isinstance(answer, dict) else None
    text = " ".join(str(error).split()) if error else f"HTTP {status} without a reason"
    if status == 401:
        return f"the operator API refused the login: {text} (run shepherd login)"
    if status == 428:
        return f"{text} (the command takes it as --confirm)"
    return text


def _tls(settings: Settings) -> ssl.SSLContext | bool:
    """How the API's certificate is checked, and the client certificate shown; True: the system's CAs."""
    certificate, key, ca = settings.api_client_certificate_path, settings.api_client_key_path, settings.api_ca_path
    if certificate is None and ca is None:
        return True
    try:
        context = ssl.create_default_context(cafile=str(ca) if ca is not None else None)
    except (ssl.SSLError, OSError) as error:
        raise OperatorError(f"api_ca_path {ca} holds no CA certificate that can be used: {error}") from None
    if certificate is not None and key is not None:
        try:
            context.load_cert_chain(certificate, key)
        except (ssl.SSLError, OSError) as error:
            raise OperatorError(
                f"api_client_certificate_path {certificate} with its key cannot be used: {error}"
            ) from None
    return context
