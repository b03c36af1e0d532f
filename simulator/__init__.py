"""The fleet simulator: a bare-metal provider that runs on one machine.

An HTTP provider API (list machines and free capacity, create a machine from
capacity with an idempotency key, get, reboot, reimage) and one real SSH server
per created machine. Fault knobs make it misbehave on purpose.
"""

from simulator.server import Simulator
from simulator.state import Faults, SimulatorConfig

__all__ = ["Faults", "Simulator", "SimulatorConfig"]
