"""The provider client for the simulator's HTTP API.

It does not retry: the activity that calls it owns retries. It maps every
failure to a ProviderError that names the call, the URL and the problem.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any
from urllib.parse import quote

import aiohttp

from foundation.provider_instances import ProviderInstance
from foundation.setting_values import SettingsError
from foundation.settings import Settings
from providers import (
    Availability,
    CapacityConflict,
    MachineNotFound,
    ProviderMachine,
    ProviderProtocolError,
    ProviderUnavailable,
    Rebooted,
    Reimaged,
    RetireAction,
    Retired,
)
from providers.registry import duration_option, unknown_options

PROVIDER_TYPE = "sim"

_ID = re.compile(r"node-\d{4,}")


def parse_machine(data: Any, where: str, provider: str = PROVIDER_TYPE) -> ProviderMachine:
    """A ProviderMachine from one JSON machine object; ProviderProtocolError naming the bad field."""

    def bad(field: str, wanted: str) -> ProviderProtocolError:
        value = data.get(field) if isinstance(data, dict) else data
        return ProviderProtocolError(provider, f"{where}: field {field!r} must be {wanted}, got {value!r}")

    if not isinstance(data, dict):
        raise bad("machine", "an object")
    if not isinstance(data.get("id"), str) or not data["id"]:
        raise bad("id", "a non-empty string")
    try:
        availability = Availability(str(data.get("availability")))
    except ValueError:
        raise bad("availability", f"one of {', '.join(a.value for a in Availability)}") from None
    address = data.get("address")
    if address is not None and not isinstance(address, str):
        raise bad("address", "a string or null")
    port = data.get("ssh_port")
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536):
        raise bad("ssh_port", "a port number or null")
    for name in ("location", "status"):
        if data.get(name) is not None and not isinstance(data[name], str):
            raise bad(name, "a string or null")
    return ProviderMachine(
        provider_id=data["id"],
        availability=availability,
        address=address,
        ssh_port=port or 22,
        location=data.get("location"),
        status=data.get("status"),
    )


def parse_last_reset(data: Any, where: str, provider: str = PROVIDER_TYPE) -> datetime | None:
    """When the machine of one JSON machine object was last reset (its last_reset_at), None if never;
    ProviderProtocolError naming the bad field."""
    parse_machine(data, where, provider)
    value = data.get("last_reset_at")
    if value is None:
        return None
    try:
        at = datetime.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        at = None
    if at is None or at.tzinfo is None:
        raise ProviderProtocolError(
            provider,
            f"{where}: field 'last_reset_at' must be an ISO 8601 time with its zone or null, got {str(value)[:80]!r}",
        )
    return at


class SimProvider:
    """The Provider of the simulator, a client of its HTTP API at api_url."""

    def __init__(self, api_url: str, *, name: str = PROVIDER_TYPE, timeout: float = 10.0) -> None:
        self.name = name
        self.api_url = api_url.rstrip("/")
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    def is_valid_id(self, provider_id: str) -> bool:
        """Whether provider_id has the simulator's form, node- and four or more digits."""
        return _ID.fullmatch(provider_id) is not None

    async def close(self) -> None:
        """Close the HTTP session, if one was opened."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _request(self, call: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """(status, parsed JSON) of one call; 5xx, timeouts and connection errors raise ProviderUnavailable."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        url = self.api_url + path
        where = f"{call} ({method} {url})"
        try:
            async with self._session.request(method, url, json=body) as response:
                text = await response.text()
                status = response.status
        except TimeoutError:
            raise ProviderUnavailable(self.name, f"{where}: no answer within {self.timeout:g}s") from None
        except aiohttp.ClientError as error:
            raise ProviderUnavailable(self.name, f"{where}: {error or type(error).__name__}") from None
        if status >= 500:
            raise ProviderUnavailable(self.name, f"{where}: server error {status}: {text[:200]}")
        try:
            return status, json.loads(text)
        except ValueError:
            raise ProviderProtocolError(self.name, f"{where}: answer {status} is not JSON: {text[:80]!r}") from None

    @staticmethod
    def _error_text(payload: Any) -> str:
        if isinstance(payload, dict) and isinstance(payload.get("error"), str):
            return str(payload["error"])
        return repr(payload)[:200]

    def _unexpected(self, where: str, status: int, payload: Any) -> ProviderProtocolError:
        return ProviderProtocolError(self.name, f"{where}: answer {status}: {self._error_text(payload)}")

    def _machine_path(self, provider_id: str) -> str:
        """The API path of one machine. An id of another form names no machine here, and must not name another
        path ("../admin/faults?"): it is refused before any request, and the segment is quoted all the same."""
        if not self.is_valid_id(provider_id):
            raise MachineNotFound(self.name, provider_id[:100])
        return f"/v1/machines/{quote(provider_id, safe='')}"

    async def list_machines(self) -> list[ProviderMachine]:
        """Every machine and free slot the simulator lists."""
        where = "list machines"
        status, payload = await self._request(where, "GET", "/v1/machines")
        if status != 200:
            raise self._unexpected(where, status, payload)
        if not isinstance(payload, dict) or not isinstance(payload.get("machines"), list):
            raise ProviderProtocolError(self.name, f"{where}: field 'machines' must be a list")
        return [parse_machine(item, where, self.name) for item in payload["machines"]]

    async def get_machine(self, provider_id: str) -> ProviderMachine:
        """The simulator's machine of that id; MachineNotFound when it has none."""
        return parse_machine(await self._machine_payload(provider_id), f"get machine {provider_id}", self.name)

    async def _machine_payload(self, provider_id: str) -> Any:
        where = f"get machine {provider_id}"
        status, payload = await self._request(where, "GET", self._machine_path(provider_id))
        if status == 404:
            raise MachineNotFound(self.name, provider_id)
        if status != 200:
            raise self._unexpected(where, status, payload)
        return payload

    async def create_machine(self, provider_id: str, idempotency_key: str, ssh_public_key: str) -> ProviderMachine:
        """Create a machine in the free slot provider_id, idempotently by key; CapacityConflict if it is taken."""
        where = f"create machine {provider_id}"
        body = {"capacity_id": provider_id, "idempotency_key": idempotency_key, "ssh_public_key": ssh_public_key}
        status, payload = await self._request(where, "POST", "/v1/machines", body)
        if status == 404:
            raise MachineNotFound(self.name, provider_id)
        if status == 409:
            raise CapacityConflict(self.name, f"{where}: {self._error_text(payload)}")
        if status not in (200, 201):
            raise self._unexpected(where, status, payload)
        return parse_machine(payload, where, self.name)

    async def reboot_machine(self, provider_id: str) -> Rebooted:
        """Reboot the machine; the simulator answers once its SSH is down for the boot."""
        where = f"reboot machine {provider_id}"
        status, payload = await self._request(where, "POST", self._machine_path(provider_id) + "/reboot")
        if status == 404:
            raise MachineNotFound(self.name, provider_id)
        if status != 202:
            raise self._unexpected(where, status, payload)
        # The simulator answers once the machine's SSH is down for the boot.
        return Rebooted(went_down=True, detail="the simulator took SSH down for the boot")

    async def last_reset(self, provider_id: str) -> datetime | None:
        """When the simulator last rebooted or reimaged the machine (its last_reset_at), None if never."""
        return parse_last_reset(await self._machine_payload(provider_id), f"get machine {provider_id}", self.name)

    async def reimage_machine(self, provider_id: str, ssh_public_key: str) -> Reimaged:
        """Reimage the machine with ssh_public_key for root; the simulator answers once its SSH is down for the boot.

        Asked again while that boot is under way, with the same key, the simulator starts no second reimage.
        """
        where = f"reimage machine {provider_id}"
        body = {"ssh_public_key": ssh_public_key}
        status, payload = await self._request(where, "POST", self._machine_path(provider_id) + "/reimage", body)
        if status == 404:
            raise MachineNotFound(self.name, provider_id)
        if status != 202:
            raise self._unexpected(where, status, payload)
        return Reimaged(detail="the simulator wiped the disk, made a new host key, installed the key and is booting")

    async def retire_machine(self, provider_id: str) -> Retired:
        """Release the machine to the simulator, which wipes it and frees its slot; untouched if gone already."""
        where = f"release machine {provider_id}"
        status, payload = await self._request(where, "DELETE", self._machine_path(provider_id))
        if status == 404:
            return Retired(RetireAction.UNTOUCHED, f"the simulator holds no machine {provider_id}: released already")
        if status != 200:
            raise self._unexpected(where, status, payload)
        return Retired(RetireAction.RELEASED, f"the simulator wiped {provider_id} and freed its slot")


def from_settings(instance: ProviderInstance, settings: Settings) -> SimProvider:
    """The shepherd.providers entry point: options api_url (default the sim_api_url setting) and timeout."""
    unknown_options(instance, ("api_url", "timeout"))
    api_url = instance.options.get("api_url", settings.sim_api_url)
    if not isinstance(api_url, str) or not api_url.startswith(("http://", "https://")):
        raise SettingsError("providers", f"instance {instance.name!r}: api_url must be an http(s) URL, got {api_url!r}")
    timeout = duration_option(instance, "timeout", settings.provider_timeout)
    return SimProvider(api_url, name=instance.name, timeout=timeout)
