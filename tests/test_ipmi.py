"""IPMI power control against pyghmi's fakebmc, a real IPMI 2.0 BMC with fake machines; and the static provider
rebooting an inventory machine whose BMC speaks IPMI."""

from __future__ import annotations

import asyncio
import logging
import socket
import traceback
from pathlib import Path

import asyncssh
import pytest

from foundation.settings import Settings
from providers import ProviderProtocolError, RetireAction
from providers.bmc_secrets import BmcSecretRules
from providers.inventory import load_inventory
from providers.ipmi import IpmiEndpoint, IpmiPowerControl
from providers.power import BmcCredentialsRejected, BmcUnavailable, PowerTimeouts, RebootNotConfirmed
from providers.static import StaticProvider
from shepherd.commands.inventory import check_machine
from tests.ipmi_fixtures import MACHINE, IpmiBmcs, in_order, ipmi_fixture  # noqa: F401
from tests.sshd_fixtures import free_port

# The fake BMC shows a power change 0.2 s after it took it; these leave ample room for that.
FAST = PowerTimeouts(connect=5.0, read=5.0, graceful=10.0, power_back=10.0, poll=0.05)
# For BMCs that never answer or never finish the login: the test waits the whole connect timeout.
SHORT_CONNECT = PowerTimeouts(connect=1.0, read=1.0, graceful=1.0, power_back=1.0, poll=0.05)


def control(ipmi: IpmiBmcs, name: str, *, password: str | None = None, timeouts: PowerTimeouts = FAST):
    return IpmiPowerControl("ipmi", ipmi.endpoint(name, password=password), timeouts)


def udp_port_nobody_listens_on() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_probe_reads_the_power_state_and_changes_nothing(ipmi: IpmiBmcs) -> None:
    report = await control(ipmi, "probe").probe()
    assert (report.system, report.power_state) == (f"127.0.0.1:{ipmi.ports['probe']}", "On")
    events = ipmi.events("probe")
    assert in_order(events, [f"login {ipmi.username}", "status on", "logout"])
    assert not [event for event in events if event.startswith("control")]


async def test_reboot_of_a_running_machine_is_confirmed_off_then_on(ipmi: IpmiBmcs) -> None:
    report = await control(ipmi, "reboot-on").reboot()
    assert report.power_state == "On"
    assert report.detail.startswith("soft off; off after ") and "; on; on after " in report.detail
    # Read back by the BMC's own account: off seen before power on was sent, on seen after it.
    events = ipmi.events("reboot-on")
    assert in_order(events, ["control shutdown", "status off", "control on", "status on", "logout"])
    assert "control off" not in events, "the OS shut down in time: no hard off"


async def test_reboot_of_a_machine_that_is_off_powers_it_on(ipmi: IpmiBmcs) -> None:
    report = await control(ipmi, "reboot-off").reboot()
    assert report.power_state == "On"
    assert report.detail.startswith("on; on after ")
    events = ipmi.events("reboot-off")
    assert in_order(events, ["status off", "control on", "status on", "logout"])
    assert "control shutdown" not in events


async def test_an_ignored_soft_off_is_followed_by_a_hard_off(ipmi: IpmiBmcs) -> None:
    timeouts = PowerTimeouts(connect=5.0, read=5.0, graceful=0.5, power_back=10.0, poll=0.05)
    report = await control(ipmi, "escalate", timeouts=timeouts).reboot()
    assert report.power_state == "On"
    assert report.detail.startswith("soft off; hard off after ")
    events = ipmi.events("escalate")
    assert in_order(events, ["control shutdown", "status on", "control off", "status off", "control on", "status on"])


async def test_a_machine_that_does_not_come_back_on_fails_retryable(ipmi: IpmiBmcs) -> None:
    timeouts = PowerTimeouts(connect=5.0, read=5.0, graceful=5.0, power_back=0.5, poll=0.05)
    with pytest.raises(RebootNotConfirmed) as raised:
        await control(ipmi, "stays-off", timeouts=timeouts).reboot()
    assert raised.value.retryable
    message = str(raised.value)
    assert f"{MACHINE} went off after soft off and did not come back on within 0.5s" in message
    assert f"127.0.0.1:{ipmi.ports['stays-off']}" in message
    assert in_order(ipmi.events("stays-off"), ["control on", "status off", "logout"])


async def test_power_off_for_good_is_confirmed_and_a_second_one_finds_it_off(ipmi: IpmiBmcs) -> None:
    report = await control(ipmi, "retire").power_off()
    assert (report.power_state, report.detail[: len("soft off; off after ")]) == ("Off", "soft off; off after ")
    again = await control(ipmi, "retire").power_off()
    assert (again.power_state, again.detail) == ("Off", "was off already")
    events = ipmi.events("retire")
    assert in_order(events, ["control shutdown", "status off", "logout", "login shepherd", "status off", "logout"])
    assert events.count("control shutdown") == 1 and "control on" not in events


async def test_wrong_password_is_refused_in_one_line_naming_machine_and_bmc(
    ipmi: IpmiBmcs, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = "not-the-password-42"
    with pytest.raises(BmcCredentialsRejected) as raised:
        await control(ipmi, "refused", password=wrong).probe()
    assert not raised.value.retryable
    message = str(raised.value)
    assert message == (
        f"provider ipmi: IPMI BMC 127.0.0.1:{ipmi.ports['refused']} of {MACHINE} refused user "
        f"'{ipmi.username}' (Incorrect password provided); check the BMC credentials of {MACHINE}"
    )
    shown = [message, caplog.text, "".join(traceback.format_exception(raised.value))]
    assert all(wrong not in text and ipmi.password not in text for text in shown)
    assert not [event for event in ipmi.events("refused") if event.startswith("login")]


async def test_a_bmc_that_does_not_answer_is_unavailable_after_the_connect_timeout(ipmi: IpmiBmcs) -> None:
    port = udp_port_nobody_listens_on()
    endpoint = IpmiEndpoint(machine=MACHINE, host="127.0.0.1", port=port, username="shepherd", password="pw")
    with pytest.raises(BmcUnavailable) as raised:
        await IpmiPowerControl("ipmi", endpoint, SHORT_CONNECT).probe()
    assert raised.value.retryable
    assert str(raised.value) == (
        f"provider ipmi: IPMI BMC 127.0.0.1:{port} of {MACHINE} did not answer the login within 1s"
    )


async def test_a_login_the_bmc_drops_halfway_ends_at_the_connect_timeout(ipmi: IpmiBmcs) -> None:
    # pyghmi's fakebmc answers the session request of an unknown user, then drops the login: pyghmi's own
    # waiting login would start over forever.
    endpoint = IpmiEndpoint(
        machine=MACHINE, host="127.0.0.1", port=ipmi.ports["probe"], username="nobody", password=ipmi.password
    )
    with pytest.raises(BmcUnavailable) as raised:
        await IpmiPowerControl("ipmi", endpoint, SHORT_CONNECT).probe()
    assert "did not answer the login within 1s" in str(raised.value)
    # The BMC still serves the right user afterwards.
    assert (await control(ipmi, "probe").probe()).power_state == "On"


async def test_a_host_name_that_does_not_resolve_is_unavailable(ipmi: IpmiBmcs) -> None:
    endpoint = IpmiEndpoint(machine=MACHINE, host="bmc.invalid", username="shepherd", password="pw")
    with pytest.raises(BmcUnavailable) as raised:
        await IpmiPowerControl("ipmi", endpoint, SHORT_CONNECT).probe()
    assert "IPMI BMC bmc.invalid:623 of rack2-node3 is unavailable: " in str(raised.value)


async def test_an_answer_pyghmi_cannot_take_apart_is_a_protocol_error(ipmi: IpmiBmcs) -> None:
    # pyghmi's own server session says yes to the SHA-256 suite its client proposes, then answers with SHA-1.
    with pytest.raises(ProviderProtocolError) as raised:
        await control(ipmi, "any-cipher-suite", timeouts=SHORT_CONNECT).probe()
    assert not raised.value.retryable
    assert str(raised.value).startswith(
        f"provider ipmi: IPMI BMC 127.0.0.1:{ipmi.ports['any-cipher-suite']} of {MACHINE} answered what IPMI does "
        "not promise, and pyghmi could not take it apart: "
    )
    # The login given up on is not retried behind the others' backs, in their threads, as pyghmi's retry timer
    # fires again and again: the logins that follow, to another BMC, go on working.
    for _ in range(4):
        await asyncio.sleep(1)
        assert (await control(ipmi, "probe").probe()).power_state == "On"


async def test_uses_of_one_bmc_take_turns_and_each_logs_out(ipmi: IpmiBmcs) -> None:
    first, second = (IpmiPowerControl("ipmi", ipmi.endpoint("concurrent", machine=name), FAST) for name in ("m1", "m2"))
    reports = await asyncio.gather(first.reboot(), second.reboot())
    assert [report.power_state for report in reports] == ["On", "On"]
    sessions = [event for event in ipmi.events("concurrent") if event.startswith(("login", "logout"))]
    assert sessions == [f"login {ipmi.username}", "logout"] * 2


def in_folder(tmp_path: Path) -> BmcSecretRules:
    """A worker's rules for BMC passwords, its BMC secrets directory the test's folder."""
    return BmcSecretRules.from_settings(Settings(bmc_secrets_dir=tmp_path, state_dir=tmp_path / "state"))


def inventory(tmp_path: Path, ipmi: IpmiBmcs, bmcs: dict[str, str], ssh: str = "10.0.0.21") -> Path:
    secret = tmp_path / "bmc-password"
    secret.write_text(ipmi.password + "\n")
    secret.chmod(0o600)
    text = ""
    for machine, bmc in bmcs.items():
        text += f'[[machines]]\nid = "{machine}"\nssh = "{ssh}"\n'
        text += f'[machines.bmc]\ntype = "ipmi"\nhost = "127.0.0.1"\nport = {ipmi.ports[bmc]}\n'
        text += f'username = "{ipmi.username}"\npassword_file = "{secret.name}"\n'
    path = tmp_path / "inventory.toml"
    path.write_text(text)
    return path


async def test_the_static_provider_reboots_and_retires_a_machine_through_its_ipmi_bmc(
    tmp_path: Path, ipmi: IpmiBmcs
) -> None:
    path = inventory(tmp_path, ipmi, {"rack2-node1": "static", "rack2-node2": "static-retire"})
    provider = StaticProvider("rack2", path, secrets=in_folder(tmp_path), timeouts=FAST)
    rebooted = await provider.reboot_machine("rack2-node1")
    assert rebooted.went_down
    assert rebooted.detail.startswith("soft off; off after ") and rebooted.detail.endswith("; power On")
    assert in_order(ipmi.events("static"), ["control shutdown", "status off", "control on", "status on", "logout"])

    retired = await provider.retire_machine("rack2-node2")
    assert retired.action is RetireAction.POWERED_OFF
    assert retired.detail.startswith(f"through its BMC (127.0.0.1:{ipmi.ports['static-retire']}): soft off")
    assert in_order(ipmi.events("static-retire"), ["control shutdown", "status off", "logout"])
    assert "control on" not in ipmi.events("static-retire")


async def test_inventory_check_logs_in_to_an_ipmi_bmc(tmp_path: Path, ipmi: IpmiBmcs) -> None:
    # SSH to a closed port fails at once; the BMC's part of the check is what is looked at.
    listed = inventory(tmp_path, ipmi, {"rack2-node4": "probe"}, ssh=f"127.0.0.1:{free_port()}")
    [machine] = load_inventory(listed, secrets=in_folder(tmp_path))
    key = asyncssh.generate_private_key("ssh-ed25519")
    check = await check_machine(machine, key, Settings(ssh_connect_timeout=2.0, provider_timeout=5.0), "static")
    assert not check.ssh_ok
    assert (check.bmc_ok, check.bmc) == (True, f"bmc ok, 127.0.0.1:{ipmi.ports['probe']} On")
