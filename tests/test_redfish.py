"""Redfish power control against sushy-emulator, a real BMC with fake machines."""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
import socket
import time
import traceback
from collections.abc import Iterator

import pytest
from sushy import auth as sushy_auth
from sushy.resources.constants import ResetType
from sushy.resources.system.system import System

from providers import ProviderError
from providers.power import BmcCredentialsRejected, BmcUnavailable, PowerTimeouts, RebootNotConfirmed
from providers.redfish import BmcSystemUnknown, RedfishEndpoint, RedfishPowerControl
from tests.bmc_fixtures import Bmc, bmc_fixture, power_state, single_bmc_fixture  # noqa: F401
from tests.sshd_fixtures import free_port

MACHINE = "rack1-node7"
# The emulator brings a machine back 1 to 11 s after a reset; power_back leaves room for that.
FAST = PowerTimeouts(connect=1.0, read=5.0, graceful=15.0, power_back=30.0, poll=0.1)


def control(
    bmc: Bmc,
    system: str | None,
    *,
    password: str | None = None,
    url: str | None = None,
    timeouts: PowerTimeouts = FAST,
) -> RedfishPowerControl:
    endpoint = RedfishEndpoint(
        machine=MACHINE,
        url=url or bmc.url,
        username=bmc.username,
        password=bmc.password if password is None else password,
        system=system,
    )
    return RedfishPowerControl("redfish", endpoint, timeouts)


@pytest.fixture
def silent_bmc() -> Iterator[str]:
    """A BMC that takes connections and never answers: a listening socket nobody accepts on."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


async def test_probe_reports_system_and_power_state(bmc: Bmc) -> None:
    report = await control(bmc, bmc.systems["probe"]).probe()
    assert report.system == bmc.systems["probe"]
    assert report.power_state == "On"


async def test_probe_finds_the_only_system(single_bmc: Bmc) -> None:
    report = await control(single_bmc, None).probe()
    assert report.system == single_bmc.systems["only"]
    assert report.power_state in ("On", "Off")


async def test_reboot_of_a_running_machine_sees_it_off_then_on(bmc: Bmc) -> None:
    report = await control(bmc, bmc.systems["reboot-on"]).reboot()
    assert report.system == bmc.systems["reboot-on"]
    assert report.power_state == "On"
    # An explicit power cycle, each step read back: off (gracefully, or forced), then on.
    assert report.detail.startswith("GracefulShutdown")
    assert "off after" in report.detail and "On; on after" in report.detail
    assert power_state(bmc, "reboot-on") == "On"


async def test_reboot_of_a_machine_that_is_off_powers_it_on(bmc: Bmc) -> None:
    assert power_state(bmc, "reboot-off") == "Off"
    report = await control(bmc, bmc.systems["reboot-off"]).reboot()
    assert report.power_state == "On"
    assert report.detail.startswith("On; on after")
    assert power_state(bmc, "reboot-off") == "On"


async def test_ignored_graceful_shutdown_is_forced_off(bmc: Bmc, monkeypatch: pytest.MonkeyPatch) -> None:
    # An OS that ignores the ACPI request: the BMC never gets to see the GracefulShutdown.
    reset_system = System.reset_system

    def ignoring_graceful(self: System, value: ResetType) -> None:
        if value is not ResetType.GRACEFUL_SHUTDOWN:
            reset_system(self, value)

    monkeypatch.setattr(System, "reset_system", ignoring_graceful)
    timeouts = PowerTimeouts(connect=1.0, read=5.0, graceful=0.5, power_back=30.0, poll=0.1)
    report = await control(bmc, bmc.systems["escalate"], timeouts=timeouts).reboot()
    assert report.detail.startswith("GracefulShutdown; ForceOff after")
    assert power_state(bmc, "escalate") == "On"


async def test_power_off_for_good_is_confirmed_and_a_second_one_finds_it_off(bmc: Bmc) -> None:
    report = await control(bmc, bmc.systems["retire"]).power_off()
    assert report.power_state == "Off"
    assert report.detail.startswith("GracefulShutdown") and "off after" in report.detail
    await asyncio.sleep(2)
    assert power_state(bmc, "retire") == "Off", "nothing powers it back on"
    again = await control(bmc, bmc.systems["retire"]).power_off()
    assert (again.power_state, again.detail) == ("Off", "was off already")


async def test_a_bmc_without_off_and_on_is_restarted_and_confirmed(bmc: Bmc, monkeypatch: pytest.MonkeyPatch) -> None:
    # Some BMCs allow only the restart types; then GracefulRestart, forced when ignored, and Off then On is read back.
    monkeypatch.setattr(
        System,
        "get_allowed_reset_system_values",
        lambda self: {ResetType.GRACEFUL_RESTART, ResetType.FORCE_RESTART},
    )
    report = await control(bmc, bmc.systems["restart-only"]).reboot()
    assert report.detail.startswith("GracefulRestart")
    assert "off after" in report.detail and "on after" in report.detail
    assert power_state(bmc, "restart-only") == "On"


async def test_wrong_password_is_not_retryable_and_names_the_credentials(bmc: Bmc) -> None:
    with pytest.raises(BmcCredentialsRejected) as raised:
        await control(bmc, bmc.systems["probe"], password="not-the-password").probe()
    assert not raised.value.retryable
    assert f"check the BMC credentials of {MACHINE}" in str(raised.value)


async def test_bmc_down_is_retryable_and_fails_fast(bmc: Bmc) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(BmcUnavailable) as raised:
        await control(bmc, None, url=url).probe()
    assert time.monotonic() - started < 10
    assert raised.value.retryable
    assert MACHINE in str(raised.value) and url in str(raised.value)


async def test_bmc_that_never_answers_times_out_retryable(bmc: Bmc, silent_bmc: str) -> None:
    timeouts = PowerTimeouts(connect=1.0, read=0.5, graceful=1.0, power_back=1.0, poll=0.1)
    started = time.monotonic()
    with pytest.raises(BmcUnavailable) as raised:
        await control(bmc, None, url=silent_bmc, timeouts=timeouts).probe()
    assert time.monotonic() - started < 10
    assert raised.value.retryable
    assert silent_bmc in str(raised.value)


async def test_unknown_system_is_not_retryable_and_lists_the_real_ones(bmc: Bmc) -> None:
    with pytest.raises(BmcSystemUnknown) as raised:
        await control(bmc, "/redfish/v1/Systems/no-such-system").reboot()
    assert not raised.value.retryable
    assert "/redfish/v1/Systems/no-such-system" in str(raised.value)
    assert bmc.systems["probe"] in str(raised.value)


async def test_several_systems_and_none_configured_lists_them(bmc: Bmc) -> None:
    with pytest.raises(BmcSystemUnknown) as raised:
        await control(bmc, None).probe()
    assert not raised.value.retryable
    assert all(path in str(raised.value) for path in bmc.systems.values())


async def test_machine_that_stays_off_fails_retryable(bmc: Bmc) -> None:
    timeouts = PowerTimeouts(connect=1.0, read=5.0, graceful=15.0, power_back=0.3, poll=0.1)
    # The emulator's delay is random and, rarely, shorter than power_back: then the reboot succeeds; try again.
    for _ in range(3):
        try:
            await control(bmc, bmc.systems["stays-off"], timeouts=timeouts).reboot()
        except RebootNotConfirmed as error:
            assert error.retryable
            assert "did not come back on within 0.3s" in str(error)
            assert MACHINE in str(error)
            return
    pytest.fail("the machine came back within 0.3 s three times in a row")


class CountingAuth(sushy_auth.SessionOrBasicAuth):
    """SessionOrBasicAuth that counts how many exist and are not closed yet, and the most at once."""

    open: set[int] = set()
    opened = 0
    peak = 0

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        CountingAuth.open.add(id(self))
        CountingAuth.opened += 1
        CountingAuth.peak = max(CountingAuth.peak, len(CountingAuth.open))

    def close(self) -> None:
        super().close()
        CountingAuth.open.discard(id(self))


async def test_concurrent_reboots_of_one_bmc_take_turns(bmc: Bmc, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sushy_auth, "SessionOrBasicAuth", CountingAuth)
    first, second = (control(bmc, bmc.systems[name]) for name in ("concurrent-1", "concurrent-2"))
    reports = await asyncio.gather(first.reboot(), second.reboot())
    assert [r.power_state for r in reports] == ["On", "On"]
    assert CountingAuth.opened == 2
    assert CountingAuth.peak == 1
    assert not CountingAuth.open


async def test_password_shows_in_no_message_log_or_repr(bmc: Bmc, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    secret = f"unique-{secrets.token_hex(16)}"
    token = base64.b64encode(f"{bmc.username}:{secret}".encode()).decode()
    errors: list[ProviderError] = []
    for system, url, password in [
        (bmc.systems["probe"], bmc.url, secret),  # refused
        ("/redfish/v1/Systems/no-such-system", bmc.url, bmc.password),
        (None, f"http://127.0.0.1:{free_port()}", secret),
    ]:
        with pytest.raises(ProviderError) as raised:
            await control(bmc, system, password=password, url=url).probe()
        errors.append(raised.value)
    await control(bmc, bmc.systems["probe"]).probe()
    endpoint = RedfishEndpoint(machine=MACHINE, url=bmc.url, username=bmc.username, password=secret)
    texts = [caplog.text, repr(endpoint), str(endpoint)]
    texts += ["".join(traceback.format_exception(error)) for error in errors]
    for text in texts:
        assert secret not in text and token not in text and bmc.password not in text
