"""What every BMC's power control shares, whatever it speaks: the timeouts, the report, the errors, the turns.

Redfish (providers.redfish) and IPMI (providers.ipmi) both confirm a power change by reading the power state
back, wait as long as these timeouts say, and take turns at one BMC within a process.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from providers import ProviderError, ProviderUnavailable


@dataclass(frozen=True)
class PowerTimeouts:
    """How long to wait for the BMC and for the machine, in seconds."""

    connect: float = 5.0  # Redfish: the TCP connect; IPMI: the whole login (RMCP+ session)
    read: float = 30.0  # Redfish: one HTTP answer (pyghmi retries an IPMI request on its own schedule)
    graceful: float = 120.0  # how long the OS may take to shut down gracefully before the power is forced off
    power_back: float = 120.0  # how long a forced change (off, on) may take to show in the power state
    poll: float = 2.0  # between power state reads


@dataclass(frozen=True)
class PowerReport:
    """What a probe or a reboot saw: the system (a Redfish path, an IPMI BMC's address), its power state, what was
    done."""

    system: str
    power_state: str
    detail: str = ""


class BmcUnavailable(ProviderUnavailable):
    """The BMC did not answer, timed out, or answered with a server error or that it is busy."""


class BmcCredentialsRejected(ProviderError):
    """The BMC refused the username and password; trying again will not change its mind."""

    retryable = False


class RebootNotConfirmed(ProviderError):
    """The BMC took the power change, but the machine did not go off and come back on in time."""


class PowerOffNotConfirmed(ProviderError):
    """The BMC took the shutdown, but the machine did not show off in time."""


# asyncio locks belong to one event loop once contended, so each loop gets its own set.
_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Lock]] = weakref.WeakKeyDictionary()


def bmc_lock(bmc: str) -> asyncio.Lock:
    """The lock every use of the BMC (its URL or address) holds in this process: BMCs serve one client at a time
    best and have few sessions."""
    per_loop = _locks.setdefault(asyncio.get_running_loop(), {})
    return per_loop.setdefault(bmc.rstrip("/").lower(), asyncio.Lock())


async def power_reaches(reached: Callable[[], Awaitable[bool]], within: float, poll: float) -> bool:
    """Read the power state (reached reads it and says whether it is the one waited for) until it is (True), or
    `within` seconds passed (False)."""
    deadline = time.monotonic() + within
    while True:
        if await reached():
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        await asyncio.sleep(min(poll, left))


def not_off(
    provider: str,
    machine: str,
    sent: Sequence[str],
    timeouts: PowerTimeouts,
    bmc: str,
    unconfirmed: type[ProviderError],
) -> ProviderError:
    """The error of a machine that did not show off after what was sent."""
    return unconfirmed(
        provider,
        f"{machine} did not power off after {', then '.join(sent)} "
        f"(waited {timeouts.graceful:g}s, {timeouts.power_back:g}s once forced; {bmc})",
    )


def not_back_on(
    provider: str, machine: str, before: str, sent: str, timeouts: PowerTimeouts, bmc: str
) -> ProviderError:
    """The error of a machine that did not show on again within power_back of what was sent to power it on."""
    return RebootNotConfirmed(
        provider,
        f"{machine} {before} and did not come back on within {timeouts.power_back:g}s of {sent} ({bmc})",
    )


def leaks(password: str, text: str) -> bool:
    """Whether a library's message holds the BMC password, so it must not travel on as an exception's cause."""
    return bool(password) and password in text


def scrubbed(password: str, text: str) -> str:
    """A library's message with the BMC password, if it holds it, replaced by stars."""
    return text.replace(password, "***") if password else text
