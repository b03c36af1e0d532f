"""What a machine is, asked before the agent is uploaded: one shell command over the takeover's SSH session.

The probe learns the machine's architecture and C library (glibc's version from getconf, or from its dynamic loader
where getconf is missing, as on a busybox system), and whether the directory of the agent's target path
and the temporary directory (where the one-file agent unpacks itself) exist, can be written, allow executing and
have room. From that the takeover picks the agent executable built for the machine, or refuses the machine in one
line before anything is uploaded.

Every command Shepherd runs on a machine is a constant script for ``sh -c`` with the paths as its positional
arguments: nothing a setting holds is ever spliced into shell code.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from foundation.executables import AgentExecutable, ExecutableTarget

# The name the scripts run under ($0): what a process list on the machine shows.
PROBE_NAME = "shepherd-probe"
RUN_NAME = "shepherd-agent"
# Each answer line starts with this, so a shell start-up file that prints a banner cannot be taken for an answer.
ANSWER_PREFIX = "shepherd-probe:"
PROBE_SCRIPT = r"""
say() { printf 'shepherd-probe:%s=%s\n' "$1" "$2"; }
say arch "$(uname -m 2>/dev/null)"
say kernel "$(uname -s 2>/dev/null)"
libc=$(getconf GNU_LIBC_VERSION 2>/dev/null) || libc=
if [ -z "$libc" ]; then
  for loader in /lib64/ld-linux-*.so.* /lib/ld-linux*.so.* /lib/*/ld-linux*.so.*; do
    [ -f "$loader" ] || continue
    version=$("$loader" --version 2>/dev/null | sed -n '1s/.*version \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p')
    libc="glibc ${version:-unknown}"
    break
  done
fi
if [ -z "$libc" ]; then
  if ls /lib/ld-musl-* >/dev/null 2>&1; then libc=musl; else libc=unknown; fi
fi
say libc "$libc"
check() {
  if [ ! -d "$2" ]; then say "$1" missing; return; fi
  probe="$2/.shepherd-probe.$$"
  if ! (printf '#!/bin/sh\nexit 0\n' > "$probe") 2>/dev/null; then say "$1" unwritable; return; fi
  chmod 700 "$probe" 2>/dev/null
  if "$probe" 2>/dev/null; then say "$1" ok; else say "$1" noexec; fi
  rm -f "$probe"
  say "$1_free_kib" "$(df -Pk "$2" 2>/dev/null | awk 'NR == 2 { print $4 }')"
}
target_dir=${1%/*}
check target "${target_dir:-/}"
tmp=${TMPDIR:-/tmp}
say tmp_path "$tmp"
check tmp "$tmp"
"""
# Runs the agent with $1 as its temporary directory (made if missing), or the machine's own when $1 is empty.
RUN_SCRIPT = 'if [ -n "$1" ]; then mkdir -p "$1" && TMPDIR=$1 && export TMPDIR; fi; shift; exec "$@"'
# Where the one-file agent unpacks itself when the machine's temporary directory cannot take it: beside the agent.
FALLBACK_TMP_NAME = ".shepherd-agent-tmp"
# Room kept free on top of what the agent needs, so the takeover never fills a disk.
SPARE_KIB = 16 << 10
_DIRECTORY_STATES = ("ok", "missing", "unwritable", "noexec")
_GLIBC = re.compile(r"^glibc (\d+)\.(\d+)")
# `uname -m` names -> the names ELF_MACHINES gives (foundation.executables).
_UNAME_ARCH = {
    "amd64": "x86_64",
    "arm64": "aarch64",
    "i386": "i686",
    "i486": "i686",
    "i586": "i686",
    "armv6l": "arm",
    "armv7l": "arm",
    "armv8l": "arm",
}


class ProbeError(ValueError):
    """The machine's answer to the probe is no answer; the message says what is wrong with it."""


@dataclass(frozen=True)
class DirectoryFacts:
    """One directory on the machine, as the probe found it."""

    path: str
    # ok, missing, unwritable or noexec
    state: str
    free_kib: int | None


@dataclass(frozen=True)
class MachineFacts:
    """What the probe learnt of a machine."""

    arch: str
    # glibc, musl or unknown
    libc: str
    glibc: tuple[int, int] | None
    target: DirectoryFacts
    tmp: DirectoryFacts

    def describe(self) -> str:
        """E.g. "x86_64 with glibc 2.36"."""
        if self.glibc is not None:
            return f"{self.arch} with glibc {self.glibc[0]}.{self.glibc[1]}"
        return f"{self.arch} with {'an unknown C library' if self.libc == 'unknown' else self.libc}"


def probe_command(target_path: str) -> str:
    """The command that probes a machine for an agent uploaded to target_path."""
    return shlex.join(["sh", "-c", PROBE_SCRIPT, PROBE_NAME, target_path])


def run_command(target_path: str, tmp_dir: str | None, *arguments: str) -> str:
    """The command that runs the agent at target_path with arguments, unpacking into tmp_dir (None: the
    machine's own temporary directory)."""
    return shlex.join(["sh", "-c", RUN_SCRIPT, RUN_NAME, tmp_dir or "", target_path, *arguments])


def parse_probe(output: str, target_path: str) -> MachineFacts:
    """The facts in the probe's output; ProbeError naming what is missing or unreadable."""
    answers: dict[str, str] = {}
    for line in output.splitlines():
        if line.startswith(ANSWER_PREFIX):
            key, separator, value = line[len(ANSWER_PREFIX) :].partition("=")
            if separator:
                answers.setdefault(key, value.strip())
    if not answers:
        raise ProbeError("the machine answered the probe with no line of it (is its login shell a POSIX shell?)")
    kernel = answers.get("kernel", "")
    if kernel != "Linux":
        raise ProbeError(f"the machine says its kernel is {kernel!r}; the agent runs on Linux")
    arch = answers.get("arch", "")
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,32}", arch):
        raise ProbeError(f"the machine names its architecture {arch[:40]!r}, which is no architecture")
    libc_answer = answers.get("libc", "")
    glibc_version = _GLIBC.match(libc_answer)
    if glibc_version:
        libc, glibc = "glibc", (int(glibc_version[1]), int(glibc_version[2]))
    elif libc_answer == "glibc unknown":
        libc, glibc = "glibc", None
    elif libc_answer in ("musl", "unknown"):
        libc, glibc = libc_answer, None
    else:
        raise ProbeError(f"the machine names its C library {libc_answer[:40]!r}, which is no C library")
    target_dir = target_path.rsplit("/", 1)[0] or "/"
    return MachineFacts(
        arch=_UNAME_ARCH.get(arch, arch),
        libc=libc,
        glibc=glibc,
        target=_directory(answers, "target", target_dir),
        tmp=_directory(answers, "tmp", answers.get("tmp_path") or "/tmp"),
    )


def _directory(answers: dict[str, str], name: str, path: str) -> DirectoryFacts:
    state = answers.get(name, "")
    if state not in _DIRECTORY_STATES:
        raise ProbeError(f"the machine's answer on {path} is {state[:40]!r}, not one of {', '.join(_DIRECTORY_STATES)}")
    free = answers.get(f"{name}_free_kib", "")
    return DirectoryFacts(path=path, state=state, free_kib=int(free) if free.isdigit() else None)


def why_not(facts: MachineFacts, target: ExecutableTarget) -> str | None:
    """Why an executable built for target cannot run on the machine; None when it can (or the file cannot say)."""
    if target.arch is None:
        return None
    if target.arch != facts.arch:
        return f"it is built for {target.arch}"
    if target.libc == "musl" and facts.libc != "musl":
        return "it needs musl libc"
    if target.libc == "glibc":
        if facts.libc != "glibc":
            has = "no C library it could name" if facts.libc == "unknown" else facts.libc
            return f"it needs glibc, the machine has {has}"
        if target.glibc is not None and facts.glibc is not None and facts.glibc < target.glibc:
            return f"it needs glibc {target.glibc[0]}.{target.glibc[1]} or newer"
    return None


def choose_agent(facts: MachineFacts, agents: Sequence[AgentExecutable]) -> AgentExecutable | str:
    """The first of agents that runs on the machine, or why none does, as a sentence about the machine."""
    reasons = []
    for agent in agents:
        reason = why_not(facts, agent.target)
        if reason is None:
            return agent
        reasons.append(reason)
    if len(agents) == 1:
        return f"the machine is {facts.describe()}; the agent executable {reasons[0][3:]}"
    described = "; ".join(agent.target.describe() for agent in agents)
    return f"the machine is {facts.describe()}; none of the {len(agents)} agent executables runs there ({described})"


def where_to_unpack(facts: MachineFacts, agent: AgentExecutable) -> str | None:
    """Where the agent unpacks itself: None for the machine's temporary directory when it can take the agent (it
    is emptied at boot), else a directory beside the agent."""
    if agent.target.unpacked_kib is None:
        return None
    tmp = facts.tmp
    if tmp.state == "ok" and (tmp.free_kib is None or tmp.free_kib >= agent.target.unpacked_kib + SPARE_KIB):
        return None
    return posixpath.join(facts.target.path, FALLBACK_TMP_NAME)


def directory_problem(facts: MachineFacts, agent: AgentExecutable, user: str) -> str | None:
    """Why the agent cannot be uploaded to the probed target directory and run there, in one sentence; None when it
    can."""
    target = facts.target
    if target.state == "missing":
        return f"the directory {target.path} of the agent's target path does not exist"
    if target.state == "unwritable":
        return f"SSH user {user} cannot write to {target.path}, the directory of the agent's target path"
    if target.state == "noexec":
        return f"{target.path} does not allow executing programs (mounted noexec?); set agent_target_path elsewhere"
    needed_kib = len(agent.data) // 1024 + SPARE_KIB
    if where_to_unpack(facts, agent) is not None:
        assert agent.target.unpacked_kib is not None
        needed_kib += agent.target.unpacked_kib
    if target.free_kib is not None and target.free_kib < needed_kib:
        return (
            f"not enough disk space in {target.path}: {target.free_kib // 1024} MiB free, the agent needs "
            f"{needed_kib // 1024} MiB"
        )
    return None
