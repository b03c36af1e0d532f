"""One simulated machine: a real SSH server whose exec runs real processes.

Auth is key-only for root with the key given at creation; SFTP is chrooted to
the machine's own directory; an exec'd path inside it runs as a process of
this host, in its own session so that it may outlive the SSH session, as a
detached agent does. ``sh -c SCRIPT NAME ARG...``, the form of every command
Shepherd sends, runs this host's shell with each ARG that is an absolute path
taken inside the machine's directory, as the machine's own shell would see it;
its temporary directory is the machine's ``/tmp``. A reboot kills those
processes, empties ``/tmp`` and keeps SSH down for the boot time; a reimage
does the same on a fresh disk, with a new host key and the key it was given.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import shutil
import signal
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import asyncssh

from foundation.procfs import processes_with_any_variable

log = logging.getLogger("simulator.machine")

EXIT_NOT_FOUND = 127
# Set in the environment of every process a machine's SSH starts, to its root directory: how its processes are found.
MACHINE_ROOT_VARIABLE = "SHEPHERD_SIM_MACHINE_ROOT"
# After the process exits, how long output still held open by a detached
# child may keep the channel open.
_OUTPUT_GRACE = 1.0


class _MachineSSHServer(asyncssh.SSHServer):
    """One SSH connection to a simulated machine, server side: root may log in with the machine's key only."""

    def __init__(self, machine: SimulatedMachine) -> None:
        self.machine = machine

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self.machine.connections.add(conn)
        self._conn = conn

    def connection_lost(self, exc: Exception | None) -> None:
        self.machine.connections.discard(self._conn)

    def begin_auth(self, username: str) -> bool:
        return True

    def password_auth_supported(self) -> bool:
        return False

    def kbdint_auth_supported(self) -> bool:
        return False

    def public_key_auth_supported(self) -> bool:
        return True

    def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        return username == "root" and key.export_public_key("openssh").split()[:2] == self.machine.authorized_key


class SimulatedMachine:
    """One created machine of the simulator: its SSH server, the processes run through it, its reboots."""

    def __init__(
        self,
        machine_id: str,
        root_dir: Path,
        host_key: str,
        authorized_key: str,
        ssh_host: str,
        ssh_port: int,
        exec_delay: Callable[[], float],
    ) -> None:
        self.machine_id = machine_id
        self.root_fs = root_dir / "root-fs"
        (self.root_fs / "root").mkdir(parents=True, exist_ok=True)
        self.host_key = asyncssh.import_private_key(host_key)
        self.authorized_key = _key_words(authorized_key)
        self.ssh_host = ssh_host
        self.ssh_port = ssh_port
        self.exec_delay = exec_delay
        self.connections: set[asyncssh.SSHServerConnection] = set()
        self.status = "active"
        # When the machine was last reset (rebooted, reimaged), as a BMC's LastResetTime says; None before any.
        self.last_reset_at: datetime | None = None
        self._server: asyncssh.SSHAcceptor | None = None
        self._boot: asyncio.Task[None] | None = None

    @property
    def listening(self) -> bool:
        """Whether the machine's SSH server is up."""
        return self._server is not None

    async def start_ssh(self) -> None:
        """Start the machine's SSH server on its recorded port, or on a new one if that is taken."""
        if self._server is not None:
            return
        try:
            self._server = await self._listen(self.ssh_port)
        except OSError:
            # The recorded port is taken: the machine gets a new one, as after a re-IP.
            self._server = await self._listen(0)
        self.ssh_port = self._server.sockets[0].getsockname()[1]

    async def _listen(self, port: int) -> asyncssh.SSHAcceptor:
        return await asyncssh.create_server(
            lambda: _MachineSSHServer(self),
            self.ssh_host,
            port,
            server_host_keys=[self.host_key],
            process_factory=self._run_command,
            sftp_factory=lambda chan: asyncssh.SFTPServer(chan, chroot=str(self.root_fs).encode()),
            encoding=None,
            allow_scp=False,
            agent_forwarding=False,
            x11_forwarding=False,
            line_editor=False,
        )

    async def stop_ssh(self) -> None:
        """Stop the machine's SSH server and close the connections to it."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for conn in list(self.connections):
            conn.close()

    def _inside(self, argument: str) -> str:
        """An argument as this host sees it: an absolute path is taken inside the machine's directory."""
        return str(self.root_fs / argument.lstrip("/")) if argument.startswith("/") else argument

    @property
    def process_marker(self) -> bytes:
        """The NAME=value in the environment of every process started through this machine's SSH."""
        return f"{MACHINE_ROOT_VARIABLE}={self.root_fs}".encode()

    def kill_processes(self) -> int:
        """Kill every process started through this machine's SSH, detached ones included."""
        return kill_machine_processes([self])

    def _power_off(self) -> int:
        """Kill every process of the machine and empty its /tmp, as a reboot or a power-off does; how many died."""
        return power_off([self])

    async def reboot(self, boot_seconds: float, refused: Callable[[], bool]) -> None:
        """Power the machine off and take SSH down; it boots again after boot_seconds, SSH up unless refused()."""
        killed = self._power_off()
        log.info("machine %s rebooting: killed %d process group(s)", self.machine_id, killed)
        await self.stop_ssh()
        self._boot_after(boot_seconds, refused, "rebooting")

    async def reimage(
        self, host_key: str, authorized_key: str, boot_seconds: float, refused: Callable[[], bool]
    ) -> None:
        """Reboot the machine onto a fresh disk: all its files wiped, host_key its SSH server's, authorized_key the
        one root logs in with. OSError if the disk cannot be wiped: the machine is left down, its old keys kept."""
        # SSH first: no new command may start a process between the kill and the wipe.
        await self.stop_ssh()
        killed = self._power_off()
        # What the machine held (the agent, its key and log, whatever else was put there) is gone with the old OS.
        shutil.rmtree(self.root_fs)
        (self.root_fs / "root").mkdir(parents=True)
        self.host_key = asyncssh.import_private_key(host_key)
        self.authorized_key = _key_words(authorized_key)
        log.info("machine %s reimaging: killed %d process group(s), wiped its disk", self.machine_id, killed)
        self._boot_after(boot_seconds, refused, "reimaging")

    def _boot_after(self, boot_seconds: float, refused: Callable[[], bool], status: str) -> None:
        """Keep the machine in status, down, until it boots after boot_seconds, SSH up unless refused()."""
        self.status = status
        self.last_reset_at = datetime.now(UTC)
        # A boot under way is superseded: the machine went down again before it was up.
        if self._boot is not None:
            self._boot.cancel()

        async def boot() -> None:
            await asyncio.sleep(boot_seconds)
            self.status = "active"
            if not refused():
                await self.start_ssh()
            log.info("machine %s booted", self.machine_id)

        self._boot = asyncio.create_task(boot())

    async def shutdown(self) -> None:
        """Cancel a boot under way, power the machine off and stop its SSH server."""
        if self._boot is not None:
            self._boot.cancel()
        self._power_off()
        await self.stop_ssh()

    async def _run_command(self, process: asyncssh.SSHServerProcess[bytes]) -> None:
        command = process.command
        if not command:
            process.stderr.write(b"this machine offers no shell\n")
            process.exit(1)
            return
        try:
            argv = shlex.split(command)
        except ValueError as error:
            process.stderr.write(f"sh: {error}\n".encode())
            process.exit(2)
            return
        if len(argv) >= 3 and argv[0] in ("sh", "/bin/sh") and argv[1] == "-c":
            # The script stays as sent; its path arguments are the machine's paths.
            program, arguments = "/bin/sh", ["-c", argv[2], *argv[3:4], *map(self._inside, argv[4:])]
            cwd = self.root_fs / "root"
        else:
            path = self.root_fs / argv[0].lstrip("/")
            if not path.resolve().is_relative_to(self.root_fs.resolve()) or not path.is_file():
                process.stderr.write(f"{argv[0]}: not found\n".encode())
                process.exit(EXIT_NOT_FOUND)
                return
            if not os.access(path, os.X_OK):
                process.stderr.write(f"{argv[0]}: permission denied\n".encode())
                process.exit(126)
                return
            program, arguments, cwd = str(path), argv[1:], path.parent
        delay = self.exec_delay()
        if delay:
            await asyncio.sleep(delay)
        log.info("machine %s exec %s", self.machine_id, command[:200])
        (self.root_fs / "tmp").mkdir(exist_ok=True)
        child = await asyncio.create_subprocess_exec(
            program,
            *arguments,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=cwd,
            env={
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "HOME": str(self.root_fs / "root"),
                "TMPDIR": str(self.root_fs / "tmp"),
                MACHINE_ROOT_VARIABLE: str(self.root_fs),
            },
            start_new_session=True,
        )
        assert child.stdin and child.stdout and child.stderr
        pumps = [
            asyncio.create_task(_pump_stdin(process, child.stdin)),
            asyncio.create_task(_pump_output(child.stdout, process.stdout)),
            asyncio.create_task(_pump_output(child.stderr, process.stderr)),
        ]
        code = await child.wait()
        # Output held open by a detached grandchild must not hold the session.
        _, pending = await asyncio.wait(pumps[1:], timeout=_OUTPUT_GRACE)
        for task in [pumps[0], *pending]:
            task.cancel()
        process.exit(code if code >= 0 else 128 - code)


def _key_words(openssh_line: str) -> list[bytes]:
    """The key type and base64 of an OpenSSH public key line, what a login's key is compared with; no comment."""
    return openssh_line.encode().split()[:2]


async def _pump_stdin(process: asyncssh.SSHServerProcess[bytes], stdin: asyncio.StreamWriter) -> None:
    try:
        while data := await process.stdin.read(65536):
            stdin.write(data)
            await stdin.drain()
    except (BrokenPipeError, ConnectionResetError, asyncssh.Error):
        pass
    finally:
        with contextlib.suppress(Exception):
            stdin.close()


async def _pump_output(source: asyncio.StreamReader, sink: asyncssh.SSHWriter[bytes]) -> None:
    while data := await source.read(65536):
        try:
            sink.write(data)
        except (asyncssh.Error, BrokenPipeError, ConnectionError):
            return


def kill_machine_processes(machines: Iterable[SimulatedMachine]) -> int:
    """Kill every process started through these machines' SSH, detached ones included, in one look at /proc; how
    many were killed.

    A detached agent may have left the process group it was started in, so processes are found by their machine's
    marker in their environment.
    """
    killed = 0
    for pid in processes_with_any_variable({machine.process_marker for machine in machines}):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            killed += 1
    return killed


def power_off(machines: Sequence[SimulatedMachine]) -> int:
    """Kill every process of these machines, in one look at /proc, and empty their /tmp, as a power-off does; how
    many processes died. Their SSH servers stay up."""
    killed = kill_machine_processes(machines)
    for machine in machines:
        # What its processes unpacked there goes with them, as a real /tmp is emptied at boot.
        shutil.rmtree(machine.root_fs / "tmp", ignore_errors=True)
    return killed
