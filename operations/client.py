"""The operator client: every read and request of an operator, in one object over Temporal and BMDB.

The commands reach machines and the fleet through it, and so will the operator API; neither opens Temporal or
BMDB on its own. Use it as ``async with OperatorClient(settings) as operators: ...``.
"""

from __future__ import annotations

from operations.fleet_control import FleetControl
from operations.machine_actions import MachineActions
from operations.machine_reads import MachineReads


class OperatorClient(MachineReads, MachineActions, FleetControl):
    """An operator's reads and requests, over connections opened as they are first needed."""

    async def __aenter__(self) -> OperatorClient:
        return self
