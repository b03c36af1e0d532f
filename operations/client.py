"""The operator client: every read and request of an operator, in one object over Temporal and BMDB.

The commands reach machines and the fleet through it, and so does the operator API; neither opens Temporal or
BMDB on its own. Use it as ``async with OperatorClient(settings) as operators: ...``. Where settings name an
operator API (api_url), operator_client() gives the commands ApiOperatorClient instead, which asks the same
through the API.
"""

from __future__ import annotations

from typing import Protocol

from foundation.settings import Settings
from lifecycle.contracts import MaintenanceRequest, OperatorRequest, RecoveryRequest
from operations.api_client import ApiOperatorClient
from operations.fleet_control import FleetControl
from operations.machine_actions import MachineActions
from operations.machine_reads import MachineDetail, MachineReads, MachineView


class OperatorClient(MachineReads, MachineActions, FleetControl):
    """An operator's reads and requests, over connections opened as they are first needed."""

    async def __aenter__(self) -> OperatorClient:
        return self


class MachineOperators(Protocol):
    """What a command asks of one machine, whichever way it goes: straight to Temporal and BMDB, or through the
    operator API."""

    async def fleet_view(self) -> list[MachineView]: ...
    async def machine_detail(self, name: str) -> MachineDetail: ...
    async def ask(self, name: str, update: str, request: OperatorRequest | MaintenanceRequest, *, then: str) -> str: ...
    async def recover(self, name: str, request: RecoveryRequest) -> str: ...
    async def reset_host_key(self, name: str, reason: str, by: str = "unknown", expect: str | None = None) -> str: ...
    async def close(self) -> None: ...


def operator_client(settings: Settings, *, break_glass: bool = False, confirm: str | None = None) -> MachineOperators:
    """The operator API's client where settings name one (sending confirm where its policy asks for something typed
    back), else the direct one; break_glass: the direct one always (the way in when the API is down, whose requests
    are recorded unverified)."""
    if settings.api_url and not break_glass:
        return ApiOperatorClient(settings, confirm=confirm)
    return OperatorClient(settings)
