"""Shepherd's side of the takeover: SSH in, upload the agent, run it, check its answer.

The checks are the seed Initializer's: the agent must answer a
TakeoverResponse, echo the TakeoverInit it was sent and give a 32-byte ed25519
key. Every failure is a TakeoverError naming the machine, the address and the
problem.
"""

from __future__ import annotations

import asyncio
import enum
import shlex
from dataclasses import dataclass, field

import asyncssh
from google.protobuf.message import DecodeError

from proto import takeover_pb2

ED25519_KEY_SIZE = 32
# A TakeoverResponse is a few hundred bytes; anything near this is not one.
MAX_REPLY_SIZE = 1 << 20


@dataclass(frozen=True)
class TakeoverTarget:
    """Everything needed to reach one machine; no secrets."""

    machine_id: str
    address: str
    port: int = 22
    username: str = "root"
    # OpenSSH public key recorded at first contact (trust on first use).
    pinned_host_key: str | None = None


@dataclass(frozen=True)
class TakeoverSettings:
    agent_executable: bytes
    endpoint: str
    target_path: str = "/root/agent"
    ca_certificate: bytes = b""
    connect_timeout: float = 2.0
    exec_timeout: float = 60.0


@dataclass(frozen=True)
class TakeoverResult:
    agent_public_key: bytes
    host_key: str
    warnings: list[str] = field(default_factory=list)
    stderr: str = ""


class TakeoverFailure(enum.StrEnum):
    CONNECT_REFUSED = "CONNECT_REFUSED"
    CONNECT_TIMEOUT = "CONNECT_TIMEOUT"
    AUTH_REJECTED = "AUTH_REJECTED"
    HOST_KEY_CHANGED = "HOST_KEY_CHANGED"
    SSH_ERROR = "SSH_ERROR"
    UPLOAD_FAILED = "UPLOAD_FAILED"
    EXEC_FAILED = "EXEC_FAILED"
    EXEC_TIMEOUT = "EXEC_TIMEOUT"
    BAD_REPLY = "BAD_REPLY"
    AGENT_ERROR = "AGENT_ERROR"
    INIT_NOT_ECHOED = "INIT_NOT_ECHOED"
    BAD_KEY = "BAD_KEY"


class TakeoverError(Exception):
    def __init__(self, failure: TakeoverFailure, target: TakeoverTarget, problem: str) -> None:
        super().__init__(f"takeover of machine {target.machine_id} at {target.address}:{target.port}: {problem}")
        self.failure = failure
        self.machine_id = target.machine_id
        self.address = target.address

    @property
    def retryable(self) -> bool:
        # A changed host key needs an operator; everything else may pass.
        return self.failure is not TakeoverFailure.HOST_KEY_CHANGED


async def take_over(target: TakeoverTarget, settings: TakeoverSettings, client_key: asyncssh.SSHKey) -> TakeoverResult:
    """Start the agent on target and return its public key."""
    connection = await _connect(target, settings, client_key)
    async with connection:
        host_key = connection.get_server_host_key()
        if host_key is None:
            raise TakeoverError(TakeoverFailure.SSH_ERROR, target, "the SSH server showed no host key")
        host_key_text = host_key.export_public_key("openssh").decode().strip()
        init = takeover_pb2.TakeoverInit(
            machine_id=target.machine_id, endpoint=settings.endpoint, ca_certificate=settings.ca_certificate
        )
        phase = "uploading the agent"
        try:
            async with asyncio.timeout(settings.exec_timeout):
                await _upload(connection, target, settings)
                phase = "running the agent"
                completed = await connection.run(
                    shlex.quote(settings.target_path), input=init.SerializeToString(), encoding=None, check=False
                )
        except TimeoutError:
            raise TakeoverError(
                TakeoverFailure.EXEC_TIMEOUT, target, f"no reply within {settings.exec_timeout:g}s while {phase}"
            ) from None
        except (asyncssh.Error, OSError) as error:
            raise TakeoverError(TakeoverFailure.SSH_ERROR, target, f"SSH failed while {phase}: {error}") from None
    stdout = _as_bytes(completed.stdout)
    stderr = _as_bytes(completed.stderr).decode(errors="replace").strip()
    if completed.exit_status != 0:
        how = f"signal {completed.exit_signal[0]}" if completed.exit_signal else f"status {completed.exit_status}"
        raise TakeoverError(
            TakeoverFailure.EXEC_FAILED, target, f"the agent exited with {how}; stderr: {stderr[-500:] or '(empty)'}"
        )
    response = _parse_reply(stdout, target)
    success = response.success
    if success.init_message != init:
        raise TakeoverError(TakeoverFailure.INIT_NOT_ECHOED, target, "the agent did not send back the init message")
    if len(success.key) != ED25519_KEY_SIZE:
        raise TakeoverError(
            TakeoverFailure.BAD_KEY, target, f"the agent's key is {len(success.key)} bytes, not {ED25519_KEY_SIZE}"
        )
    return TakeoverResult(
        agent_public_key=bytes(success.key),
        host_key=host_key_text,
        warnings=list(success.warnings),
        stderr=stderr,
    )


async def _connect(
    target: TakeoverTarget, settings: TakeoverSettings, client_key: asyncssh.SSHKey
) -> asyncssh.SSHClientConnection:
    options: dict[str, object] = {"known_hosts": None}
    if target.pinned_host_key:
        pinned = asyncssh.import_public_key(target.pinned_host_key)
        # Trusted host keys, CA keys, revoked keys: only the pinned key passes.
        options = {"known_hosts": ([pinned], [], []), "server_host_key_algs": [pinned.algorithm.decode()]}
    try:
        async with asyncio.timeout(settings.connect_timeout):
            return await asyncssh.connect(
                target.address,
                target.port,
                username=target.username,
                client_keys=[client_key],
                agent_path=None,
                password=None,
                kbdint_auth=False,
                preferred_auth="publickey",
                config=[],
                **options,
            )
    except TimeoutError:
        raise TakeoverError(
            TakeoverFailure.CONNECT_TIMEOUT, target, f"no SSH session within {settings.connect_timeout:g}s"
        ) from None
    except ConnectionRefusedError:
        raise TakeoverError(TakeoverFailure.CONNECT_REFUSED, target, "connection refused") from None
    except asyncssh.PermissionDenied:
        raise TakeoverError(
            TakeoverFailure.AUTH_REJECTED, target, f"the machine rejected Shepherd's key for user {target.username}"
        ) from None
    except asyncssh.HostKeyNotVerifiable:
        raise TakeoverError(
            TakeoverFailure.HOST_KEY_CHANGED,
            target,
            "the SSH host key differs from the one pinned at first contact; if the machine was reinstalled, "
            "reset its pin",
        ) from None
    except (asyncssh.Error, OSError) as error:
        raise TakeoverError(TakeoverFailure.SSH_ERROR, target, f"cannot open an SSH session: {error}") from None


async def _upload(connection: asyncssh.SSHClientConnection, target: TakeoverTarget, settings: TakeoverSettings) -> None:
    """Write the agent beside its target path, then rename it over: a running agent never sees half a file."""
    temporary = f"{settings.target_path}.upload"
    try:
        async with connection.start_sftp_client() as sftp:
            async with sftp.open(temporary, "wb") as file:
                await file.write(settings.agent_executable)
            await sftp.chmod(temporary, 0o755)
            try:
                await sftp.posix_rename(temporary, settings.target_path)
            except asyncssh.SFTPOpUnsupported:
                if await sftp.exists(settings.target_path):
                    await sftp.remove(settings.target_path)
                await sftp.rename(temporary, settings.target_path)
    except (asyncssh.SFTPError, asyncssh.ChannelOpenError) as error:
        raise TakeoverError(
            TakeoverFailure.UPLOAD_FAILED, target, f"cannot upload the agent to {settings.target_path}: {error}"
        ) from None


def _as_bytes(output: bytes | str | None) -> bytes:
    # run() with encoding=None gives bytes; the union is asyncssh's general signature.
    if output is None:
        return b""
    return output.encode() if isinstance(output, str) else bytes(output)


def _parse_reply(stdout: bytes, target: TakeoverTarget) -> takeover_pb2.TakeoverResponse:
    if not stdout:
        raise TakeoverError(TakeoverFailure.BAD_REPLY, target, "the agent wrote nothing to its standard output")
    if len(stdout) > MAX_REPLY_SIZE:
        raise TakeoverError(TakeoverFailure.BAD_REPLY, target, f"the agent wrote {len(stdout)} bytes, no reply")
    response = takeover_pb2.TakeoverResponse()
    try:
        response.ParseFromString(stdout)
    except DecodeError:
        raise TakeoverError(
            TakeoverFailure.BAD_REPLY, target, f"the agent's reply is no TakeoverResponse: {stdout[:60]!r}"
        ) from None
    result = response.WhichOneof("result")
    if result == "error":
        raise TakeoverError(TakeoverFailure.AGENT_ERROR, target, f"the agent said: {response.error.message}")
    if result != "success":
        raise TakeoverError(TakeoverFailure.BAD_REPLY, target, "the agent's TakeoverResponse has no result")
    return response
