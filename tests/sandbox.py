"""A Shepherd process confined by hand as the deploy files confine it, since neither systemd nor Kubernetes runs
here: the same kernel features their directives use, applied to one process of a test.

- A mount namespace of its own whose root file system is read-only but for each writable path the unit or pod
  gives it (ProtectSystem=strict with StateDirectory=, readOnlyRootFilesystem with a volume), and a
  private temporary directory (PrivateTmp=, the pods' /tmp emptyDir): a tmpfs of its own given as TMPDIR, since
  one over /tmp would hide the test's own files there (PostgreSQL's socket among them).
- /proc mounted as the unit's ProtectProc= and ProcSubset= say: only the processes it may see, and only them
  (no /proc/meminfo, /proc/sys, ...) with ProcSubset=pid.
- No capabilities, and no way to gain any (CapabilityBoundingSet= empty, NoNewPrivileges=; Kubernetes' drop ALL
  and allowPrivilegeEscalation: false). The process keeps uid 0 without them, so it can still reach the test's
  own files; a read-only mount and no CAP_SYS_ADMIN leave it nothing to write there. Files of other users it
  reaches as others do: a Unix socket in a directory of another user's (PostgreSQL's) is bound where it can.
- No memory both writable and executable (MemoryDenyWriteExecute=, as the kernel's PR_SET_MDWE does it).
- Only the system calls of the unit's SystemCallFilter= lines, the others failing with EPERM
  (SystemCallErrorNumber=), through libseccomp as systemd builds its filter, and only native ones
  (SystemCallArchitectures=); the groups are read from `systemd-analyze syscall-filter`.

Needs root (the mounts) and unshare and setpriv (util-linux), systemd-analyze and libseccomp (systemd's).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

# Run by the confined interpreter before it becomes the Shepherd process: W^X, then the filter, then exec.
_LAUNCHER = """
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 1
if libc.prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0) != 0:
    sys.exit(f"PR_SET_MDWE: {os.strerror(ctypes.get_errno())}")
seccomp = ctypes.CDLL("libseccomp.so.2")
seccomp.seccomp_init.restype = ctypes.c_void_p
seccomp.seccomp_init.argtypes = [ctypes.c_uint32]
seccomp.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
seccomp.seccomp_load.argtypes = [ctypes.c_void_p]
seccomp.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
SCMP_ACT_ALLOW, SCMP_ACT_ERRNO = 0x7FFF0000, 0x00050000
context = seccomp.seccomp_init(SCMP_ACT_ERRNO | errno.EPERM)
for name in os.environ.pop("SANDBOX_SYSCALLS").split():
    number = seccomp.seccomp_syscall_resolve_name(name.encode())
    if number >= 0 and seccomp.seccomp_rule_add(context, SCMP_ACT_ALLOW, number, 0) != 0:
        sys.exit(f"seccomp_rule_add {name} failed")
if seccomp.seccomp_load(context) != 0:
    sys.exit("seccomp_load failed")
os.execv(sys.argv[1], sys.argv[1:])
"""


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed (Debian: apt-get install util-linux systemd)")
    return found


def _group(name: str, analyze: str, seen: set[str]) -> set[str]:
    """The system calls of a `systemd-analyze syscall-filter` group, its nested groups expanded."""
    if name in seen:
        return set()
    seen.add(name)
    listing = subprocess.run([analyze, "syscall-filter", name], capture_output=True, text=True, check=True).stdout
    calls: set[str] = set()
    for line in listing.splitlines()[1:]:  # the first line is the group's own name
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        calls |= _group(entry, analyze, seen) if entry.startswith("@") else {entry}
    return calls


def allowed_syscalls(filters: Sequence[str]) -> set[str]:
    """The system calls a unit's SystemCallFilter= lines allow, read as systemd does: the first line without ~
    starts an allow list, every later line adds to it, or takes away with ~."""
    analyze = _tool("systemd-analyze")
    allowed: set[str] = set()
    for line in filters:
        deny = line.startswith("~")
        names: set[str] = set()
        for entry in line.lstrip("~").split():
            names |= _group(entry, analyze, set()) if entry.startswith("@") else {entry}
        allowed = allowed - names if deny else allowed | names
    return allowed


def confined(
    argv: Sequence[str],
    *,
    syscall_filter: Sequence[str],
    writable: Sequence[Path],
    private_tmp: Path,
    env: dict[str, str],
    protect_proc: str = "default",
    proc_subset: str = "all",
    sockets: Mapping[Path, Path] | None = None,
) -> list[str]:
    """The command line that runs argv (a program and its arguments) confined: each writable path writable (made
    here if missing), a tmpfs at private_tmp as its TMPDIR, each Unix socket of sockets bound where it maps to,
    and the system calls syscall_filter allows, with /proc as ProtectProc= and ProcSubset= of those values make
    it; env is what the child gets, with what the confinement adds."""
    if os.geteuid() != 0:
        pytest.fail("confining a process takes root: its mounts")
    env["SANDBOX_SYSCALLS"] = " ".join(sorted(allowed_syscalls(syscall_filter)))
    env["TMPDIR"] = str(private_tmp)
    for path in [*writable, private_tmp]:
        path.mkdir(parents=True, exist_ok=True)
    # A writable path keeps what it holds (a unit's state directory outlives the process): bound onto itself, it
    # is a mount of its own, which the root's read-only remount leaves writable.
    mounts = [f"mount --bind {shlex.quote(str(path))} {shlex.quote(str(path))}" for path in writable]
    mounts.append(f"mount -t tmpfs -o mode=0700 tmpfs {shlex.quote(str(private_tmp))}")
    for socket, seen_at in (sockets or {}).items():
        seen_at.parent.mkdir(parents=True, exist_ok=True)
        seen_at.touch()
        mounts.append(f"mount --bind {shlex.quote(str(socket))} {shlex.quote(str(seen_at))}")
    proc = [f"hidepid={protect_proc}"] if protect_proc != "default" else []
    proc += ["subset=pid"] if proc_subset == "pid" else []
    mounts += [f"mount -t proc -o {','.join(proc)} proc /proc" if proc else "true", "mount -o remount,bind,ro /"]
    confine = [
        _tool("setpriv"),
        "--no-new-privs",
        "--bounding-set=-all",
        "--inh-caps=-all",
        "--ambient-caps=-all",
        sys.executable,
        "-c",
        _LAUNCHER,
        *argv,
    ]
    script = " && ".join([*mounts, f"exec {shlex.join(confine)}"])
    return [_tool("unshare"), "--mount", "--propagation", "private", "--", "sh", "-c", script]
