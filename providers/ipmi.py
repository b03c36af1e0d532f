"""IPMI power control of one machine's BMC, through pyghmi.

IPMI 2.0 over the LAN ("lanplus": an RMCP+ session, authenticated and encrypted), on UDP, port 623 by default.
pyghmi is blocking, so each of its calls runs in a thread. As with Redfish, within one process every use of a
BMC waits for the previous one, and each use logs out when it is done: BMCs allow only a few sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from pyghmi import exceptions as pyghmi_exc
from pyghmi.ipmi.command import Command

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

DEFAULT_PORT = 623
_ON, _OFF = "on", "off"
# pyghmi's words when the BMC refused the login or the user's privilege (RAKP and completion-code texts).
_REFUSED = (
    "Incorrect password",
    "Unauthorized name",
    "Invalid username length",
    "Unauthorized role",
    "Invalid role",
    "Insufficient privilege",
    "RAKP4 integrity code",
    "while requesting privelege level",  # pyghmi's spelling
)
# pyghmi's words when the BMC did not answer, dropped the session, or is busy; asking again later is the cure.
_UNANSWERED = (
    "timeout",
    "Timeout",
    "no longer connected",
    "failed to initialize",
    "Session Disconnected",
    "Unable to transmit",
    "Insufficient resources",
    "Node Busy",
    "initialization in progress",
    "response could not be provided",
)
# What pyghmi raises, besides its own exceptions, on an answer it cannot take apart (it unpacks with struct and
# checks with assert).
_MALFORMED = (struct.error, AssertionError, IndexError, KeyError, TypeError, ValueError)


@dataclass(frozen=True)
class IpmiEndpoint:
    """Where and how to reach one machine's IPMI BMC; the password never shows in repr, logs or messages."""

    machine: str  # the provider id, for messages
    host: str  # a host name or an IP address
    username: str
    password: str = field(repr=False)
    port: int = DEFAULT_PORT

    @property
    def address(self) -> str:
        """host:port, an IPv6 address in brackets."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class IpmiPowerControl:
    """Probes, reboots and powers off one machine through its BMC's IPMI (chassis status and chassis control)."""

    def __init__(self, provider: str, endpoint: IpmiEndpoint, timeouts: PowerTimeouts = PowerTimeouts()) -> None:
        self._provider = provider
        self._endpoint = endpoint
        self._timeouts = timeouts
        self._where = f"IPMI BMC {endpoint.address} of {endpoint.machine}"
        self._bmc = f"IPMI BMC {endpoint.address}"

    async def probe(self) -> PowerReport:
        """Whether the BMC answers and takes the credentials; the machine's power state."""
        async with self._session() as bmc:
            return PowerReport(self._endpoint.address, _state_name(await self._read_power(bmc)))

    async def reboot(self) -> PowerReport:
        """Power-cycle the machine, or power it on if it is off, and wait until it is back on.

        IPMI's own power cycle and hard reset leave the power state on, so they cannot be confirmed; an explicit off
        and on can: a soft off (the OS shuts down on the ACPI request), a hard off if it is not off in time, then on.
        """
        async with self._session() as bmc:
            if await self._read_power(bmc) == _OFF:
                return await self._power_on(bmc)
            started = time.monotonic()
            sent, off_after = await self._shut_down(bmc, RebootNotConfirmed)
            report = await self._power_on(bmc, started, before=f"went off after {', then '.join(sent)}")
            return replace(report, detail=f"{'; '.join(sent)}; off after {off_after:.0f}s; {report.detail}")

    async def power_off(self) -> PowerReport:
        """Power the machine off for good: a soft off, a hard off if the OS does not shut down in time; confirmed by
        reading the power state back off. A machine that is off already is left so."""
        async with self._session() as bmc:
            if await self._read_power(bmc) == _OFF:
                return PowerReport(self._endpoint.address, _state_name(_OFF), "was off already")
            sent, off_after = await self._shut_down(bmc, PowerOffNotConfirmed)
            return PowerReport(
                self._endpoint.address, _state_name(_OFF), f"{'; '.join(sent)}; off after {off_after:.0f}s"
            )

    async def _shut_down(self, bmc: Any, unconfirmed: type[ProviderError]) -> tuple[list[str], float]:
        """A soft off, and a hard off if that is not enough, until the power state reads off: (what was sent,
        seconds until it was off)."""
        started = time.monotonic()
        sent = ["soft off"]
        await self._set_power(bmc, "shutdown")
        went_off = await self._wait_for(bmc, _OFF, self._timeouts.graceful)
        if not went_off:
            # The OS ignored the ACPI request or hung in its shutdown.
            sent.append(f"hard off after {time.monotonic() - started:.0f}s")
            await self._set_power(bmc, "off")
            went_off = await self._wait_for(bmc, _OFF, self._timeouts.power_back)
        if not went_off:
            raise not_off(self._provider, self._endpoint.machine, sent, self._timeouts, self._bmc, unconfirmed)
        return sent, time.monotonic() - started

    async def _power_on(self, bmc: Any, started: float | None = None, before: str = "was off") -> PowerReport:
        started = time.monotonic() if started is None else started
        await self._set_power(bmc, _ON)
        if not await self._wait_for(bmc, _ON, self._timeouts.power_back):
            raise not_back_on(self._provider, self._endpoint.machine, before, "power on", self._timeouts, self._bmc)
        return PowerReport(self._endpoint.address, _state_name(_ON), f"on; on after {time.monotonic() - started:.0f}s")

    async def _set_power(self, bmc: Any, state: str) -> None:
        LOG.info("sending chassis control %s to %s", state, self._where)
        await self._call(lambda: bmc.set_power(state))

    async def _read_power(self, bmc: Any) -> str:
        """The chassis power state, on or off."""
        answer = await self._call(bmc.get_power)
        state = answer.get("powerstate") if isinstance(answer, dict) else None
        if state not in (_ON, _OFF):
            raise ProviderProtocolError(self._provider, f"{self._where} answered power state {answer!r}")
        return str(state)

    async def _wait_for(self, bmc: Any, state: str, within: float) -> bool:
        """Read the power state until it is state (True) or `within` seconds passed (False)."""

        async def reached() -> bool:
            return await self._read_power(bmc) == state

        return await power_reaches(reached, within, self._timeouts.poll)

    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[Any]:
        """A logged-in pyghmi Command of the BMC, held alone among this process's uses of the BMC."""
        async with bmc_lock(f"ipmi://{self._endpoint.address}"):
            bmc = await self._call(self._log_in)
            try:
                yield bmc
            finally:
                # Logging out ends the BMC session; BMCs allow only a handful at a time.
                await asyncio.to_thread(self._log_out, bmc)

    def _log_in(self) -> Any:
        """A pyghmi Command logged in to the BMC within the connect timeout; runs in a thread.

        The login is asynchronous, driven here until its answer, because pyghmi's own waiting one has no end when a
        BMC drops the login halfway (it starts the login again each time its retry timer fires).
        """
        endpoint = self._endpoint
        answers: list[dict[str, Any]] = []
        bmc = Command(
            bmc=endpoint.host,
            port=endpoint.port,
            # Bytes: pyghmi keeps the logins it has under way keyed by the credentials as given, and forgets them
            # by their bytes; given text, it hands a later login of the same user this one's dead session.
            userid=endpoint.username.encode(),
            password=endpoint.password.encode(),
            onlogon=lambda answer, _command: answers.append(answer),
        )
        deadline = time.monotonic() + self._timeouts.connect
        try:
            while not answers:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BmcUnavailable(
                        self._provider, f"{self._where} did not answer the login within {self._timeouts.connect:g}s"
                    )
                # Short waits: another thread's pyghmi call may take the answer off the socket and hand it over.
                Command.wait_for_rsp(min(left, 0.1))
        except BaseException:
            # A login given up on would go on being retried by whichever thread waits on pyghmi next; before it is
            # logged in, a session's logout sends nothing and stops that.
            self._log_out(bmc)
            raise
        if "error" in answers[0]:
            raise pyghmi_exc.IpmiException(answers[0]["error"])
        return bmc

    def _log_out(self, bmc: Any) -> None:
        try:
            bmc.ipmi_session.logout()
        except (pyghmi_exc.PyghmiException, OSError, *_MALFORMED) as exc:
            LOG.warning(
                "could not log out of %s: %s", self._where, foreign_text(scrubbed(self._endpoint.password, str(exc)))
            )

    async def _call(self, call: Callable[[], T]) -> T:
        """Run one blocking pyghmi call in a thread, its errors as ProviderErrors."""
        try:
            return await asyncio.to_thread(call)
        except (pyghmi_exc.PyghmiException, OSError, *_MALFORMED) as exc:
            error = self._translate(exc)
            # A cause whose text carries the password must not reach a traceback.
            raise error from (None if leaks(self._endpoint.password, str(exc)) else exc)

    def _translate(self, exc: BaseException) -> ProviderError:
        if isinstance(exc, _MALFORMED):
            return ProviderProtocolError(
                self._provider,
                f"{self._where} answered what IPMI does not promise, and pyghmi could not take it apart: "
                f"{scrubbed(self._endpoint.password, str(exc)) or type(exc).__name__}",
            )
        if isinstance(exc, OSError):
            return BmcUnavailable(
                self._provider, f"{self._where} is unavailable: {scrubbed(self._endpoint.password, str(exc))}"
            )
        # pyghmi gives up on a silent BMC with an IpmiException without words (its text is then "None").
        said = scrubbed(self._endpoint.password, str(exc.args[0])) if exc.args and exc.args[0] else ""
        if any(words in said for words in _REFUSED):
            return BmcCredentialsRejected(
                self._provider,
                f"{self._where} refused user {self._endpoint.username!r} ({said}); "
                f"check the BMC credentials of {self._endpoint.machine}",
            )
        if not isinstance(exc, pyghmi_exc.BmcErrorException) and (
            not said or any(words in said for words in _UNANSWERED)
        ):
            return BmcUnavailable(self._provider, f"{self._where} is unavailable: {said or 'no answer'}")
        return ProviderProtocolError(
            self._provider, f"{self._where} answered what IPMI does not promise: {said or type(exc).__name__}"
        )


def _state_name(state: str) -> str:
    """On or Off, as Redfish words them, so reports read the same whatever the BMC speaks."""
    return state.capitalize()
