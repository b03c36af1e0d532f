"""The machine workflow: MachineWorkflow (workflow), its step engine and state (run), its flows besides the
bring-up (flows), the activities it runs (activities) and what the Temporal UI shows of it (details)."""

from workflows.machine.run import STEP_ATTEMPTS_PER_RUN
from workflows.machine.workflow import MachineWorkflow

__all__ = ["STEP_ATTEMPTS_PER_RUN", "MachineWorkflow"]
