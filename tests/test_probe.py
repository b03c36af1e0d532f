"""The machine probe before an upload: what a machine says it is, which agent executable runs there, and every way
a machine or its target directory refuses the agent, tried on a machine with SSH and nothing else."""

from __future__ import annotations

import platform
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from agent.build import build_agent_executable
from foundation.executables import AgentExecutable, executable_problem, executable_target
from foundation.settings import Settings
from lifecycle.probe import (
    FALLBACK_TMP_NAME,
    ProbeError,
    choose_agent,
    parse_probe,
)
from lifecycle.takeover import TakeoverSettings, take_over
from lifecycle.takeover_failures import TakeoverError, TakeoverFailure, TakeoverTarget
from tests.elf_files import AARCH64, elf
from tests.sshd_fixtures import BareMachine, bare_machine_fixture  # noqa: F401 (a pytest fixture)

ENDPOINT = "127.0.0.1:1"
GOOD_ANSWER = """\
shepherd-probe:arch=x86_64
shepherd-probe:kernel=Linux
shepherd-probe:libc=glibc 2.36
shepherd-probe:target=ok
shepherd-probe:target_free_kib=1000000
shepherd-probe:tmp=ok
shepherd-probe:tmp_free_kib=1000000
"""


def test_the_worker_reads_which_machine_an_executable_is_for():
    assert executable_problem(elf(AARCH64)) is None
    assert executable_target(elf(AARCH64)).describe() == "aarch64, glibc"
    musl = elf(AARCH64, interpreter=b"/lib/ld-musl-aarch64.so.1")
    assert executable_target(musl).describe() == "aarch64, musl"
    assert executable_target(elf(243, interpreter=None)).describe() == "riscv64, static"
    built = executable_target(elf(62, manifest={"glibc": "2.31", "unpacked_kib": "32000"}))
    assert (built.describe(), built.unpacked_kib) == ("x86_64, glibc 2.31 or newer", 32000)
    assert executable_target(b"#!/bin/sh\nexit 0\n").describe() == "a script (any architecture)"


def test_a_damaged_elf_or_manifest_tells_less_and_never_fails():
    assert executable_target(elf(62, manifest={"glibc": "two", "unpacked_kib": []})).describe() == "x86_64, glibc"
    whole = elf(62, manifest={"glibc": "2.31", "unpacked_kib": "1"})
    for cut in range(0, len(whole), 7):
        target = executable_target(whole[:cut])
        assert target.arch in (None, "x86_64"), cut
    assert executable_target(b"\x7fELF\x09\x09" + bytes(80)).arch is None


def facts(answer: str = GOOD_ANSWER, target_path: str = "/root/agent"):
    return parse_probe(answer, target_path)


def test_a_probe_answer_is_read_past_a_banner_and_names_the_machine():
    machine = facts("Welcome to rack 7!\n\x1b[1mhello\x1b[0m\n" + GOOD_ANSWER)
    assert machine.describe() == "x86_64 with glibc 2.36"
    assert machine.target.path == "/root" and machine.target.free_kib == 1000000
    assert facts(GOOD_ANSWER.replace("x86_64", "armv7l")).arch == "arm"
    assert facts(GOOD_ANSWER.replace("glibc 2.36", "glibc unknown")).describe() == "x86_64 with glibc"
    assert facts(GOOD_ANSWER.replace("glibc 2.36", "musl")).describe() == "x86_64 with musl"


@pytest.mark.parametrize(
    ("answer", "problem"),
    [
        ("", "no line of it"),
        ("\x00\xff garbage\n" * 50, "no line of it"),
        (GOOD_ANSWER.replace("kernel=Linux", "kernel=FreeBSD"), "its kernel is 'FreeBSD'"),
        (GOOD_ANSWER.replace("arch=x86_64", "arch=x86 64; rm -rf /"), "which is no architecture"),
        (GOOD_ANSWER.replace("arch=x86_64", "arch="), "which is no architecture"),
        (GOOD_ANSWER.replace("libc=glibc 2.36", "libc=\x1b[31mred"), "which is no C library"),
        (GOOD_ANSWER.replace("target=ok", "target=maybe"), "not one of ok, missing, unwritable, noexec"),
        ("\n".join(line for line in GOOD_ANSWER.splitlines() if "tmp=" not in line), "answer on /tmp is ''"),
    ],
    ids=["empty", "binary", "not-linux", "odd-arch", "no-arch", "odd-libc", "odd-state", "no-tmp"],
)
def test_an_unreadable_probe_answer_is_a_clear_error(answer, problem):
    with pytest.raises(ProbeError, match=problem.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        facts(answer)


def agent(data: bytes) -> AgentExecutable:
    return AgentExecutable.of(data)


def test_the_agent_for_the_machine_is_chosen_and_a_machine_none_runs_on_is_named():
    machine = facts()
    arm, x86 = agent(elf(AARCH64)), agent(elf(62, manifest={"glibc": "2.31", "unpacked_kib": "100"}))
    assert choose_agent(machine, [arm, x86]) is x86
    assert choose_agent(machine, [arm]) == (
        "the machine is x86_64 with glibc 2.36; the agent executable is built for aarch64"
    )
    newer = agent(elf(62, manifest={"glibc": "2.39", "unpacked_kib": "100"}))
    assert choose_agent(machine, [newer]) == (
        "the machine is x86_64 with glibc 2.36; the agent executable needs glibc 2.39 or newer"
    )
    on_musl = facts(GOOD_ANSWER.replace("glibc 2.36", "musl"))
    assert choose_agent(on_musl, [x86]) == (
        "the machine is x86_64 with musl; the agent executable needs glibc, the machine has musl"
    )
    assert choose_agent(machine, [arm, newer]) == (
        "the machine is x86_64 with glibc 2.36; none of the 2 agent executables runs there "
        "(aarch64, glibc; x86_64, glibc 2.39 or newer)"
    )
    script = agent(b"#!/bin/sh\nexit 0\n")
    assert choose_agent(on_musl, [script]) is script


# --- on a machine with SSH and nothing else -------------------------------------------


@pytest.fixture(scope="module")
def reference_agent(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return build_agent_executable(tmp_path_factory.mktemp("agent") / "agent").read_bytes()


def target_of(machine: BareMachine) -> TakeoverTarget:
    sshd = machine.sshd
    return TakeoverTarget(machine_id="m-probe", address="127.0.0.1", port=sshd.port, username=sshd.username)


def takeover(agents, target_path: str = "/root/agent") -> TakeoverSettings:
    return TakeoverSettings.of(
        Settings(agent_endpoint=ENDPOINT, agent_target_path=target_path, ssh_exec_timeout=30.0), agents
    )


async def refused(machine: BareMachine, settings: TakeoverSettings) -> TakeoverError:
    with pytest.raises(TakeoverError) as caught:
        await take_over(target_of(machine), settings, machine.sshd.client_key)
    return caught.value


@contextmanager
def login_shell(machine: BareMachine, script: str) -> Iterator[None]:
    """The machine's login shell (root's /bin/bash, a script that runs busybox's sh) replaced for a while."""
    path = machine.root / "bin" / "bash"
    before = path.read_text()
    path.write_text(f"#!/bin/sh\n{script}\n")
    try:
        yield
    finally:
        path.write_text(before)


@contextmanager
def mounted(machine: BareMachine, directory: str, options: str) -> Iterator[Path]:
    """A tmpfs with options mounted at directory of the machine for a while."""
    path = machine.root / directory.lstrip("/")
    path.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True, capture_output=True)


def nothing_uploaded(machine: BareMachine) -> bool:
    return not (machine.root / "root" / "agent").exists() and not list((machine.root / "root").glob(".agent.*"))


@pytest.fixture
def clean_machine(bare_machine: BareMachine) -> Iterator[BareMachine]:
    for path in (bare_machine.root / "root").iterdir():
        if path.is_file():
            path.unlink()
    yield bare_machine


async def test_a_machine_of_another_architecture_is_refused_before_the_upload(clean_machine, reference_agent):
    # A 32-bit personality: the kernel itself tells uname -m that this machine is an i686.
    with login_shell(clean_machine, 'exec linux32 /bin/sh "$@"'):
        error = await refused(clean_machine, takeover(reference_agent))
    assert error.failure is TakeoverFailure.MACHINE_UNSUPPORTED
    assert f"the machine is i686 with glibc {'.'.join(platform.libc_ver()[1].split('.')[:2])}; " in str(error)
    assert str(error).endswith(f"the agent executable is built for {platform.machine()}")
    assert nothing_uploaded(clean_machine)


async def test_the_agent_built_for_the_machine_is_the_one_uploaded(clean_machine, reference_agent):
    agents = [agent(elf(AARCH64)), agent(reference_agent)]
    result = await take_over(target_of(clean_machine), takeover(agents), clean_machine.sshd.client_key)
    assert (clean_machine.root / "root" / "agent").read_bytes() == reference_agent
    assert result.agent_sha256 == agents[1].sha256


async def test_a_machine_that_answers_the_probe_with_garbage_gets_no_upload(clean_machine, reference_agent):
    # A shell that runs no command and answers with 200 kB of binary and a terminal escape.
    with login_shell(clean_machine, "head -c 200000 /bin/busybox; printf 'shepherd-probe:arch=\\033[2J'"):
        error = await refused(clean_machine, takeover(reference_agent))
    assert error.failure is TakeoverFailure.BAD_PROBE, error
    assert "the machine's answer to the probe wrote more than 65536 bytes" in str(error)
    assert nothing_uploaded(clean_machine)
    # A shell that ends at once may close the session's channel before the probe's (empty) input is sent: the
    # answer is still what it wrote. Several tries, since that order shows only now and then, on a busy host.
    with login_shell(clean_machine, "printf 'shepherd-probe:kernel=Linux\\nshepherd-probe:arch=\\033[2J\\n'"):
        for _ in range(8):
            error = await refused(clean_machine, takeover(reference_agent))
            assert error.failure is TakeoverFailure.BAD_PROBE, error
            assert "which is no architecture" in str(error) and len(str(error)) < 1000 and str(error).isprintable()
    assert nothing_uploaded(clean_machine)


async def test_a_target_directory_that_cannot_take_the_agent_is_named(clean_machine, reference_agent):
    error = await refused(clean_machine, takeover(reference_agent, "/proc/agent"))
    assert error.failure is TakeoverFailure.TARGET_UNUSABLE
    assert str(error).endswith("SSH user root cannot write to /proc, the directory of the agent's target path")
    with mounted(clean_machine, "/opt", "noexec,size=64m"):
        error = await refused(clean_machine, takeover(reference_agent, "/opt/agent"))
    assert str(error).endswith(
        "/opt does not allow executing programs (mounted noexec?); set agent_target_path elsewhere"
    )
    with mounted(clean_machine, "/small", "size=4m"):
        error = await refused(clean_machine, takeover(reference_agent, "/small/agent"))
    assert error.failure is TakeoverFailure.TARGET_UNUSABLE
    assert "not enough disk space in /small: 4 MiB free, the agent needs" in str(error)
    assert nothing_uploaded(clean_machine)


async def test_the_agent_unpacks_beside_itself_when_the_machines_tmp_is_noexec(clean_machine, reference_agent):
    with mounted(clean_machine, "/tmp", "noexec,size=256m,mode=1777"):
        result = await take_over(target_of(clean_machine), takeover(reference_agent), clean_machine.sshd.client_key)
    assert len(result.agent_public_key) == 32
    assert (clean_machine.root / "root" / FALLBACK_TMP_NAME).is_dir()
    assert result.warnings[-1] == (
        f"the machine's temporary directory /tmp is noexec: the agent unpacks into /root/{FALLBACK_TMP_NAME}, "
        "which a reboot keeps"
    )
