"""Shepherd's side of the takeover: SSH in, probe the machine, upload the agent built for it, run it, check its
answer.

The checks are the seed Initializer's: the agent must exit with status 0,
answer a TakeoverResponse, echo the TakeoverInit it was sent and give a
32-byte ed25519 key. Every failure is a TakeoverError naming the machine, the
address and the problem, with a TakeoverFailure saying which kind it is
(lifecycle.takeover_failures, which also reads an SSH session's failures as
takeover problems).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from foundation.executables import AgentExecutable
from foundation.settings import Settings
from foundation.ssh_sessions import SSHSession, host_key_fingerprint, ssh_answers
from lifecycle.machine_text import machine_text, machine_warnings
from lifecycle.probe import (
    MachineFacts,
    ProbeError,
    choose_agent,
    directory_problem,
    parse_probe,
    probe_command,
    run_command,
    where_to_unpack,
)
from lifecycle.takeover_failures import (
    MAX_REPLY_SIZE,
    PROBING,
    RUNNING,
    STDERR_IN_RESULT,
    STOPPING,
    UPLOADING,
    TakeoverError,
    TakeoverFailure,
    TakeoverTarget,
    parse_reply,
    session_failures,
    stderr_line,
    unexpected_host_key,
)
from proto import AGENT_STOP_ARGUMENT, AGENT_STOPPED, takeover_pb2

if TYPE_CHECKING:
    import asyncssh

ED25519_KEY_SIZE = 32


@dataclass(frozen=True)
class TakeoverSettings:
    """How to take over machines: the same for every machine of a fleet."""

    # One agent executable per kind of machine (architecture, C library); the first that runs on a machine is
    # uploaded to it.
    agents: tuple[AgentExecutable, ...]
    # host:port the agent calls back.
    endpoint: str
    # Where the agent is uploaded on the machine; relative paths are relative
    # to the SSH user's home directory.
    target_path: str
    # DER-encoded CA certificates the agent trusts for the endpoint, the old CA and the new during a CA rotation;
    # none means the machine's trust store.
    ca_certificates: tuple[bytes, ...]
    # TCP connect, SSH handshake and authentication together.
    connect_timeout: float
    # Upload and run together.
    exec_timeout: float
    # How long an agent whose heartbeats were accepted goes on through refusals before it stops: the heartbeat
    # timeout, past which the watchdog recovers the machine anyway.
    heartbeat_timeout: float = 0.0

    @classmethod
    def of(
        cls,
        settings: Settings,
        agents: bytes | Sequence[AgentExecutable],
        ca_certificates: tuple[bytes, ...] = (),
    ) -> TakeoverSettings:
        """The takeover that settings describe, with the agent executables (or one's bytes) and CA certificates
        already read."""
        return cls(
            agents=(AgentExecutable.of(agents),) if isinstance(agents, bytes) else tuple(agents),
            endpoint=settings.agent_endpoint,
            target_path=settings.agent_target_path,
            ca_certificates=ca_certificates,
            connect_timeout=settings.ssh_connect_timeout,
            exec_timeout=settings.ssh_exec_timeout,
            heartbeat_timeout=settings.heartbeat_timeout,
        )


@dataclass(frozen=True)
class TakeoverResult:
    """What take_over returns from an agent that answered: its key, the host key seen, warnings and stderr."""

    # The agent's raw ed25519 public key (32 bytes).
    agent_public_key: bytes
    # The host key the SSH server showed, as an OpenSSH public key line; the
    # caller pins it at first contact.
    host_key: str
    # Non-fatal problems the agent reported.
    warnings: list[str] = field(default_factory=list)
    # The end of the agent's standard error, stripped; may be logged.
    stderr: str = ""
    # The SHA-256 of the agent executable uploaded, and what the probe found the machine to be.
    agent_sha256: str = ""
    machine: str = ""


def takeover_init(machine_id: str, settings: TakeoverSettings) -> takeover_pb2.TakeoverInit:
    """What the agent of machine_id is told: who it is, where to send heartbeats, which CAs to trust there."""
    return takeover_pb2.TakeoverInit(
        machine_id=machine_id,
        endpoint=settings.endpoint,
        # The first alone too, for agents that know only that field: they trust the CA first in the bundle.
        ca_certificate=settings.ca_certificates[0] if settings.ca_certificates else b"",
        ca_certificates=settings.ca_certificates,
        refused_for_seconds_before_stopping=max(0, round(settings.heartbeat_timeout)),
    )


@dataclass(frozen=True)
class PinRefused:
    """Why no host key was pinned at a first contact: another takeover pinned another key first, or an operator
    expects another fingerprint."""

    # The key another takeover pinned first; None when the refusal is the expectation's.
    other_key: str | None = None
    # The SHA256 fingerprint the operator who reset the pin said the key must have.
    expected_fingerprint: str | None = None


# Pins the host key of a first contact; returns None, or why it was not pinned.
HostKeyPin = Callable[[str], Awaitable[PinRefused | None]]


async def take_over(
    target: TakeoverTarget,
    settings: TakeoverSettings,
    client_key: asyncssh.SSHKey,
    pin: HostKeyPin | None = None,
) -> TakeoverResult:
    """Upload the agent to target, run it and return what it answered.

    At a first contact (no pinned key), pin is given the host key the server showed before anything is sent,
    so a takeover that raced another to a different server, or met a key without the fingerprint an operator
    expects, stops there. Raises TakeoverError for every way
    this can fail. The connection is always closed before this returns.
    """
    init = takeover_init(target.machine_id, settings)
    with session_failures(target):
        async with SSHSession(target.login, client_key, settings.connect_timeout) as session:
            host_key = session.host_key()
            if pin is not None and target.pinned_host_key is None:
                refused = await pin(host_key)
                if refused is not None and refused.other_key is not None:
                    raise TakeoverError(
                        TakeoverFailure.HOST_KEY_CHANGED,
                        target,
                        f"another takeover pinned host key {host_key_fingerprint(refused.other_key)} first, this "
                        f"server shows {host_key_fingerprint(host_key)}; find out who answers there, then "
                        "`shepherd reset-host-key`",
                    )
                if refused is not None and refused.expected_fingerprint is not None:
                    raise unexpected_host_key(target, refused.expected_fingerprint, host_key_fingerprint(host_key))
            async with session.time_limit(settings.exec_timeout):
                facts = await _probe(session, target, settings)
                agent, tmp_dir = _agent_for(facts, target, settings)
                await session.upload(settings.target_path, agent.data, doing=UPLOADING)
                command = run_command(settings.target_path, tmp_dir)
                run = await session.run(command, init.SerializeToString(), doing=RUNNING, stdout_limit=MAX_REPLY_SIZE)

    stderr = run.stderr.decode(errors="replace").strip()
    if run.exit_status != 0:
        if run.exit_signal is not None:
            how = f"was killed by signal {run.exit_signal}"
        elif run.exit_status is None:
            how = "ended without an exit status"
        else:
            how = f"exited with status {run.exit_status}"
        raise TakeoverError(TakeoverFailure.EXEC_FAILED, target, f"the agent {how}; stderr: {stderr_line(run)}")
    success = parse_reply(run.stdout, target)
    if success.init_message != init:
        raise TakeoverError(
            TakeoverFailure.INIT_NOT_ECHOED,
            target,
            "the agent did not echo the init message it was sent "
            f"(it echoed machine_id {machine_text(success.init_message.machine_id, 100)!r}, "
            f"endpoint {machine_text(success.init_message.endpoint, 100)!r})",
        )
    if len(success.key) != ED25519_KEY_SIZE:
        raise TakeoverError(
            TakeoverFailure.BAD_KEY,
            target,
            f"the agent's key is {len(success.key)} bytes long, an ed25519 public key is {ED25519_KEY_SIZE}",
        )
    return TakeoverResult(
        agent_public_key=bytes(success.key),
        host_key=host_key,
        warnings=machine_warnings(success.warnings) + _unpack_warning(facts, tmp_dir),
        stderr=stderr[-STDERR_IN_RESULT:],
        agent_sha256=agent.sha256,
        machine=facts.describe(),
    )


async def _probe(session: SSHSession, target: TakeoverTarget, settings: TakeoverSettings) -> MachineFacts:
    """What the machine is, from the probe command's answer; TakeoverError BAD_PROBE when it answers none."""
    command = probe_command(settings.target_path)
    run = await session.run(command, b"", doing=PROBING, stdout_limit=MAX_REPLY_SIZE)
    try:
        return parse_probe(run.stdout.decode(errors="replace"), settings.target_path)
    except ProbeError as error:
        status = f"exit status {run.exit_status}, stderr: {stderr_line(run)}"
        raise TakeoverError(TakeoverFailure.BAD_PROBE, target, f"{machine_text(str(error))} ({status})") from None


def _unpack_warning(facts: MachineFacts, tmp_dir: str | None) -> list[str]:
    """What an operator should know when the agent unpacks beside itself rather than in the temporary directory."""
    if tmp_dir is None:
        return []
    tmp = facts.tmp
    why = "does not exist" if tmp.state == "missing" else f"is {tmp.state}" if tmp.state != "ok" else "is too full"
    return [
        f"the machine's temporary directory {tmp.path} {why}: the agent unpacks into {tmp_dir}, which a reboot keeps"
    ]


def _agent_for(
    facts: MachineFacts, target: TakeoverTarget, settings: TakeoverSettings
) -> tuple[AgentExecutable, str | None]:
    """The agent executable for the machine and where it unpacks itself; TakeoverError when none can run there."""
    chosen = choose_agent(facts, settings.agents)
    if isinstance(chosen, str):
        raise TakeoverError(TakeoverFailure.MACHINE_UNSUPPORTED, target, chosen)
    problem = directory_problem(facts, chosen, target.username)
    if problem is not None:
        raise TakeoverError(TakeoverFailure.TARGET_UNUSABLE, target, problem)
    return chosen, where_to_unpack(facts, chosen)


async def stop_agent(target: TakeoverTarget, settings: TakeoverSettings, client_key: asyncssh.SSHKey) -> str:
    """Ask the agent executable on target to stop the agent that runs there; what it answered, in one line.

    The host key is checked as for a takeover, before anything is sent. Raises TakeoverError when there is no
    session, or the executable does not confirm the stop (an agent without --stop, or none uploaded).
    """
    with session_failures(target, stopping=True):
        async with (
            SSHSession(target.login, client_key, settings.connect_timeout) as session,
            session.time_limit(settings.exec_timeout),
        ):
            _, tmp_dir = _agent_for(await _probe(session, target, settings), target, settings)
            command = run_command(settings.target_path, tmp_dir, AGENT_STOP_ARGUMENT)
            run = await session.run(command, b"", doing=STOPPING, stdout_limit=MAX_REPLY_SIZE)
    lines = run.stdout.decode(errors="replace").strip().splitlines()
    answer = machine_text(lines[0]) if lines else ""
    if run.exit_status == 0 and answer.startswith(AGENT_STOPPED):
        return answer
    raise TakeoverError(
        TakeoverFailure.EXEC_FAILED,
        target,
        f"{settings.target_path} {AGENT_STOP_ARGUMENT} did not confirm the stop (exit status {run.exit_status}, "
        f"answer {answer[:100]!r}, stderr: {stderr_line(run)})",
    )


async def probe_ssh(target: TakeoverTarget, client_key: asyncssh.SSHKey, connect_timeout: float) -> str:
    """Log in to target as a takeover would, run nothing, and return the host key it showed (an OpenSSH line).

    Raises TakeoverError, as take_over does, when the session cannot be had.
    """
    with session_failures(target):
        async with SSHSession(target.login, client_key, connect_timeout) as session:
            return session.host_key()


async def wait_until_booted(
    address: str,
    port: int,
    *,
    seen_down: bool,
    until: datetime,
    probe_within: float,
    poll: float,
    progress: Callable[[bool], None] = lambda seen_down: None,
) -> tuple[bool, bool]:
    """Try SSH at address:port every poll seconds until it answers after it was down, or until passes.

    seen_down: the machine is known to have gone down (the provider saw it), so SSH answering is the new boot;
    else SSH must first stop answering, or the boot before the reboot would count. progress hears, after every
    try, whether the machine was seen down. Returns (came back, seen down).
    """
    while datetime.now(UTC) < until:
        answers = await ssh_answers(address, port, probe_within)
        if answers and seen_down:
            return True, True
        seen_down = seen_down or not answers
        progress(seen_down)
        await asyncio.sleep(poll)
    return False, seen_down


def key_fingerprint(public_key: bytes) -> str:
    """OpenSSH-style SHA256 fingerprint of a raw ed25519 public key."""
    digest = base64.b64encode(hashlib.sha256(public_key).digest()).decode().rstrip("=")
    return f"SHA256:{digest}"
