"""This host's files a worker needs: Shepherd's SSH key and the agent executables it uploads."""

from __future__ import annotations

import math
import os

from foundation.executables import NotAnExecutable, read_agent_executable
from foundation.ssh_identity import SSHIdentityError, load_ssh_key
from shepherd.commands.doctor_checks.checkup import Checkup
from shepherd.commands.doctor_checks.verdicts import Verdict, fail, ok, warn


class HostFileChecks(Checkup):
    """The checks of the files on this host."""

    async def local_checks(self) -> None:
        """Check this host's SSH key and agent executables."""
        await self.check("ssh key", self.ssh_key)
        await self.check("agent executable", self.agent_executable)

    async def ssh_key(self) -> Verdict:
        """Whether Shepherd's SSH key is there and readable as ed25519."""
        path = self.settings.effective_ssh_key_path
        try:
            key = load_ssh_key(path)
        except FileNotFoundError:
            return warn(
                f"no key at {path} (ssh_key_path): a worker creates one when it starts, and machines must then "
                "trust it (`shepherd ssh-key`); on a worker's host, check state_dir and ssh_key_path",
                path=str(path),
            )
        except SSHIdentityError as error:
            fail(str(error), path=str(path))
        except OSError as error:
            fail(f"SSH key {path}: {error.strerror or error}", path=str(path))
        mode = f"{path.stat().st_mode & 0o777:04o}"
        return ok(f"{path}: ed25519 {key.get_fingerprint()}, mode {mode}", path=str(path), mode=mode)

    async def agent_executable(self) -> Verdict:
        """Whether each agent executable is a file a worker would hand out, and which machines it runs on."""
        paths = self.settings.agent_executable_paths
        if not paths:
            fail("agent_executable_path is not set (SHEPHERD_AGENT_EXECUTABLE_PATH): workers have no agent to upload")
        shown, facts = [], []
        for path in paths:
            if not path.exists():
                fail(f"{path} does not exist (agent_executable_path)", path=str(path))
            if not path.is_file():
                fail(f"{path} is not a regular file (agent_executable_path)", path=str(path))
            if not os.access(path, os.R_OK):
                fail(f"{path} cannot be read by this user (agent_executable_path)", path=str(path))
            size = path.stat().st_size
            try:
                # What a worker checks before it hands the file out (an empty one among others): a file it would
                # refuse fails every takeover.
                agent = read_agent_executable(path)
            except NotAnExecutable as error:
                fail(f"{error} (agent_executable_path)", path=str(path), size_bytes=size)
            size_text = f"{size / 1_000_000:.1f} MB" if size >= 1_000_000 else f"{math.ceil(size / 1000)} kB"
            shown.append(f"{path}, {size_text}, sha256 {agent.sha256[:16]}, for {agent.target.describe()}")
            facts.append(
                {"path": str(path), "size_bytes": size, "sha256": agent.sha256, "runs_on": agent.target.describe()}
            )
        if len(facts) == 1:
            return ok(shown[0], **facts[0])
        return ok("; ".join(shown), executables=facts)
