"""Shepherd's side of the takeover: SSH in, probe the machine, upload the agent built for it, run it, check its
answer.

The checks are the seed Initializer's: the agent must exit with status 0,
answer a TakeoverResponse, echo the TakeoverInit it was sent and give a
32-byte ed25519 key. Every failure is a TakeoverError naming the machine, the
address and the problem, with a TakeoverFailure saying which kind it is.
"""

from __future__ import annotations

import asyncio
import base64
import enum
import hashlib
import posixpath
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import asyncssh
from asyncssh.public_key import get_default_public_key_algs
from google.protobuf.message import DecodeError

from foundation.executables import AgentExecutable
from foundation.settings import Settings
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
from proto import AGENT_STOP_ARGUMENT, AGENT_STOPPED, takeover_pb2

ED25519_KEY_SIZE = 32
# A TakeoverResponse is a few hundred bytes; an agent writing more than this is
# broken, and Shepherd must not hold an unbounded reply in memory.
MAX_REPLY_SIZE = 64 << 10
# What a machine says travels into payloads, the event log and the history, through every continue-as-new:
# each text it sends is cut to a line this long, and at most this many warnings are kept.
MAX_TEXT = 300
MAX_WARNINGS = 10
# Of the agent's standard error only the end is kept: that is where the reason is.
MAX_STDERR_KEPT = 64 << 10
STDERR_IN_RESULT = 4096
STDERR_IN_MESSAGE = 500
READ_CHUNK = 64 << 10


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
        # A changed host key may be an impostor: an operator must look before
        # Shepherd sends anything to that machine again. All else may pass.
        return self is not TakeoverFailure.HOST_KEY_CHANGED


class TakeoverError(Exception):
    """Taking over one machine failed; str() is one sentence naming machine, address and problem."""

    def __init__(self, failure: TakeoverFailure, target: TakeoverTarget, problem: str) -> None:
        super().__init__(f"takeover of machine {target.machine_id} at {_host_port(target)} failed: {problem}")
        self.failure = failure
        self.target = target
        self.problem = problem
        self.machine_id = target.machine_id
        self.address = target.address

    @property
    def retryable(self) -> bool:
        return self.failure.retryable

    def __reduce__(self) -> tuple[Any, ...]:
        # The constructor's arguments are not the message: rebuild from them when pickled or copied.
        return (type(self), (self.failure, self.target, self.problem))


def takeover_init(machine_id: str, settings: TakeoverSettings) -> takeover_pb2.TakeoverInit:
    """What the agent of machine_id is told: who it is, where to send heartbeats, which CAs to trust there."""
    return takeover_pb2.TakeoverInit(
        machine_id=machine_id,
        endpoint=settings.endpoint,
        # The first alone too, for agents that know only that field: they trust the CA first in the bundle.
        ca_certificate=settings.ca_certificates[0] if settings.ca_certificates else b"",
        ca_certificates=settings.ca_certificates,
    )


# Pins the host key of a first contact; returns None, or the other key found pinned meanwhile.
HostKeyPin = Callable[[str], Awaitable[str | None]]


async def take_over(
    target: TakeoverTarget,
    settings: TakeoverSettings,
    client_key: asyncssh.SSHKey,
    pin: HostKeyPin | None = None,
) -> TakeoverResult:
    """Upload the agent to target, run it and return what it answered.

    At a first contact (no pinned key), pin is given the host key the server showed before anything is sent,
    so a takeover that raced another to a different server stops there. Raises TakeoverError for every way
    this can fail. The connection is always closed before this returns.
    """
    init = takeover_init(target.machine_id, settings)
    connection = await _connect(target, settings.connect_timeout, client_key)
    try:
        host_key = _server_host_key(connection, target)
        if pin is not None and target.pinned_host_key is None:
            other = await pin(host_key)
            if other is not None:
                raise TakeoverError(
                    TakeoverFailure.HOST_KEY_CHANGED,
                    target,
                    f"another takeover pinned host key {host_key_fingerprint(other)} first, this server shows "
                    f"{host_key_fingerprint(host_key)}; find out who answers there, then `shepherd reset-host-key`",
                )
        phase = "probing the machine"
        try:
            async with asyncio.timeout(settings.exec_timeout):
                facts = await _probe(connection, target, settings)
                agent, tmp_dir = _agent_for(facts, target, settings)
                phase = "uploading the agent"
                await _upload(connection, target, settings.target_path, agent.data)
                phase = "running the agent"
                command = run_command(settings.target_path, tmp_dir)
                run = await _run(connection, target, command, init.SerializeToString())
        except TimeoutError:
            raise TakeoverError(
                TakeoverFailure.EXEC_TIMEOUT, target, f"not done within {settings.exec_timeout:g}s while {phase}"
            ) from None
        except (asyncssh.Error, OSError) as error:
            raise TakeoverError(
                TakeoverFailure.SSH_ERROR, target, f"SSH failed while {phase}: {machine_text(str(error))}"
            ) from None
    finally:
        await _close(connection, settings.connect_timeout)

    stderr = run.stderr.decode(errors="replace").strip()
    if run.exit_status != 0:
        if run.exit_signal is not None:
            how = f"was killed by signal {run.exit_signal}"
        elif run.exit_status is None:
            how = "ended without an exit status"
        else:
            how = f"exited with status {run.exit_status}"
        raise TakeoverError(TakeoverFailure.EXEC_FAILED, target, f"the agent {how}; stderr: {run.stderr_line()}")
    success = _parse_reply(run.stdout, target)
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


async def _probe(
    connection: asyncssh.SSHClientConnection, target: TakeoverTarget, settings: TakeoverSettings
) -> MachineFacts:
    """What the machine is, from the probe command's answer; TakeoverError BAD_PROBE when it answers none."""
    run = await _run(connection, target, probe_command(settings.target_path), b"", TakeoverFailure.BAD_PROBE)
    try:
        return parse_probe(run.stdout.decode(errors="replace"), settings.target_path)
    except ProbeError as error:
        status = f"exit status {run.exit_status}, stderr: {run.stderr_line()}"
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
    connection = await _connect(target, settings.connect_timeout, client_key)
    try:
        async with asyncio.timeout(settings.exec_timeout):
            _, tmp_dir = _agent_for(await _probe(connection, target, settings), target, settings)
            command = run_command(settings.target_path, tmp_dir, AGENT_STOP_ARGUMENT)
            run = await _run(connection, target, command, b"")
    except TimeoutError:
        raise TakeoverError(
            TakeoverFailure.EXEC_TIMEOUT, target, f"the agent's stop took longer than {settings.exec_timeout:g}s"
        ) from None
    except (asyncssh.Error, OSError) as error:
        raise TakeoverError(
            TakeoverFailure.SSH_ERROR, target, f"SSH failed while stopping the agent: {machine_text(str(error))}"
        ) from None
    finally:
        await _close(connection, settings.connect_timeout)
    lines = run.stdout.decode(errors="replace").strip().splitlines()
    answer = machine_text(lines[0]) if lines else ""
    if run.exit_status == 0 and answer.startswith(AGENT_STOPPED):
        return answer
    raise TakeoverError(
        TakeoverFailure.EXEC_FAILED,
        target,
        f"{settings.target_path} {AGENT_STOP_ARGUMENT} did not confirm the stop (exit status {run.exit_status}, "
        f"answer {answer[:100]!r}, stderr: {run.stderr_line()})",
    )


def _host_port(target: TakeoverTarget) -> str:
    address = f"[{target.address}]" if ":" in target.address else target.address
    return f"{address}:{target.port}"


async def probe_ssh(target: TakeoverTarget, client_key: asyncssh.SSHKey, connect_timeout: float) -> str:
    """Log in to target as a takeover would, run nothing, and return the host key it showed (an OpenSSH line).

    Raises TakeoverError, as take_over does, when the session cannot be had.
    """
    connection = await _connect(target, connect_timeout, client_key)
    try:
        return _server_host_key(connection, target)
    finally:
        await _close(connection, connect_timeout)


async def ssh_answers(address: str, port: int, within: float) -> bool:
    """Whether an SSH server answers at address:port: it accepts a connection and sends its version line.

    Cheaper than a login, and enough to tell a machine that has booted from one that is down or booting.
    """
    try:
        async with asyncio.timeout(within):
            reader, writer = await asyncio.open_connection(address, port)
            try:
                return (await reader.readline()).startswith(b"SSH-")
            finally:
                writer.close()
    except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
        return False


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


def host_key_fingerprint(openssh_line: str) -> str:
    """The SHA256 fingerprint of an OpenSSH public key line, as ssh-keygen -l shows it."""
    try:
        return str(asyncssh.import_public_key(openssh_line).get_fingerprint("sha256"))
    except (asyncssh.KeyImportError, ValueError):
        return "an unreadable key"


async def _connect(
    target: TakeoverTarget, connect_timeout: float, client_key: asyncssh.SSHKey
) -> asyncssh.SSHClientConnection:
    # No known_hosts: any host key is accepted and reported (first contact).
    known_hosts: Any = None
    host_key_algorithms: Any = ()  # asyncssh's default
    if target.pinned_host_key is not None:
        try:
            pinned = asyncssh.import_public_key(target.pinned_host_key)
        except (asyncssh.KeyImportError, ValueError) as error:
            raise TakeoverError(
                TakeoverFailure.HOST_KEY_CHANGED,
                target,
                f"the pinned host key is not an OpenSSH public key ({error}); `shepherd reset-host-key` the machine",
            ) from None
        # Trusted host keys, trusted CA keys, revoked keys: only the pinned key
        # passes, and asyncssh checks it in the handshake, before we send anything.
        known_hosts = ([pinned], [], [])
        # The pinned key's algorithms first, so a server that still has that
        # key shows it; then every other, so a server that has lost it shows
        # another key and fails the check, rather than ending the handshake
        # with nothing but a reset connection.
        host_key_algorithms = [
            *(algorithm.decode() for algorithm in pinned.sig_algorithms),
            *(algorithm.decode() for algorithm in get_default_public_key_algs()),
        ]
    try:
        async with asyncio.timeout(connect_timeout):
            return await asyncssh.connect(
                target.address,
                target.port,
                username=target.username,
                known_hosts=known_hosts,
                server_host_key_algs=host_key_algorithms,
                client_keys=[client_key],
                # Only the given key: nothing from the worker's ~/.ssh, its SSH agent or its config.
                agent_path=None,
                config=[],
                password=None,
                kbdint_auth=False,
                gss_auth=False,
                preferred_auth="publickey",
            )
    except TimeoutError:
        raise TakeoverError(
            TakeoverFailure.CONNECT_TIMEOUT,
            target,
            f"no SSH session within {connect_timeout:g}s (connect, handshake and login)",
        ) from None
    except ConnectionRefusedError:
        raise TakeoverError(TakeoverFailure.CONNECT_REFUSED, target, "the connection was refused") from None
    except asyncssh.PermissionDenied:
        raise TakeoverError(
            TakeoverFailure.AUTH_REJECTED, target, f"the machine rejected Shepherd's SSH key for user {target.username}"
        ) from None
    except asyncssh.HostKeyNotVerifiable:
        raise TakeoverError(
            TakeoverFailure.HOST_KEY_CHANGED,
            target,
            "the SSH host key differs from the one pinned at first contact; "
            "if the machine was reinstalled, `shepherd reset-host-key` it, otherwise find out who answers there",
        ) from None
    except (asyncssh.Error, OSError) as error:
        raise TakeoverError(TakeoverFailure.SSH_ERROR, target, f"cannot open an SSH session: {error}") from None


def _server_host_key(connection: asyncssh.SSHClientConnection, target: TakeoverTarget) -> str:
    host_key = connection.get_server_host_key()
    if host_key is None:
        raise TakeoverError(TakeoverFailure.SSH_ERROR, target, "the SSH server showed no host key")
    return host_key.export_public_key("openssh").decode().strip()


async def _close(connection: asyncssh.SSHClientConnection, grace: float) -> None:
    connection.close()
    try:
        async with asyncio.timeout(grace):
            await connection.wait_closed()
    except TimeoutError:
        # A server that does not answer our close must not hold the caller.
        connection.abort()


async def _upload(
    connection: asyncssh.SSHClientConnection, target: TakeoverTarget, target_path: str, data: bytes
) -> None:
    """Write the agent beside its target path, then rename it over: a running agent never sees half a file."""
    directory, name = posixpath.split(target_path)
    # Unique, so two uploads to one path (a retry beside a stalled attempt) never write the same file.
    temporary = posixpath.join(directory, f".{name}.{secrets.token_hex(4)}.upload")
    try:
        async with connection.start_sftp_client() as sftp:
            try:
                # Exclusive: in a directory others may write to, a link planted under the name is not followed.
                async with sftp.open(temporary, "xb") as file:
                    await file.write(data)
                await sftp.chmod(temporary, 0o755)
                try:
                    await sftp.posix_rename(temporary, target_path)
                except asyncssh.SFTPOpUnsupported:
                    # Plain SFTP rename refuses to replace a file: remove the old agent first.
                    if await sftp.exists(target_path):
                        await sftp.remove(target_path)
                    await sftp.rename(temporary, target_path)
            except asyncssh.SFTPError:
                await _remove_quietly(sftp, temporary)
                raise
    except (asyncssh.SFTPError, asyncssh.ChannelOpenError) as error:
        raise TakeoverError(
            TakeoverFailure.UPLOAD_FAILED,
            target,
            f"cannot upload the agent to {target_path}: {error.reason or type(error).__name__}",
        ) from None


async def _remove_quietly(sftp: asyncssh.SFTPClient, path: str) -> None:
    try:
        await sftp.remove(path)
    except asyncssh.SFTPError:
        # Most likely it was never created; the next upload overwrites it anyway.
        pass


@dataclass(frozen=True)
class _CommandRun:
    """What running a command over SSH gave back: its output, the end of its stderr, and how it exited."""

    stdout: bytes
    stderr: bytes
    exit_status: int | None
    exit_signal: str | None

    def stderr_line(self) -> str:
        """The end of standard error on one printable line, for a message; "(empty)" when there was none."""
        tail = self.stderr.decode(errors="replace").strip()[-STDERR_IN_MESSAGE:]
        return machine_text(" | ".join(tail.splitlines()), STDERR_IN_MESSAGE) or "(empty)"


async def _run(
    connection: asyncssh.SSHClientConnection,
    target: TakeoverTarget,
    command: str,
    stdin: bytes,
    too_long: TakeoverFailure = TakeoverFailure.BAD_REPLY,
) -> _CommandRun:
    """Run command on the machine with stdin; its output and exit. Standard output longer than MAX_REPLY_SIZE is a
    TakeoverError of the kind too_long."""
    process: asyncssh.SSHClientProcess[bytes] = await connection.create_process(command, encoding=None)
    try:
        process.stdin.write(stdin)
        # Closing stdin tells the agent the whole init message has arrived.
        process.stdin.write_eof()
        readers = asyncio.gather(
            _read_at_most(process.stdout, MAX_REPLY_SIZE, target, too_long), _read_tail(process.stderr, MAX_STDERR_KEPT)
        )
        try:
            stdout, stderr = await readers
        except BaseException:
            # Stop the other reader too; gather leaves it running otherwise.
            readers.cancel()
            raise
        await process.wait_closed()
        signal = process.exit_signal
        return _CommandRun(
            stdout=stdout,
            stderr=stderr,
            exit_status=process.exit_status,
            exit_signal=signal[0] if signal else None,
        )
    except BaseException:
        # Timed out or gave up: ask the server to kill the agent so it does not
        # run on beside the next attempt. Best effort: servers may refuse (OpenSSH
        # does for sessions without privilege separation, such as root's).
        if process.exit_status is None:
            try:
                process.kill()
            except (OSError, asyncssh.Error):
                pass
        raise
    finally:
        process.close()


async def _read_at_most(
    stream: asyncssh.SSHReader[bytes], limit: int, target: TakeoverTarget, failure: TakeoverFailure
) -> bytes:
    received = bytearray()
    while chunk := await stream.read(READ_CHUNK):
        received += chunk
        if len(received) > limit:
            who = "the machine's answer to the probe" if failure is TakeoverFailure.BAD_PROBE else "the agent"
            raise TakeoverError(
                failure, target, f"{who} wrote more than {limit} bytes to its standard output, which is no reply"
            )
    return bytes(received)


async def _read_tail(stream: asyncssh.SSHReader[bytes], keep: int) -> bytes:
    # Read to the end, so the agent never blocks on a full stderr, but keep only the last bytes.
    kept = bytearray()
    while chunk := await stream.read(READ_CHUNK):
        kept += chunk
        del kept[:-keep]
    return bytes(kept)


def machine_text(text: str, limit: int = MAX_TEXT) -> str:
    """What a machine said, on one line of printable characters, at most limit long (the cut is said)."""
    line = " ".join("".join(c if c.isprintable() else " " for c in text[: limit * 4]).split())
    if len(line) <= limit and len(text) <= limit * 4:
        return line
    cut = f"... ({len(text)} chars)"
    return line[: limit - len(cut)] + cut


def machine_warnings(warnings: Sequence[str]) -> list[str]:
    """At most MAX_WARNINGS of a machine's warnings, each cut by machine_text; the rest counted in a last one."""
    kept = [machine_text(w) for w in warnings[:MAX_WARNINGS]]
    if len(warnings) > MAX_WARNINGS:
        kept.append(f"and {len(warnings) - MAX_WARNINGS} more warnings")
    return kept


def _parse_reply(stdout: bytes, target: TakeoverTarget) -> takeover_pb2.TakeoverSuccess:
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
