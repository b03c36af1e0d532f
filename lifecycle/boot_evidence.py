"""Whether a machine was reset since a moment, for a recovery whose reboot was asked and never answered (its worker
died with the call under way): from the provider's own record where it keeps one (providers.KnowsResets), else
from the machine itself, whose uptime over SSH says when it booted.

A machine needs nothing for it but SSH and /proc: `cat /proc/uptime` is read by the shell of any Linux machine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import asyncssh

from foundation.ssh_sessions import SSHSession
from lifecycle.machine_text import machine_text
from lifecycle.takeover_failures import TakeoverError, TakeoverTarget, session_failures

UPTIME_COMMAND = "cat /proc/uptime"

READING_UPTIME = "reading the machine's uptime"

# /proc/uptime is one short line: "seconds-up seconds-idle".
MAX_UPTIME_REPLY = 200

# How far a boot may seem to come before the reboot was asked and still count as its boot: the clocks of the
# worker that noted the ask, the provider and this worker differ by this much at most, and no machine boots faster.
CLOCK_ALLOWANCE = timedelta(seconds=5)


class ResetSeen(enum.Enum):
    """What the evidence says of a reboot asked at a moment."""

    # The machine was reset (or booted) after the reboot was asked: that reboot happened.
    RESET = "reset"
    # The machine runs since before the reboot was asked: the reboot never reached it.
    NOT_RESET = "not reset"
    # Nothing says: the machine does not answer (down, booting, hung) or its answer is unreadable.
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class ResetEvidence:
    """What was seen, and where from, in a line an operator reads in the log."""

    seen: ResetSeen
    detail: str


def judge_reset(reset_at: datetime | None, asked_at: datetime, source: str) -> ResetEvidence:
    """The evidence of a last reset (or boot) time that source gave, for a reboot asked at asked_at."""
    if reset_at is None:
        return ResetEvidence(ResetSeen.NOT_RESET, f"{source}: never reset")
    if reset_at >= asked_at - CLOCK_ALLOWANCE:
        return ResetEvidence(ResetSeen.RESET, f"{source}: reset at {reset_at.isoformat(timespec='seconds')}")
    return ResetEvidence(
        ResetSeen.NOT_RESET, f"{source}: last reset at {reset_at.isoformat(timespec='seconds')}, before the ask"
    )


def parse_uptime(reply: bytes) -> float:
    """The seconds since boot of a /proc/uptime reply; ValueError naming what came instead."""
    words = reply.decode(errors="replace").split()
    try:
        seconds = float(words[0]) if words else float("nan")
    except ValueError:
        seconds = float("nan")
    # nan and inf say nothing of a boot, and nor does a negative uptime.
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"/proc/uptime gave {machine_text(reply.decode(errors='replace'))[:80]!r}, not seconds")
    return seconds


async def booted_at_over_ssh(
    target: TakeoverTarget, client_key: asyncssh.SSHKey, connect_timeout: float, exec_timeout: float
) -> datetime:
    """When the machine at target booted, by its uptime against this host's clock (no clock on the machine is
    trusted). The host key is checked as for a takeover. Raises TakeoverError when there is no session, and
    ValueError when the machine's answer is no uptime."""
    with session_failures(target):
        async with SSHSession(target.login, client_key, connect_timeout) as session, session.time_limit(exec_timeout):
            run = await session.run(UPTIME_COMMAND, b"", doing=READING_UPTIME, stdout_limit=MAX_UPTIME_REPLY)
            # Read the moment the answer came, so the session's closing is not counted as uptime.
            now = datetime.now(UTC)
    if run.exit_status != 0:
        raise ValueError(f"{UPTIME_COMMAND} exited with status {run.exit_status}")
    return now - timedelta(seconds=parse_uptime(run.stdout))


async def reset_over_ssh(
    target: TakeoverTarget,
    asked_at: datetime,
    client_key: asyncssh.SSHKey,
    connect_timeout: float,
    exec_timeout: float,
) -> ResetEvidence:
    """What the machine's own uptime says of a reboot asked at asked_at; UNKNOWN, saying why, when it cannot say."""
    source = f"its uptime over SSH at {target.address}:{target.port}"
    try:
        booted = await booted_at_over_ssh(target, client_key, connect_timeout, exec_timeout)
    except TakeoverError as error:
        return ResetEvidence(ResetSeen.UNKNOWN, f"{source}: {error.problem}")
    except ValueError as error:
        return ResetEvidence(ResetSeen.UNKNOWN, f"{source}: {error}")
    return judge_reset(booted, asked_at, source)
