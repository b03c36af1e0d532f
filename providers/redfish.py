"""Redfish power control of one machine's BMC, through sushy.

sushy is blocking, so each of its calls runs in a thread. BMCs have few
sessions and serve concurrent clients badly: within one process every use of a
BMC waits for the previous one, and each use logs out when it is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import sushy
from sushy import auth as sushy_auth
from sushy import exceptions as sushy_exc
from sushy.resources.constants import PowerState, ResetType

from foundation.foreign_text import foreign_text
from providers import ProviderError, ProviderProtocolError
from providers.power import (
    BmcCredentialsRejected,
    BmcUnavailable,
    PowerOffNotConfirmed,
    PowerReport,
    PowerTimeouts,
    RebootNotConfirmed,
    bmc_lock,
    leaks,
    not_back_on,
    not_off,
    power_reaches,
    scrubbed,
)

LOG = logging.getLogger(__name__)

T = TypeVar("T")

# 409 and 429: the BMC is busy with another request; asking again later is the cure.
_BUSY_STATUSES = frozenset({409, 429})
# PoweringOn counts as having been off: a fast machine may be past Off by the time we look.
_DOWN = frozenset({PowerState.OFF, PowerState.POWERING_ON})
_UP = frozenset({PowerState.ON})
_OFF = frozenset({PowerState.OFF})


@dataclass(frozen=True)
class RedfishEndpoint:
    """Where and how to reach one machine's BMC; the password never shows in repr, logs or messages."""

    machine: str  # the provider id, for messages
    url: str  # BMC base URL, e.g. https://10.0.1.11
    username: str
    password: str = field(repr=False)
    system: str | None = None  # e.g. /redfish/v1/Systems/1; None: the BMC must have exactly one system
    verify: bool | str = True  # True, False, or a CA file path (sushy's verify)


class BmcSystemUnknown(ProviderError):
    """The BMC has no such system, or several and the endpoint does not say which one is the machine."""

    retryable = False


def _state_name(state: PowerState | None) -> str:
    return state.value if state is not None else "Unknown"


class RedfishPowerControl:
    """Probes and reboots one machine through its BMC's Redfish API."""

    def __init__(self, provider: str, endpoint: RedfishEndpoint, timeouts: PowerTimeouts = PowerTimeouts()) -> None:
        self._provider = provider
        self._endpoint = endpoint
        self._timeouts = timeouts
        self._where = f"BMC {endpoint.url} of {endpoint.machine}"
        self._bmc = f"BMC {endpoint.url}"

    async def probe(self) -> PowerReport:
        """Whether the BMC answers, takes the credentials and has the system; its power state."""
        async with self._session() as root:
            system = await self._call(lambda: self._open_system(root))
            return PowerReport(system.path, _state_name(system.power_state))

    async def reboot(self) -> PowerReport:
        """Power-cycle the machine, or power it on if it is off, and wait until it is back on.

        A warm GracefulRestart or ForceRestart leaves PowerState On on many BMCs (iDRAC, iLO), so it cannot be
        confirmed; an explicit off and on can. The restart types serve only a BMC that allows no ForceOff and On.
        """
        async with self._session() as root:
            system = await self._call(lambda: self._open_system(root))
            allowed = await self._call(system.get_allowed_reset_system_values)
            if system.power_state == PowerState.OFF:
                return await self._power_on(system, allowed)
            if ResetType.FORCE_OFF in allowed and (ResetType.ON in allowed or ResetType.FORCE_ON in allowed):
                return await self._power_cycle(system, allowed)
            return await self._restart(system, allowed)

    async def power_off(self) -> PowerReport:
        """Power the machine off for good: gracefully when the BMC allows it and the OS shuts down in time, else by
        force; confirmed by reading the power state back Off. A machine that is off already is left so."""
        async with self._session() as root:
            system = await self._call(lambda: self._open_system(root))
            if system.power_state == PowerState.OFF:
                return PowerReport(system.path, PowerState.OFF.value, "was off already")
            allowed = await self._call(system.get_allowed_reset_system_values)
            sent, off_after = await self._shut_down(system, allowed, _OFF, PowerOffNotConfirmed)
            return PowerReport(system.path, PowerState.OFF.value, f"{'; '.join(sent)}; off after {off_after:.0f}s")

    async def _power_cycle(self, system: Any, allowed: Collection[ResetType]) -> PowerReport:
        started = time.monotonic()
        sent, off_after = await self._shut_down(system, allowed, _DOWN, RebootNotConfirmed)
        report = await self._power_on(system, allowed, started, before=f"went off after {', then '.join(sent)}")
        return replace(report, detail=f"{'; '.join(sent)}; off after {off_after:.0f}s; {report.detail}")

    async def _shut_down(
        self,
        system: Any,
        allowed: Collection[ResetType],
        down: frozenset[PowerState],
        unconfirmed: type[ProviderError],
    ) -> tuple[list[str], float]:
        """GracefulShutdown if allowed, ForceOff if that is not enough, until the power state is one of down:
        (the resets sent, seconds until it was)."""
        started = time.monotonic()
        sent: list[str] = []
        went_off = False
        if ResetType.GRACEFUL_SHUTDOWN in allowed:
            sent.append(ResetType.GRACEFUL_SHUTDOWN.value)
            await self._reset(system, ResetType.GRACEFUL_SHUTDOWN)
            went_off = await self._wait_for(system, down, self._timeouts.graceful)
        if not went_off:
            # No graceful way, or the OS ignored or hung in its shutdown.
            forced = self._pick(allowed, ResetType.FORCE_OFF)
            sent.append(f"ForceOff after {time.monotonic() - started:.0f}s" if sent else forced.value)
            await self._reset(system, forced)
            went_off = await self._wait_for(system, down, self._timeouts.power_back)
        if not went_off:
            raise not_off(self._provider, self._endpoint.machine, sent, self._timeouts, self._bmc, unconfirmed)
        return sent, time.monotonic() - started

    async def _power_on(
        self, system: Any, allowed: Collection[ResetType], started: float | None = None, before: str = "was off"
    ) -> PowerReport:
        reset = self._pick(allowed, ResetType.ON, ResetType.FORCE_ON)
        started = time.monotonic() if started is None else started
        await self._reset(system, reset)
        if not await self._wait_for(system, _UP, self._timeouts.power_back):
            raise not_back_on(self._provider, self._endpoint.machine, before, reset.value, self._timeouts, self._bmc)
        return PowerReport(
            system.path, PowerState.ON.value, f"{reset.value}; on after {time.monotonic() - started:.0f}s"
        )

    async def _restart(self, system: Any, allowed: Collection[ResetType]) -> PowerReport:
        first = self._pick(allowed, ResetType.GRACEFUL_RESTART, ResetType.FORCE_RESTART)
        started = time.monotonic()
        sent = [first.value]
        await self._reset(system, first)
        went_off = await self._wait_for(system, _DOWN, self._timeouts.graceful)
        if not went_off and first is ResetType.GRACEFUL_RESTART and ResetType.FORCE_RESTART in allowed:
            # The OS ignored or hung in its shutdown; a forced reset gets as long to show Off as the graceful one had.
            sent.append(f"ForceRestart after {time.monotonic() - started:.0f}s")
            await self._reset(system, ResetType.FORCE_RESTART)
            went_off = await self._wait_for(system, _DOWN, self._timeouts.graceful)
        if not went_off:
            raise RebootNotConfirmed(
                self._provider,
                f"{self._endpoint.machine} did not power off within {self._timeouts.graceful:g}s "
                f"of {', then '.join(sent)} ({self._bmc})",
            )
        off_after = time.monotonic() - started
        if not await self._wait_for(system, _UP, self._timeouts.power_back):
            raise RebootNotConfirmed(
                self._provider,
                f"{self._endpoint.machine} went off after {', then '.join(sent)} but did not come back on "
                f"within {self._timeouts.power_back:g}s ({self._bmc})",
            )
        on_after = time.monotonic() - started
        return PowerReport(
            system.path, PowerState.ON.value, f"{'; '.join(sent)}; off after {off_after:.0f}s, on after {on_after:.0f}s"
        )

    def _pick(self, allowed: Collection[ResetType], *preferred: ResetType) -> ResetType:
        for reset in preferred:
            if reset in allowed:
                return reset
        raise ProviderProtocolError(
            self._provider,
            f"{self._where} allows none of {', '.join(r.value for r in preferred)} "
            f"(it allows: {', '.join(sorted(r.value for r in allowed)) or 'nothing'})",
        )

    async def _reset(self, system: Any, reset: ResetType) -> None:
        LOG.info("sending %s to %s", reset.value, self._where)
        await self._call(lambda: system.reset_system(reset))

    async def _wait_for(self, system: Any, states: frozenset[PowerState], within: float) -> bool:
        """Read PowerState until it is one of states (True) or `within` seconds passed (False)."""

        async def reached() -> bool:
            return await self._call(lambda: self._read_power(system)) in states

        return await power_reaches(reached, within, self._timeouts.poll)

    @staticmethod
    def _read_power(system: Any) -> PowerState | None:
        system.refresh(force=True)
        return system.power_state

    def _open_system(self, root: Any) -> Any:
        """The endpoint's system, or the BMC's only one; runs in a thread."""
        path = self._endpoint.system
        if path is None:
            members = list(root.get_system_collection().members_identities)
            if len(members) != 1:
                raise BmcSystemUnknown(
                    self._provider,
                    f"{self._where} has {len(members)} systems ({', '.join(members) or 'none'}); "
                    f"set the system of {self._endpoint.machine} to one of them",
                )
            path = members[0]
        try:
            return root.get_system(path)
        except sushy_exc.ResourceNotFoundError:
            pass
        raise BmcSystemUnknown(
            self._provider, f"{self._where} has no system {path}; it has: {self._list_systems(root)}"
        )

    @staticmethod
    def _list_systems(root: Any) -> str:
        try:
            return ", ".join(root.get_system_collection().members_identities) or "none"
        except (sushy_exc.SushyError, ValueError):
            return "(it did not list them)"

    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[Any]:
        """A logged-in sushy root of the BMC, held alone among this process's uses of the BMC."""
        endpoint = self._endpoint
        async with bmc_lock(endpoint.url):
            auth = sushy_auth.SessionOrBasicAuth(username=endpoint.username, password=endpoint.password)
            try:
                yield await self._call(
                    lambda: sushy.Sushy(
                        endpoint.url,
                        auth=auth,
                        verify=endpoint.verify,
                        connect_timeout=self._timeouts.connect,
                        read_timeout=self._timeouts.read,
                        # sushy retries a failing BMC 10 times 3 s apart by default; the activity's retry
                        # policy is the place for patience. 0 would mean sushy's default of 3 tries.
                        server_side_retries=1,
                        server_side_retries_delay=1,
                    )
                )
            finally:
                # Logging out ends the BMC session; BMCs allow only a handful at a time.
                await asyncio.to_thread(self._logout, auth)

    def _logout(self, auth: Any) -> None:
        try:
            auth.close()
        except (sushy_exc.SushyError, ValueError) as exc:
            LOG.warning(
                "could not log out of %s: %s", self._where, foreign_text(scrubbed(self._endpoint.password, str(exc)))
            )

    async def _call(self, call: Callable[[], T]) -> T:
        """Run one blocking sushy call in a thread, its errors as ProviderErrors."""
        try:
            return await asyncio.to_thread(call)
        except (sushy_exc.SushyError, ValueError) as exc:
            error = self._translate(exc)
            # A cause whose text carries the password must not reach a traceback.
            raise error from (None if leaks(self._endpoint.password, str(exc)) else exc)

    def _translate(self, exc: Exception) -> ProviderError:
        cause = scrubbed(self._endpoint.password, str(exc))
        status = getattr(exc, "status_code", None)
        if isinstance(exc, sushy_exc.AccessError):
            return BmcCredentialsRejected(
                self._provider,
                f"{self._where} refused user {self._endpoint.username!r} (HTTP {status}); "
                f"check the BMC credentials of {self._endpoint.machine}",
            )
        if isinstance(exc, sushy_exc.ConnectionError | sushy_exc.ServerSideError) or (
            isinstance(exc, sushy_exc.HTTPError) and status in _BUSY_STATUSES
        ):
            return BmcUnavailable(self._provider, f"{self._where} is unavailable: {cause}")
        return ProviderProtocolError(self._provider, f"{self._where} answered what Redfish does not promise: {cause}")
