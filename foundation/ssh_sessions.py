"""SSH sessions to machines: log in with Shepherd's key, check the host key, run commands, upload files.

Everything asyncssh-specific of a session lives here, below the domain. A session logs in with the given
client key only, accepts the pinned host key alone (or, before the first contact, any key, which it reports),
reads what a command writes within limits, and is closed within a grace period. Every way it fails is one
SSHSessionError saying which failure it is, on which host:port, and what the session was doing.
"""

from __future__ import annotations

import asyncio
import enum
import posixpath
import secrets
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import asyncssh
from asyncssh.public_key import get_default_public_key_algs

from foundation.foreign_text import foreign_text

# What a command writes to its standard error is read to the end, but only this much of its end is kept.
STDERR_KEPT = 64 << 10
READ_CHUNK = 64 << 10
# The longest an error quotes what the machine or the network said (a disconnect reason, an SFTP refusal).
DETAIL_LIMIT = 500
_CONNECTING = "opening the session"


@dataclass(frozen=True)
class SSHLogin:
    """Where and as whom a session logs in, and the host key the server must show."""

    address: str
    port: int
    username: str
    # An OpenSSH public key line; None at a first contact, when any host key is accepted and reported.
    pinned_host_key: str | None = None

    @property
    def host_port(self) -> str:
        """The server's address:port, for messages, an IPv6 address in brackets."""
        address = f"[{self.address}]" if ":" in self.address else self.address
        return f"{address}:{self.port}"


class SSHFailure(enum.StrEnum):
    """Which way an SSH session failed."""

    # The pinned host key is no OpenSSH public key: nothing was tried.
    PIN_UNREADABLE = "PIN_UNREADABLE"
    CONNECT_REFUSED = "CONNECT_REFUSED"
    # No session within the connect time limit: TCP connect, handshake and login together.
    CONNECT_TIMEOUT = "CONNECT_TIMEOUT"
    AUTH_REJECTED = "AUTH_REJECTED"
    # The server showed another host key than the pinned one.
    HOST_KEY_CHANGED = "HOST_KEY_CHANGED"
    # Any other reason no session could be opened.
    CONNECT_FAILED = "CONNECT_FAILED"
    NO_HOST_KEY = "NO_HOST_KEY"
    # The time limit of the work in the session passed.
    TIMEOUT = "TIMEOUT"
    # SSH or the network failed during the work.
    BROKEN = "BROKEN"
    # The SFTP server refused the upload.
    UPLOAD_FAILED = "UPLOAD_FAILED"
    # A command wrote more to its standard output than it was allowed to.
    OUTPUT_TOO_LONG = "OUTPUT_TOO_LONG"


class SSHSessionError(Exception):
    """An SSH session failed: which way, at which host:port, while doing what, and why."""

    def __init__(
        self,
        failure: SSHFailure,
        host_port: str,
        doing: str,
        detail: str,
        time_limit: float | None = None,
        path: str | None = None,
    ) -> None:
        # The detail is mostly the server's words: a hostile sshd's disconnect reason may be 200 KB of escapes.
        detail = foreign_text(detail, DETAIL_LIMIT)
        super().__init__(f"SSH to {host_port} failed ({failure}) while {doing}: {detail}")
        self.failure = failure
        self.host_port = host_port
        # What the session was doing, in the words of whoever asked for it ("running the agent").
        self.doing = doing
        self.detail = detail
        # The time limit of what was being done, where one applied: the one that passed, for a timeout.
        self.time_limit = time_limit
        # The remote file an upload was writing.
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        # The constructor's arguments are not the message: rebuild from them when pickled or copied.
        return (type(self), (self.failure, self.host_port, self.doing, self.detail, self.time_limit, self.path))


@dataclass(frozen=True)
class CommandRun:
    """What running a command over SSH gave back: its output, the end of its stderr, and how it exited."""

    stdout: bytes
    stderr: bytes
    exit_status: int | None
    exit_signal: str | None


class SSHSession:
    """One SSH session to a machine, opened by ``async with`` and closed on leaving it."""

    def __init__(self, login: SSHLogin, client_key: asyncssh.SSHKey, connect_timeout: float) -> None:
        self.login = login
        self._client_key = client_key
        # Also the grace period of the close.
        self._connect_timeout = connect_timeout
        self._connection: asyncssh.SSHClientConnection | None = None
        self._doing = _CONNECTING
        self._time_limit: float | None = None

    async def __aenter__(self) -> SSHSession:
        """Log in; SSHSessionError when no session can be had, or the host key is not the pinned one."""
        known_hosts, host_key_algorithms = self._host_key_check()
        self._time_limit = self._connect_timeout
        with self._failures():
            async with asyncio.timeout(self._connect_timeout):
                self._connection = await asyncssh.connect(
                    self.login.address,
                    self.login.port,
                    username=self.login.username,
                    known_hosts=known_hosts,
                    server_host_key_algs=host_key_algorithms,
                    client_keys=[self._client_key],
                    # Only the given key: nothing from the worker's ~/.ssh, its SSH agent or its config.
                    agent_path=None,
                    config=[],
                    password=None,
                    kbdint_auth=False,
                    gss_auth=False,
                    preferred_auth="publickey",
                )
        self._time_limit = None
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        """Close the session, cutting it when the server does not answer the close within the connect timeout."""
        connection = self._opened()
        connection.close()
        try:
            async with asyncio.timeout(self._connect_timeout):
                await connection.wait_closed()
        except TimeoutError:
            # A server that does not answer our close must not hold the caller.
            connection.abort()

    def host_key(self) -> str:
        """The host key the server showed, as an OpenSSH public key line."""
        key = self._opened().get_server_host_key()
        if key is None:
            raise SSHSessionError(SSHFailure.NO_HOST_KEY, self.login.host_port, _CONNECTING, "it showed no host key")
        return key.export_public_key("openssh").decode().strip()

    @asynccontextmanager
    async def time_limit(self, seconds: float) -> AsyncIterator[None]:
        """Bound the work inside to seconds; past them, SSHSessionError TIMEOUT says what the session was doing."""
        self._time_limit = seconds
        try:
            with self._failures():
                async with asyncio.timeout(seconds):
                    yield
        finally:
            self._time_limit = None

    async def run(self, command: str, stdin: bytes, *, doing: str, stdout_limit: int) -> CommandRun:
        """Run command with stdin, then end of input; its output and exit (OUTPUT_TOO_LONG past stdout_limit bytes)."""
        self._doing = doing
        with self._failures():
            process: asyncssh.SSHClientProcess[bytes] = await self._opened().create_process(command, encoding=None)
            try:
                self._send_input(process, stdin)
                readers = asyncio.gather(
                    self._read_at_most(process.stdout, stdout_limit), _read_tail(process.stderr, STDERR_KEPT)
                )
                try:
                    stdout, stderr = await readers
                except BaseException:
                    # Stop the other reader too; gather leaves it running otherwise.
                    readers.cancel()
                    raise
                await process.wait_closed()
                signal = process.exit_signal
                return CommandRun(
                    stdout=stdout,
                    stderr=stderr,
                    exit_status=process.exit_status,
                    # The signal's name is the server's word, as any other.
                    exit_signal=foreign_text(signal[0], 64) if signal else None,
                )
            except BaseException:
                # Timed out or gave up: ask the server to kill the command so it does not run on beside the next
                # attempt. Best effort: servers may refuse (OpenSSH does for sessions without privilege
                # separation, such as root's).
                if process.exit_status is None:
                    try:
                        process.kill()
                    except (OSError, asyncssh.Error):
                        pass
                raise
            finally:
                process.close()

    def _send_input(self, process: asyncssh.SSHClientProcess[bytes], stdin: bytes) -> None:
        """Send the command its input, then end of input; nothing when the command has already ended.

        A command that ends at once (a login shell that runs nothing) may have closed its channel before its input
        is sent, more often the busier this host is, and asyncssh then refuses any write, even of nothing, with
        BrokenPipeError ("Channel not open for sending"). That is no broken session: what the command wrote and
        how it exited are still there to be read, and say what happened. Only a lost connection is one.
        """
        try:
            process.stdin.write(stdin)
            # Closing stdin tells the command the whole input has arrived.
            process.stdin.write_eof()
        except BrokenPipeError:
            if self._opened().is_closed():
                raise

    async def upload(self, path: str, data: bytes, *, doing: str) -> None:
        """Write data to path as an executable file beside it, then rename it over: nobody sees half a file."""
        self._doing = doing
        directory, name = posixpath.split(path)
        # Unique, so two uploads to one path (a retry beside a stalled attempt) never write the same file.
        temporary = posixpath.join(directory, f".{name}.{secrets.token_hex(4)}.upload")
        with self._failures():
            try:
                async with self._opened().start_sftp_client() as sftp:
                    try:
                        # Exclusive: in a directory others may write to, a link planted under the name is not
                        # followed.
                        async with sftp.open(temporary, "xb") as file:
                            await file.write(data)
                        await sftp.chmod(temporary, 0o755)
                        try:
                            await sftp.posix_rename(temporary, path)
                        except asyncssh.SFTPOpUnsupported:
                            # Plain SFTP rename refuses to replace a file: remove the old one first.
                            if await sftp.exists(path):
                                await sftp.remove(path)
                            await sftp.rename(temporary, path)
                    except asyncssh.SFTPError:
                        await _remove_quietly(sftp, temporary)
                        raise
            except (asyncssh.SFTPError, asyncssh.ChannelOpenError) as error:
                raise self._error(SSHFailure.UPLOAD_FAILED, error.reason or type(error).__name__, path) from None

    def _host_key_check(self) -> tuple[Any, Any]:
        """asyncssh's known_hosts and server host key algorithms that let the pinned host key alone pass."""
        if self.login.pinned_host_key is None:
            # No known_hosts: any host key is accepted and reported (first contact); asyncssh's default algorithms.
            return None, ()
        try:
            pinned = asyncssh.import_public_key(self.login.pinned_host_key)
        except (asyncssh.KeyImportError, ValueError) as error:
            raise self._error(SSHFailure.PIN_UNREADABLE, str(error)) from None
        # Trusted host keys, trusted CA keys, revoked keys: only the pinned key passes, and asyncssh checks it in
        # the handshake, before we send anything. The pinned key's algorithms first, so a server that still has
        # that key shows it; then every other, so a server that has lost it shows another key and fails the
        # check, rather than ending the handshake with nothing but a reset connection.
        return ([pinned], [], []), [
            *(algorithm.decode() for algorithm in pinned.sig_algorithms),
            *(algorithm.decode() for algorithm in get_default_public_key_algs()),
        ]

    @contextmanager
    def _failures(self) -> Iterator[None]:
        """Raise what asyncssh, the network or a time limit raises as the one SSHSessionError it is."""
        try:
            yield
        # TimeoutError is an OSError: a time limit that passed is caught here too.
        except (asyncssh.Error, OSError) as error:
            raise self._error(self._failure_of(error), str(error)) from None

    def _failure_of(self, error: asyncssh.Error | OSError) -> SSHFailure:
        """Which failure an exception is: a refusal or a rejection means one thing while logging in only."""
        connecting = self._connection is None
        if isinstance(error, TimeoutError) and self._time_limit is not None:
            return SSHFailure.CONNECT_TIMEOUT if connecting else SSHFailure.TIMEOUT
        if not connecting:
            return SSHFailure.BROKEN
        if isinstance(error, ConnectionRefusedError):
            return SSHFailure.CONNECT_REFUSED
        if isinstance(error, asyncssh.PermissionDenied):
            return SSHFailure.AUTH_REJECTED
        if isinstance(error, asyncssh.HostKeyNotVerifiable):
            return SSHFailure.HOST_KEY_CHANGED
        return SSHFailure.CONNECT_FAILED

    def _error(self, failure: SSHFailure, detail: str, path: str | None = None) -> SSHSessionError:
        return SSHSessionError(failure, self.login.host_port, self._doing, detail, self._time_limit, path)

    def _opened(self) -> asyncssh.SSHClientConnection:
        if self._connection is None:
            raise RuntimeError("the SSH session is used outside its async with")
        return self._connection

    async def _read_at_most(self, stream: asyncssh.SSHReader[bytes], limit: int) -> bytes:
        received = bytearray()
        while chunk := await stream.read(READ_CHUNK):
            received += chunk
            if len(received) > limit:
                raise self._error(SSHFailure.OUTPUT_TOO_LONG, f"more than {limit} bytes on standard output")
        return bytes(received)


async def _read_tail(stream: asyncssh.SSHReader[bytes], keep: int) -> bytes:
    # Read to the end, so the command never blocks on a full stderr, but keep only the last bytes.
    kept = bytearray()
    while chunk := await stream.read(READ_CHUNK):
        kept += chunk
        del kept[:-keep]
    return bytes(kept)


async def _remove_quietly(sftp: asyncssh.SFTPClient, path: str) -> None:
    try:
        await sftp.remove(path)
    except asyncssh.SFTPError:
        # Most likely it was never created; the next upload overwrites it anyway.
        pass


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


def host_key_fingerprint(openssh_line: str) -> str:
    """The SHA256 fingerprint of an OpenSSH public key line, as ssh-keygen -l shows it."""
    try:
        return str(asyncssh.import_public_key(openssh_line).get_fingerprint("sha256"))
    except (asyncssh.KeyImportError, ValueError):
        return "an unreadable key"
