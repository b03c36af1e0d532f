"""The agent executable and the CA bundle a takeover hands out are their files as they are now: a worker reads a
replaced file at the next takeover, without a restart, and keeps the copy before when the replacement is bad.

Real parts: the simulator's SSH servers and processes, BMDB, Temporal, the worker; the uploaded agent keeps the
TakeoverInit it was sent on the machine, where the test reads it.
"""

from __future__ import annotations

import datetime
import logging
import shlex
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from activities.deps import open_activity_deps
from agent.build import build_agent_executable, zipapp_executable
from foundation.executables import executable_problem, read_executable
from foundation.files import ReloadedFile, replace_file
from foundation.setting_values import SettingsError
from foundation.tls import CertificateAuthority
from lifecycle.contracts import RESTART_AGENT_UPDATE, MachineStage
from proto import takeover_pb2
from tests.fleet_stack import FleetStack, fleet_stack, stack_settings
from tests.test_recovery import wait_for

INIT_FILE = "init.bin"
# A real binary of this host: its section headers come last, as in most, so a cut anywhere loses some.
ELF = Path("/bin/true").read_bytes()
NOW = datetime.datetime.now(datetime.UTC)


@pytest.fixture(scope="module", name="reference")
def reference_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_agent_executable(tmp_path_factory.mktemp("reference") / "agent")


def recording_agent(version: str, reference: Path) -> bytes:
    """An agent that keeps the TakeoverInit it was sent in init.bin beside itself and hands it to the reference
    agent, the self-contained executable at reference (on this host, as the simulated machine is), which answers
    without heartbeats."""
    return f"""#!/bin/sh
# recording agent, {version}
here=$(dirname "$0")
export SHEPHERD_AGENT_HEARTBEATS=off SHEPHERD_AGENT_STATE_DIR="$here"
tee "$here/{INIT_FILE}" | exec {shlex.quote(str(reference))}
""".encode()


def ca_pem(name: str) -> bytes:
    authority = CertificateAuthority(name, NOW - datetime.timedelta(minutes=5), NOW + datetime.timedelta(days=30))
    return authority.certificate_pem


def der(pem: bytes) -> bytes:
    return x509.load_pem_x509_certificate(pem).public_bytes(Encoding.DER)


def on_the_machine(stack: FleetStack, provider_id: str) -> tuple[bytes, takeover_pb2.TakeoverInit]:
    """The agent executable uploaded to the simulated machine, and the TakeoverInit its last run was sent."""
    root = stack.simulator.machines[provider_id].root_fs / "root"
    init = takeover_pb2.TakeoverInit()
    init.ParseFromString((root / INIT_FILE).read_bytes())
    return (root / "agent").read_bytes(), init


async def take_over_again(stack: FleetStack, bmdb, provider_id: str, reason: str) -> None:
    """A new takeover of the WATCHING machine, without a reboot; returns once BMDB has the new agent's key."""
    [before] = await bmdb.machines_with_provider_id(provider_id)
    await stack.machine(provider_id).execute_update(RESTART_AGENT_UPDATE, {"reason": reason, "by": "test"})

    async def new_key() -> bool:
        [record] = await bmdb.machines_with_provider_id(provider_id)
        return record.agent_public_key not in (None, before.agent_public_key)

    await wait_for(new_key, what=f"the agent taken over again ({reason})", limit=30)
    await stack.wait_for_stage([provider_id], MachineStage.WATCHING)


@asynccontextmanager
async def watching_machine(
    tmp_path: Path, temporal_client, bmdb_url: str, agent: Path, bundle: Path, ca: bytes, reference: Path
) -> AsyncIterator[FleetStack]:
    """A stack whose one machine was taken over with agent 1.0 from agent and the CA ca from bundle."""
    replace_file(agent, recording_agent("1.0", reference), 0o755)
    replace_file(bundle, ca, 0o644)
    async with fleet_stack(
        tmp_path,
        temporal_client,
        bmdb_url,
        machines=1,
        agent_executable_path=agent,
        agent_endpoint_ca_certificate_path=bundle,
    ) as stack:
        await stack.run_pass()
        await stack.wait_for_stage(["node-0001"], MachineStage.WATCHING)
        yield stack


def file_lines(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "shepherd.files" and text in r.getMessage()]


async def test_a_takeover_hands_out_the_agent_executable_and_ca_bundle_as_their_files_are_now(
    tmp_path, temporal_client, bmdb_url, bmdb, caplog, reference
):
    caplog.set_level(logging.INFO, logger="shepherd.files")
    old_ca, new_ca = ca_pem("old CA"), ca_pem("new CA")
    agent, bundle = tmp_path / "agent-exe", tmp_path / "agents-ca.pem"
    async with watching_machine(tmp_path, temporal_client, bmdb_url, agent, bundle, old_ca, reference) as stack:
        uploaded, init = on_the_machine(stack, "node-0001")
        assert uploaded == recording_agent("1.0", reference) and list(init.ca_certificates) == [der(old_ca)]

        # An agent upgrade and the first step of a CA rotation, as an operator does them: files renamed over.
        replace_file(agent, recording_agent("2.0", reference), 0o755)
        replace_file(bundle, old_ca + new_ca, 0o644)
        await take_over_again(stack, bmdb, "node-0001", "agent 2.0 and the new CA")
        uploaded, init = on_the_machine(stack, "node-0001")
        assert uploaded == recording_agent("2.0", reference)
        assert list(init.ca_certificates) == [der(old_ca), der(new_ca)] and init.ca_certificate == der(old_ca)

        [executable_line] = file_lines(caplog, "agent executable reloaded")
        assert f"from {agent}: {len(recording_agent('2.0', reference)):,} bytes" in executable_line
        [bundle_line] = file_lines(caplog, "agents' CA bundle reloaded")
        assert f"from {bundle}: 2 CA certificate(s)" in bundle_line
        assert file_lines(caplog, "not reloaded") == []


async def test_a_bad_replacement_keeps_the_copy_before_and_is_logged_once(
    tmp_path, temporal_client, bmdb_url, bmdb, caplog, reference
):
    caplog.set_level(logging.INFO, logger="shepherd.files")
    old_ca, new_ca = ca_pem("old CA"), ca_pem("new CA")
    agent, bundle = tmp_path / "agent-exe", tmp_path / "agents-ca.pem"
    # The reference agent caught half written: an ELF file that lacks its end.
    reference_bytes = reference.read_bytes()
    async with watching_machine(tmp_path, temporal_client, bmdb_url, agent, bundle, old_ca, reference) as stack:
        replace_file(agent, reference_bytes[: len(reference_bytes) // 2], 0o755)
        replace_file(bundle, b"<html>404 Not Found</html>\n", 0o644)
        for attempt in range(2):
            await take_over_again(stack, bmdb, "node-0001", f"bad files {attempt}")
            uploaded, init = on_the_machine(stack, "node-0001")
            assert uploaded == recording_agent("1.0", reference) and list(init.ca_certificates) == [der(old_ca)]
        # Once a change, naming the file and what is wrong, however many takeovers came after.
        [executable_line] = file_lines(caplog, "agent executable not reloaded")
        assert f"{agent} is an ELF binary cut short (half written?)" in executable_line
        [bundle_line] = file_lines(caplog, "agents' CA bundle not reloaded")
        assert f"{bundle} holds no PEM certificate" in bundle_line

        # Another bad one is logged too; a good one is taken.
        replace_file(agent, b"", 0o755)
        replace_file(bundle, new_ca, 0o644)
        await take_over_again(stack, bmdb, "node-0001", "the new CA")
        uploaded, init = on_the_machine(stack, "node-0001")
        assert uploaded == recording_agent("1.0", reference) and list(init.ca_certificates) == [der(new_ca)]
        assert [line.split("used on: ", 1)[1] for line in file_lines(caplog, "agent executable not reloaded")] == [
            f"{agent} is an ELF binary cut short (half written?)",
            f"{agent} is empty",
        ]


@pytest.mark.parametrize(
    ("setting", "spoil"),
    [
        pytest.param("agent_executable_path", lambda agent, bundle: agent.write_bytes(b""), id="empty-agent"),
        pytest.param(
            "agent_executable_path",
            lambda agent, bundle: agent.write_bytes(agent.read_bytes()[:-100]),
            id="half-written-agent",
        ),
        pytest.param(
            "agent_endpoint_ca_certificate_path", lambda agent, bundle: bundle.write_text("not PEM\n"), id="ca-not-pem"
        ),
    ],
)
async def test_a_bad_file_at_start_names_its_setting(tmp_path, temporal_client, setting, spoil):
    bundle = tmp_path / "agents-ca.pem"
    bundle.write_bytes(ca_pem("CA"))
    settings = stack_settings(
        tmp_path, "http://127.0.0.1:9", temporal_client, agent_endpoint_ca_certificate_path=bundle
    )
    assert settings.agent_executable_path is not None
    spoil(settings.agent_executable_path, bundle)
    # The files are read before BMDB is opened: the URL is never used.
    with pytest.raises(SettingsError) as refused:
        await open_activity_deps(settings, temporal_client, "postgresql://unused@127.0.0.1:9/none")
    assert refused.value.setting == setting


@pytest.mark.parametrize(
    ("executable", "problem"),
    [
        pytest.param(ELF, None, id="elf"),
        pytest.param(ELF[:-1000], "is an ELF binary cut short (half written?)", id="elf-cut"),
        pytest.param(ELF[:40], "is an ELF binary cut short (half written?)", id="elf-head"),
        pytest.param(b"#!/bin/sh\nexec /usr/lib/agent\n", None, id="script"),
        pytest.param(b"#!/bin/sh", "starts with #! but has no end of that line within 256 bytes", id="script-cut"),
        pytest.param(b"", "is empty", id="empty"),
        pytest.param(
            b"<html>502</html>",
            "is neither an ELF binary nor a script starting with #! (it starts with b'<html>502</html>')",
            id="html",
        ),
    ],
)
def test_an_executable_is_whole_or_says_what_is_wrong(executable, problem):
    assert executable_problem(executable) == problem


def test_an_agent_cut_anywhere_is_refused(tmp_path, reference):
    onefile = reference.read_bytes()
    assert executable_problem(onefile) is None
    for cut in (len(onefile) // 3, len(onefile) - 30, len(onefile) - 1):
        assert executable_problem(onefile[:cut]) == "is an ELF binary cut short (half written?)", cut
    # The zipapp of the escape hatch too.
    zipapp = zipapp_executable("/usr/bin/env python3")
    assert executable_problem(zipapp) is None
    for cut in (len(zipapp) // 3, len(zipapp) - 30, len(zipapp) - 1):
        assert "zip archive (a Python zipapp) cut short" in (executable_problem(zipapp[:cut]) or ""), cut


def test_a_file_written_while_it_is_read_is_read_again_at_the_next_look(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="shepherd.files")
    agent = tmp_path / "agent"
    replace_file(agent, b"#!/bin/sh\necho 1\n", 0o755)
    written: list[bytes] = []

    def read_while_written(path: Path) -> bytes:
        data = read_executable(path)
        if written:
            # A writer in place, caught between two writes: what was read is half of what is being written.
            path.write_bytes(written.pop())
        return data

    watched: ReloadedFile[bytes] = ReloadedFile(
        agent, read_while_written, what="agent executable", setting="agent_executable_path", describe=str
    )
    agent.write_bytes(b"#!/bin/sh\necho 2 and some")
    written.append(b"#!/bin/sh\necho 2 and some more\n")
    assert watched.current() == b"#!/bin/sh\necho 1\n"
    assert watched.current() == b"#!/bin/sh\necho 2 and some more\n"
    assert not file_lines(caplog, "not reloaded"), "a file being written is no problem to report"
