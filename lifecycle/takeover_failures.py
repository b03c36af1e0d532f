"""How a takeover fails: the machine it was for, the kind of failure, and the one sentence an operator reads.

An SSH session's failures (foundation.ssh_sessions) and a machine's unreadable answers become TakeoverErrors
here, in one place, for the takeover, the agent's stop and the SSH check alike.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from foundation.ssh_sessions import CommandRun, SSHFailure, SSHLogin, SSHSessionError
from lifecycle.machine_text import machine_text
from proto import takeover_pb2

# A TakeoverResponse is a few hundred bytes; an agent writing more than this is
# broken, and Shepherd must not hold an unbounded reply in memory.
MAX_REPLY_SIZE = 64 << 10
# The session keeps only the end of the agent's standard error, where the reason is; this much of it reaches the
# result, and this much a message.
STDERR_IN_RESULT = 4096
STDERR_IN_MESSAGE = 500
# What the session is doing at each step, as a problem tells it.
PROBING = "probing the machine"
UPLOADING = "uploading the agent"
RUNNING = "running the agent"
STOPPING = "stopping the agent"


@dataclass(frozen=True)
class TakeoverTarget:
    """Everything needed to reach one machine; no secrets."""

    # BMDB machine UUID, sent to the agent in TakeoverInit.
    machine_id: str
    # Host name or IP address of the machine's SSH server.
    address: str
    port: int
    username: str
    # OpenSSH public key recorded at first contact (trust on first use); None
    # before the first contact, when any host key is accepted and reported.
    pinned_host_key: str | None = None

    @property
    def login(self) -> SSHLogin:
        """Where and as whom an SSH session reaches the machine, and the host key it must show."""
        return SSHLogin(self.address, self.port, self.username, self.pinned_host_key)


class TakeoverFailure(enum.StrEnum):
    """Which kind of failure a TakeoverError is; its name becomes the activity error's type and the metric's outcome."""

    CONNECT_REFUSED = "CONNECT_REFUSED"
    CONNECT_TIMEOUT = "CONNECT_TIMEOUT"
    AUTH_REJECTED = "AUTH_REJECTED"
    HOST_KEY_CHANGED = "HOST_KEY_CHANGED"
    SSH_ERROR = "SSH_ERROR"
    UPLOAD_FAILED = "UPLOAD_FAILED"
    # The machine's answer to the probe is unreadable: nothing is uploaded.
    BAD_PROBE = "BAD_PROBE"
    # No agent executable runs on the machine (its architecture or C library): nothing is uploaded.
    MACHINE_UNSUPPORTED = "MACHINE_UNSUPPORTED"
    # The agent's target path cannot take it: no directory, not writable, noexec, not enough disk.
    TARGET_UNUSABLE = "TARGET_UNUSABLE"
    # Non-zero exit status, or killed by a signal.
    EXEC_FAILED = "EXEC_FAILED"
    EXEC_TIMEOUT = "EXEC_TIMEOUT"
    # Standard output is no TakeoverResponse, is empty, is too long, or has no result set.
    BAD_REPLY = "BAD_REPLY"
    # The agent answered with a TakeoverError.
    AGENT_ERROR = "AGENT_ERROR"
    INIT_NOT_ECHOED = "INIT_NOT_ECHOED"
    # The agent's key is not 32 bytes.
    BAD_KEY = "BAD_KEY"

    @property
    def retryable(self) -> bool:
        """Whether trying again later may help, without an operator looking first."""
        # A changed host key may be an impostor: an operator must look before
        # Shepherd sends anything to that machine again. All else may pass.
        return self is not TakeoverFailure.HOST_KEY_CHANGED


class TakeoverError(Exception):
    """Taking over one machine failed; str() is one sentence naming machine, address and problem."""

    def __init__(self, failure: TakeoverFailure, target: TakeoverTarget, problem: str) -> None:
        super().__init__(f"takeover of machine {target.machine_id} at {target.login.host_port} failed: {problem}")
        self.failure = failure
        self.target = target
        self.problem = problem
        self.machine_id = target.machine_id
        self.address = target.address

    @property
    def retryable(self) -> bool:
        """Whether trying again later may help: its failure's."""
        return self.failure.retryable

    def __reduce__(self) -> tuple[Any, ...]:
        # The constructor's arguments are not the message: rebuild from them when pickled or copied.
        return (type(self), (self.failure, self.target, self.problem))


@contextmanager
def session_failures(target: TakeoverTarget, *, stopping: bool = False) -> Iterator[None]:
    """Raise an SSH session's failure as the TakeoverError it is; a stop tells its timeout and breakage as its own."""
    try:
        yield
    except SSHSessionError as error:
        failure, problem = takeover_failure(error, target, stopping)
        raise TakeoverError(failure, target, problem) from None


def takeover_failure(error: SSHSessionError, target: TakeoverTarget, stopping: bool) -> tuple[TakeoverFailure, str]:
    """The kind and the problem of the TakeoverError that an SSH session's failure is."""
    reset = "`shepherd reset-host-key`"
    match error.failure:
        case SSHFailure.PIN_UNREADABLE:
            return TakeoverFailure.HOST_KEY_CHANGED, (
                f"the pinned host key is not an OpenSSH public key ({error.detail}); {reset} the machine"
            )
        case SSHFailure.HOST_KEY_CHANGED:
            return TakeoverFailure.HOST_KEY_CHANGED, (
                "the SSH host key differs from the one pinned at first contact; "
                f"if the machine was reinstalled, {reset} it, otherwise find out who answers there"
            )
        case SSHFailure.CONNECT_TIMEOUT:
            problem = f"no SSH session within {error.time_limit:g}s (connect, handshake and login)"
            return TakeoverFailure.CONNECT_TIMEOUT, problem
        case SSHFailure.CONNECT_REFUSED:
            return TakeoverFailure.CONNECT_REFUSED, "the connection was refused"
        case SSHFailure.AUTH_REJECTED:
            return TakeoverFailure.AUTH_REJECTED, f"the machine rejected Shepherd's SSH key for user {target.username}"
        case SSHFailure.CONNECT_FAILED:
            return TakeoverFailure.SSH_ERROR, f"cannot open an SSH session: {error.detail}"
        case SSHFailure.NO_HOST_KEY:
            return TakeoverFailure.SSH_ERROR, "the SSH server showed no host key"
        case SSHFailure.UPLOAD_FAILED:
            return TakeoverFailure.UPLOAD_FAILED, f"cannot upload the agent to {error.path}: {error.detail}"
        case SSHFailure.OUTPUT_TOO_LONG:
            # The probe's answer is not the agent's reply: a machine that floods it is refused before any upload.
            probing = error.doing == PROBING
            who = "the machine's answer to the probe" if probing else "the agent"
            return TakeoverFailure.BAD_PROBE if probing else TakeoverFailure.BAD_REPLY, (
                f"{who} wrote more than {MAX_REPLY_SIZE} bytes to its standard output, which is no reply"
            )
        case SSHFailure.TIMEOUT:
            if stopping:
                return TakeoverFailure.EXEC_TIMEOUT, f"the agent's stop took longer than {error.time_limit:g}s"
            return TakeoverFailure.EXEC_TIMEOUT, f"not done within {error.time_limit:g}s while {error.doing}"
        case SSHFailure.BROKEN:
            doing = STOPPING if stopping else error.doing
            return TakeoverFailure.SSH_ERROR, f"SSH failed while {doing}: {machine_text(error.detail)}"


def unexpected_host_key(target: TakeoverTarget, expected: str, seen: str) -> TakeoverError:
    """The error of a first contact whose host key lacks the fingerprint an operator said to expect: nothing is
    pinned, and the operator is told what to do."""
    return TakeoverError(
        TakeoverFailure.HOST_KEY_CHANGED,
        target,
        f"the SSH host key is {seen}, the operator who reset its pin expects {expected}; nothing was pinned. "
        "Find out who answers there, or, if the expected fingerprint was wrong, `shepherd reset-host-key "
        "--expect-fingerprint` again with the right one",
    )


def stderr_line(run: CommandRun) -> str:
    """The end of standard error on one printable line, for a message; "(empty)" when there was none."""
    tail = run.stderr.decode(errors="replace").strip()[-STDERR_IN_MESSAGE:]
    return machine_text(" | ".join(tail.splitlines()), STDERR_IN_MESSAGE) or "(empty)"


def parse_reply(stdout: bytes, target: TakeoverTarget) -> takeover_pb2.TakeoverSuccess:
    """The agent's TakeoverSuccess from its standard output; TakeoverError for anything else it wrote."""
    if not stdout:
        raise TakeoverError(TakeoverFailure.BAD_REPLY, target, "the agent wrote nothing to its standard output")
    response = takeover_pb2.TakeoverResponse()
    try:
        response.ParseFromString(stdout)
    except DecodeError:
        raise TakeoverError(
            TakeoverFailure.BAD_REPLY,
            target,
            f"the agent's reply ({len(stdout)} bytes) is no TakeoverResponse: {stdout[:60]!r}",
        ) from None
    result = response.WhichOneof("result")
    if result == "error":
        message = machine_text(response.error.message, STDERR_IN_MESSAGE)
        raise TakeoverError(TakeoverFailure.AGENT_ERROR, target, f"the agent reported: {message}")
    if result != "success":
        raise TakeoverError(
            TakeoverFailure.BAD_REPLY, target, f"the agent's TakeoverResponse ({len(stdout)} bytes) has no result set"
        )
    return response.success
