"""The static provider: its inventory's checks (Redfish and IPMI BMCs), re-reading it, BMC passwords, and reboots
through a fake BMC."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from foundation.settings import Settings
from providers import Availability, MachineNotFound, ProviderMachine, RetireAction
from providers.bmc_secrets import BmcSecretRules
from providers.inventory import InventoryError, load_inventory
from providers.inventory_bmc import IpmiBMC, RedfishBMC
from providers.ipmi import IpmiEndpoint, IpmiPowerControl
from providers.power import PowerReport
from providers.redfish import RedfishEndpoint, RedfishPowerControl
from providers.static import NoBMC, StaticProvider, power_control

SECRET = "pa55-word-in-file"

GOOD = """
# the operator's inventory
[[machines]]
id = "rack1-node01"
ssh = "10.0.0.11:22"
ssh_user = "admin"
location = "rack1"
[machines.bmc]
type = "redfish"
url = "https://10.0.1.11/"
system = "/redfish/v1/Systems/1"
username = "admin"
password_file = "bmc/rack1-node01"
ca_file = "bmc-ca.pem"

[[ machines]]
id = "rack1-node02"
ssh = "[fe80::2]:2222"

[[ "machines" ]]
id = "node.03_b"
ssh = "node03.example.net"

[[machines]]
id = "v6-default-port"
ssh = "[::1]"
"""

# The bad machine's header is on line 5, after one good machine; the header has spaces inside its brackets.
FIRST = '[[machines]]\nid = "good"\nssh = "10.0.0.1"\n\n'
AT = " line 5 machine 'rack1-node02'"
BMC = '[machines.bmc]\ntype = "redfish"\nurl = "https://bmc"\nusername = "admin"\n'
IPMI = '[machines.bmc]\ntype = "ipmi"\nhost = "10.0.1.12"\nusername = "admin"\npassword_env = "BMC_PASSWORD_P"\n'


def machine(body: str, bmc: str = "") -> str:
    return FIRST + '[[ machines ]]\nid = "rack1-node02"\n' + body + "\n" + bmc


# Each case: what names the place after the file's path, the text, and what the problem's words must include.
BAD = {
    "bad toml": ("", FIRST + '[[machines]]\nid = "x"\nssh = \n', ["is not valid TOML", "line 7, column"]),
    "machines not a list": ("", 'machines = "rack1"\n', ["'machines' must be a list of [[machines]] tables"]),
    "machines a table": ("", '[machines]\nid = "a"\n', ["'machines' must be a list"]),
    "unknown top-level key": ("", '[[machine]]\nid = "a"\n', ["unknown top-level key(s) 'machine'"]),
    "unknown machine key": (AT, machine('ssh = "h"\nsshh = "h2"'), ["unknown key(s) 'sshh'"]),
    "unknown bmc key": (
        AT,
        machine('ssh = "h"', BMC + 'password_env = "BMC_PASSWORD_P"\nsystme = "/x"\n'),
        ["unknown key(s) 'bmc.systme'", "known: bmc.type, bmc.url, bmc.system"],
    ),
    "unknown ipmi bmc key": (
        AT,
        machine('ssh = "h"', IPMI + "kg = 1\n"),
        ["unknown key(s) 'bmc.kg'", "known: bmc.type, bmc.host, bmc.port, bmc.username"],
    ),
    "inline password": (
        AT,
        machine('ssh = "h"', BMC + f'password = "{SECRET}"\n'),
        ["never inline: use password_file or password_env"],
    ),
    "missing id": (" line 5", FIRST + '[[ machines ]]\nssh = "h"\n', ["missing id"]),
    "bad id": (" line 5", FIRST + '[[ machines ]]\nid = "rack 1"\nssh = "h"\n', ["id must match", "'rack 1'"]),
    "id too long": (" line 5", FIRST + f'[[ machines ]]\nid = "{"n" * 64}"\nssh = "h"\n', ["id must match"]),
    "id not a string": (" line 5", FIRST + '[[ machines ]]\nid = 7\nssh = "h"\n', ["id must match", "got 7"]),
    "duplicate id": (
        " line 5 machine 'good'",
        FIRST + '[[ machines ]]\nid = "good"\nssh = "h"\n',
        ["duplicate id", "line 1"],
    ),
    "missing ssh": (AT, machine(""), ["missing ssh"]),
    "ssh not a string": (AT, machine("ssh = 22"), ["ssh must be a string"]),
    "ssh port zero": (AT, machine('ssh = "h:0"'), ["port must be 1-65535", "'0'"]),
    "ssh port too big": (AT, machine('ssh = "h:65536"'), ["port must be 1-65535"]),
    "ssh port not a number": (AT, machine('ssh = "h:ssh"'), ["port must be 1-65535"]),
    "ssh empty port": (AT, machine('ssh = "h:"'), ["port must be 1-65535"]),
    "ssh bad host": (AT, machine('ssh = "bad host:22"'), ["ssh must be host[:port]"]),
    "ssh bare ipv6": (AT, machine('ssh = "fe80::1"'), ["IPv6 address goes in brackets"]),
    "ssh bad ipv6": (AT, machine('ssh = "[fe80::zz]:22"'), ["is not an IPv6 address"]),
    "ssh unclosed bracket": (AT, machine('ssh = "[::1:22"'), ["ssh must be host[:port] or [IPv6]:port"]),
    "bad ssh_user": (AT, machine('ssh = "h"\nssh_user = "r oot"'), ["ssh_user must be a user name"]),
    "bmc not a table": (AT, machine('ssh = "h"\nbmc = "redfish"'), ["bmc must be a [machines.bmc] table"]),
    "bmc type": (
        AT,
        machine('ssh = "h"', BMC.replace("redfish", "idrac") + 'password_env = "BMC_PASSWORD_P"\n'),
        ["bmc.type must be 'redfish' or 'ipmi'", "'idrac'"],
    ),
    "bmc type not a string": (
        AT,
        machine('ssh = "h"', BMC.replace('"redfish"', "[1]") + 'password_env = "BMC_PASSWORD_P"\n'),
        ["bmc.type must be 'redfish' or 'ipmi'", "[1]"],
    ),
    "ipmi bmc with url": (
        AT,
        machine('ssh = "h"', IPMI + 'url = "https://bmc"\n'),
        ["'bmc.url' is for a bmc of type = 'redfish'; type = 'ipmi' takes host, port"],
    ),
    "ipmi bmc with redfish keys": (
        AT,
        machine('ssh = "h"', IPMI + 'system = "/redfish/v1/Systems/1"\nca_file = "ca.pem"\nverify_tls = false\n'),
        ["'bmc.ca_file', 'bmc.system', 'bmc.verify_tls' is for a bmc of type = 'redfish'"],
    ),
    "redfish bmc with host": (
        AT,
        machine('ssh = "h"', BMC + 'password_env = "BMC_PASSWORD_P"\nhost = "10.0.1.11"\n'),
        ["'bmc.host' is for a bmc of type = 'ipmi'; type = 'redfish' takes url, system, ca_file, verify_tls"],
    ),
    "ipmi inline password": (
        AT,
        machine('ssh = "h"', IPMI.replace('password_env = "BMC_PASSWORD_P"', f'password = "{SECRET}"')),
        ["bmc.password: never inline: use password_file or password_env"],
    ),
    "ipmi missing host": (
        AT,
        machine('ssh = "h"', IPMI.replace('host = "10.0.1.12"\n', "")),
        ["missing bmc.host"],
    ),
    "ipmi host with port": (
        AT,
        machine('ssh = "h"', IPMI.replace('"10.0.1.12"', '"10.0.1.12:623"')),
        ["bmc.host must be a host name or an IP address, got '10.0.1.12:623'; the port goes in bmc.port"],
    ),
    "ipmi host not a host": (
        AT,
        machine('ssh = "h"', IPMI.replace('"10.0.1.12"', '"bmc one"')),
        ["bmc.host must be a host name or an IP address, got 'bmc one'"],
    ),
    "ipmi host a url": (
        AT,
        machine('ssh = "h"', IPMI.replace('"10.0.1.12"', '"https://bmc"')),
        ["bmc.host must be a host name or an IP address"],
    ),
    "ipmi port zero": (AT, machine('ssh = "h"', IPMI + "port = 0\n"), ["bmc.port must be 1-65535, got 0"]),
    "ipmi port too big": (AT, machine('ssh = "h"', IPMI + "port = 65536\n"), ["bmc.port must be 1-65535"]),
    "ipmi port a string": (AT, machine('ssh = "h"', IPMI + 'port = "623"\n'), ["bmc.port must be 1-65535, got '623'"]),
    "ipmi port a bool": (AT, machine('ssh = "h"', IPMI + "port = true\n"), ["bmc.port must be 1-65535, got True"]),
    "ipmi username too long": (
        AT,
        machine('ssh = "h"', IPMI.replace('"admin"', '"a-seventeen-chars"')),
        ["bmc.username of an IPMI BMC is at most 16 bytes"],
    ),
    "ipmi no password": (
        AT,
        machine('ssh = "h"', IPMI.replace('password_env = "BMC_PASSWORD_P"\n', "")),
        ["exactly one of password_file and password_env"],
    ),
    "bmc url scheme": (
        AT,
        machine('ssh = "h"', BMC.replace("https://bmc", "ftp://bmc") + 'password_env = "BMC_PASSWORD_P"\n'),
        ["bmc.url must be an http:// or https:// URL"],
    ),
    "bmc url no scheme": (
        AT,
        machine('ssh = "h"', BMC.replace("https://bmc", "10.0.1.11") + 'password_env = "BMC_PASSWORD_P"\n'),
        ["bmc.url must be an http:// or https:// URL"],
    ),
    "bmc url credentials": (
        AT,
        machine(
            'ssh = "h"', BMC.replace("https://bmc", f"ftp://admin:{SECRET}@bmc") + 'password_env = "BMC_PASSWORD_P"\n'
        ),
        ["must not carry credentials"],
    ),
    "bmc url bad port": (
        AT,
        machine('ssh = "h"', BMC.replace("https://bmc", "https://bmc:99999") + 'password_env = "BMC_PASSWORD_P"\n'),
        ["bmc.url must be an http:// or https:// URL"],
    ),
    "bmc missing username": (
        AT,
        machine('ssh = "h"', BMC.replace('username = "admin"\n', "") + 'password_env = "BMC_PASSWORD_P"\n'),
        ["missing bmc.username"],
    ),
    "bmc no password": (AT, machine('ssh = "h"', BMC), ["exactly one of password_file and password_env"]),
    "bmc both passwords": (
        AT,
        machine('ssh = "h"', BMC + 'password_env = "BMC_PASSWORD_P"\npassword_file = "/p"\n'),
        ["exactly one of password_file and password_env"],
    ),
    "bmc bad env name": (AT, machine('ssh = "h"', BMC + 'password_env = "NOT-A-NAME"\n'), ["bmc.password_env must be"]),
    "bmc system not a path": (
        AT,
        machine('ssh = "h"', BMC + 'password_env = "BMC_PASSWORD_P"\nsystem = "1"\n'),
        ["bmc.system must be a path"],
    ),
    "verify_tls false with ca_file": (
        AT,
        machine('ssh = "h"', BMC + 'password_env = "BMC_PASSWORD_P"\nverify_tls = false\nca_file = "/ca.pem"\n'),
        ["verify_tls = false and ca_file contradict"],
    ),
    "verify_tls not a bool": (
        AT,
        machine('ssh = "h"', BMC + 'password_env = "BMC_PASSWORD_P"\nverify_tls = "no"\n'),
        ["bmc.verify_tls must be true or false"],
    ),
    "bmc password variable of Shepherd's own": (
        AT,
        machine('ssh = "h"', BMC + 'password_env = "SHEPHERD_DATABASE_URL"\n'),
        ["bmc.password_env SHEPHERD_DATABASE_URL does not start with BMC_PASSWORD_ (setting bmc_password_env_prefix)"],
    ),
    "ipmi password variable of Temporal's": (
        AT,
        machine('ssh = "h"', IPMI.replace('"BMC_PASSWORD_P"', '"TEMPORAL_API_KEY"')),
        ["bmc.password_env TEMPORAL_API_KEY does not start with BMC_PASSWORD_"],
    ),
    "bmc http url": (
        AT,
        machine('ssh = "h"', BMC.replace("https://bmc", "http://bmc:8000") + 'password_env = "BMC_PASSWORD_P"\n'),
        ["bmc.url http://bmc:8000 is http://", "clear text", "write insecure_http = true in this [machines.bmc]"],
    ),
    "insecure_http with an https url": (
        AT,
        machine('ssh = "h"', BMC + 'password_env = "BMC_PASSWORD_P"\ninsecure_http = true\n'),
        ["bmc.insecure_http = true goes with an http:// url"],
    ),
    "insecure_http not a bool": (
        AT,
        machine('ssh = "h"', BMC.replace("https", "http") + 'password_env = "BMC_PASSWORD_P"\ninsecure_http = "yes"\n'),
        ["bmc.insecure_http must be true or false"],
    ),
}


def rules(folder: Path) -> BmcSecretRules:
    """A worker's rules for BMC passwords with the test's folder as its BMC secrets directory."""
    return BmcSecretRules.from_settings(Settings(bmc_secrets_dir=folder, state_dir=folder / "state"))


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def good_inventory(tmp_path: Path) -> Path:
    """GOOD, with the password file its first machine names, owner-only as every pass checks."""
    (tmp_path / "bmc").mkdir(exist_ok=True)
    write(tmp_path / "bmc" / "rack1-node01", SECRET).chmod(0o600)
    return write(tmp_path / "inventory.toml", GOOD)


def one_line(error: BaseException) -> str:
    message = str(error)
    assert "\n" not in message
    assert SECRET not in message
    return message


@pytest.mark.parametrize("where, text, expected", list(BAD.values()), ids=list(BAD))
def test_bad_inventory_is_refused_in_one_line_naming_file_line_and_machine(
    tmp_path: Path, where: str, text: str, expected: list[str]
) -> None:
    path = write(tmp_path / "inventory.toml", text)
    with pytest.raises(InventoryError) as caught:
        load_inventory(path, "rack", secrets=rules(tmp_path))
    message = one_line(caught.value)
    assert caught.value.retryable is False
    assert message.startswith(f"provider rack: inventory {path}{where}: ")
    for part in expected:
        assert part in message


def test_unreadable_inventory(tmp_path: Path) -> None:
    path = tmp_path / "missing.toml"
    with pytest.raises(InventoryError) as caught:
        load_inventory(path, secrets=rules(tmp_path))
    assert one_line(caught.value) == f"provider static: inventory {path}: cannot be read: No such file or directory"


def test_good_inventory(tmp_path: Path) -> None:
    machines = load_inventory(good_inventory(tmp_path), secrets=rules(tmp_path))
    assert [(m.id, m.host, m.port, m.ssh_user, m.line) for m in machines] == [
        ("rack1-node01", "10.0.0.11", 22, "admin", 3),
        # Without ssh_user: None, so the ssh_user setting (default root) applies.
        ("rack1-node02", "fe80::2", 2222, None, 16),
        ("node.03_b", "node03.example.net", 22, None, 20),
        ("v6-default-port", "::1", 22, None, 24),
    ]
    bmc = machines[0].bmc
    assert isinstance(bmc, RedfishBMC) and all(m.bmc is None for m in machines[1:])
    # Relative paths are the inventory's folder's; the trailing slash of the URL goes.
    assert (bmc.url, bmc.system, bmc.username) == ("https://10.0.1.11", "/redfish/v1/Systems/1", "admin")
    assert (bmc.password_file, bmc.ca_file, bmc.verify_tls) == (
        tmp_path / "bmc/rack1-node01",
        tmp_path / "bmc-ca.pem",
        True,
    )
    assert load_inventory(write(tmp_path / "empty.toml", ""), secrets=rules(tmp_path)) == []


IPMI_MACHINES = """
[[machines]]
id = "ipmi-by-name"
ssh = "10.0.0.31"
[machines.bmc]
type = "ipmi"
host = "bmc-31.rack3.example.net"
username = "ADMIN"
password_env = "BMC_PASSWORD_TEST_IPMI"

[[machines]]
id = "ipmi-v4-port"
ssh = "10.0.0.32"
[machines.bmc]
type = "ipmi"
host = "10.0.1.32"
port = 6230
username = "ADMIN"
password_file = "bmc/ipmi"

[[machines]]
id = "ipmi-v6"
ssh = "[fd00::33]"
[machines.bmc]
type = "ipmi"
host = "fd00:1::33"
username = "ADMIN"
password_env = "BMC_PASSWORD_TEST_IPMI"
"""


def test_ipmi_bmcs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bmc").mkdir()
    write(tmp_path / "bmc" / "ipmi", SECRET + "\n").chmod(0o600)
    by_name, v4, v6 = load_inventory(write(tmp_path / "inventory.toml", IPMI_MACHINES), secrets=rules(tmp_path))
    assert isinstance(by_name.bmc, IpmiBMC) and isinstance(v4.bmc, IpmiBMC) and isinstance(v6.bmc, IpmiBMC)
    assert (by_name.bmc.type, by_name.bmc.host, by_name.bmc.port) == ("ipmi", "bmc-31.rack3.example.net", 623)
    assert (v4.bmc.host, v4.bmc.port, v4.bmc.password_file) == ("10.0.1.32", 6230, tmp_path / "bmc" / "ipmi")
    assert (v6.bmc.host, v6.bmc.port) == ("fd00:1::33", 623)

    monkeypatch.setenv("BMC_PASSWORD_TEST_IPMI", SECRET)
    endpoint = v6.bmc.endpoint(v6.id, "rack")
    assert endpoint == IpmiEndpoint(machine="ipmi-v6", host="fd00:1::33", username="ADMIN", password=SECRET, port=623)
    assert endpoint.address == "[fd00:1::33]:623" and SECRET not in repr(endpoint)
    assert v4.bmc.endpoint(v4.id).password == SECRET
    # Its password file is checked on every pass, as a Redfish BMC's.
    (tmp_path / "bmc" / "ipmi").chmod(0o640)
    with pytest.raises(InventoryError, match=r"line 11 machine 'ipmi-v4-port': BMC password file .* is readable"):
        load_inventory(tmp_path / "inventory.toml", secrets=rules(tmp_path))


async def test_machines_as_the_provider_shows_them(tmp_path: Path) -> None:
    provider = StaticProvider("rack", secrets=rules(tmp_path), inventory=good_inventory(tmp_path))
    assert provider.name == "rack"
    listed = await provider.list_machines()
    assert [m.provider_id for m in listed] == ["rack1-node01", "rack1-node02", "node.03_b", "v6-default-port"]
    assert {m.availability for m in listed} == {Availability.POSSIBLY_USED}
    assert listed[1] == ProviderMachine(
        "rack1-node02", Availability.POSSIBLY_USED, "fe80::2", 2222, status="listed", ssh_user=None
    )
    assert await provider.get_machine("rack1-node01") == listed[0]
    assert listed[0].location == "rack1"
    assert await provider.create_machine("node.03_b", "key-1", "ssh-ed25519 AAAA shepherd") == listed[2]
    with pytest.raises(MachineNotFound):
        await provider.create_machine("rack9-node01", "key-2", "ssh-ed25519 AAAA shepherd")
    assert provider.is_valid_id("rack1-node01") and provider.is_valid_id("a.b_c-1")
    assert not provider.is_valid_id("") and not provider.is_valid_id("a b") and not provider.is_valid_id("n" * 64)
    await provider.close()


async def test_the_inventory_is_read_again_whenever_it_changes(tmp_path: Path) -> None:
    path = good_inventory(tmp_path)
    provider = StaticProvider("rack", secrets=rules(tmp_path), inventory=path, power=FakePowerControl.factory([]))
    assert len(await provider.list_machines()) == 4

    write(path, GOOD.split("[[ machines]]")[0] + '[[machines]]\nid = "rack2-node01"\nssh = "10.0.2.1"\n')
    assert [m.provider_id for m in await provider.list_machines()] == ["rack1-node01", "rack2-node01"]
    assert (await provider.get_machine("rack2-node01")).address == "10.0.2.1"
    with pytest.raises(MachineNotFound) as caught:
        await provider.get_machine("rack1-node02")
    assert caught.value.retryable is False
    with pytest.raises(MachineNotFound):
        await provider.reboot_machine("rack1-node02")

    write(path, "[[machines]]\nid = 1\n")
    with pytest.raises(InventoryError, match="line 1: id must match"):
        await provider.list_machines()


async def test_an_unchanged_inventory_is_parsed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A fleet's inventory runs to 100,000 machines; every takeover asks the provider for its machine.
    path = good_inventory(tmp_path)
    parses = []

    def counted(*args, **kwargs):
        parses.append(args)
        return load_inventory(*args, **kwargs)

    monkeypatch.setattr("providers.static.load_inventory", counted)
    provider = StaticProvider("rack", secrets=rules(tmp_path), inventory=path, power=FakePowerControl.factory([]))
    assert len(await provider.list_machines()) == 4
    assert (await provider.get_machine("rack1-node02")).ssh_port == 2222
    await provider.create_machine("node.03_b", "key", "ssh-ed25519 AAAA")
    assert len(parses) == 1
    write(path, GOOD + "\n# a comment the operator added\n")
    assert len(await provider.list_machines()) == 4
    assert len(parses) == 2


class FakePowerControl:
    """A BMC's power control that records what it was asked."""

    def __init__(self, calls: list, provider: str, endpoint) -> None:
        self.calls, self.provider, self.endpoint = calls, provider, endpoint

    @classmethod
    def factory(cls, calls: list):
        return lambda provider, endpoint: cls(calls, provider, endpoint)

    async def reboot(self):
        self.calls.append(("reboot", self.provider, self.endpoint))
        return PowerReport("/redfish/v1/Systems/1", "On", "fake: power cycled")

    async def probe(self):
        self.calls.append(("probe", self.provider, self.endpoint))
        return PowerReport("/redfish/v1/Systems/1", "On")

    async def power_off(self):
        self.calls.append(("power_off", self.provider, self.endpoint))
        return PowerReport("/redfish/v1/Systems/1", "Off", "fake: GracefulShutdown; off after 3s")


def bmc_inventory(tmp_path: Path, password: str) -> Path:
    text = f"""
[[machines]]
id = "rack1-node01"
ssh = "10.0.0.11"
[machines.bmc]
type = "redfish"
url = "http://10.0.1.11:8000"
insecure_http = true
username = "admin"
{password}
"""
    return write(tmp_path / "inventory.toml", text)


async def test_reboot_goes_through_the_bmc_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    secret = write(tmp_path / "password", SECRET + "\n")
    secret.chmod(0o600)
    calls: list = []
    provider = StaticProvider(
        "rack",
        secrets=rules(tmp_path),
        inventory=bmc_inventory(tmp_path, 'password_file = "password"'),
        power=FakePowerControl.factory(calls),
    )
    rebooted = await provider.reboot_machine("rack1-node01")
    assert rebooted.went_down, "the BMC's power state was read back off, then on"

    [(call, name, endpoint)] = calls
    assert (call, name) == ("reboot", "rack")
    assert (endpoint.machine, endpoint.url, endpoint.username) == ("rack1-node01", "http://10.0.1.11:8000", "admin")
    assert (endpoint.password, endpoint.system, endpoint.verify) == (SECRET, None, True)
    assert SECRET not in repr(endpoint)
    assert any("rack1-node01" in r.getMessage() and "fake: power cycled" in r.getMessage() for r in caplog.records)
    assert all(SECRET not in r.getMessage() for r in caplog.records)


async def test_reboot_through_an_ipmi_bmc_gets_its_endpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BMC_PASSWORD_TEST_IPMI", SECRET)
    (tmp_path / "bmc").mkdir()
    write(tmp_path / "bmc" / "ipmi", SECRET).chmod(0o600)
    calls: list = []
    provider = StaticProvider(
        "rack",
        secrets=rules(tmp_path),
        inventory=write(tmp_path / "inventory.toml", IPMI_MACHINES),
        power=FakePowerControl.factory(calls),
    )
    rebooted = await provider.reboot_machine("ipmi-by-name")
    assert rebooted.went_down
    [(call, name, endpoint)] = calls
    assert (call, name, endpoint) == (
        "reboot",
        "rack",
        IpmiEndpoint(machine="ipmi-by-name", host="bmc-31.rack3.example.net", username="ADMIN", password=SECRET),
    )


def test_the_power_control_is_chosen_by_the_bmc_type() -> None:
    ipmi = IpmiEndpoint(machine="m", host="10.0.1.12", username="ADMIN", password=SECRET)
    redfish = RedfishEndpoint(machine="m", url="https://10.0.1.11", username="admin", password=SECRET)
    assert isinstance(power_control("rack", ipmi), IpmiPowerControl)
    assert isinstance(power_control("rack", redfish), RedfishPowerControl)


async def test_reboot_without_bmc_is_for_a_person(tmp_path: Path) -> None:
    calls: list = []
    provider = StaticProvider(
        "rack", secrets=rules(tmp_path), inventory=good_inventory(tmp_path), power=FakePowerControl.factory(calls)
    )
    with pytest.raises(NoBMC) as caught:
        await provider.reboot_machine("rack1-node02")
    assert caught.value.retryable is False
    assert "'rack1-node02' has no BMC in the inventory" in one_line(caught.value)
    assert "by hand" in str(caught.value)
    assert calls == []


async def test_retiring_powers_off_through_the_bmc_and_says_what_is_left_to_do_without_one(tmp_path: Path) -> None:
    secret = write(tmp_path / "password", SECRET + "\n")
    secret.chmod(0o600)
    calls: list = []
    provider = StaticProvider(
        "rack",
        secrets=rules(tmp_path),
        inventory=bmc_inventory(tmp_path, 'password_file = "password"'),
        power=FakePowerControl.factory(calls),
    )
    retired = await provider.retire_machine("rack1-node01")
    assert retired.action is RetireAction.POWERED_OFF
    assert "fake: GracefulShutdown; off after 3s" in retired.detail and "out of the inventory" in retired.detail
    assert [call for call, _, _ in calls] == ["power_off"]

    plain = StaticProvider(
        "rack", secrets=rules(tmp_path), inventory=good_inventory(tmp_path), power=FakePowerControl.factory(calls)
    )
    untouched = await plain.retire_machine("rack1-node02")
    assert untouched.action is RetireAction.UNTOUCHED and "power it off by hand" in untouched.detail
    gone = await plain.retire_machine("rack9-node99")
    assert gone.action is RetireAction.UNTOUCHED and "not in the inventory" in gone.detail
    assert len(calls) == 1


def test_password_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    secret = write(tmp_path / "password", SECRET)
    secret.chmod(0o644)
    inventory = bmc_inventory(tmp_path, f'password_file = "{secret}"')
    # Every pass checks the file (without reading it) and refuses the whole inventory in one line.
    with pytest.raises(InventoryError) as refused:
        load_inventory(inventory, secrets=rules(tmp_path))
    message = one_line(refused.value)
    assert f"inventory {inventory} line 2 machine 'rack1-node01': BMC password file {secret} is readable" in message
    assert f"chmod 600 {secret}" in message

    secret.chmod(0o600)
    [listed] = load_inventory(inventory, secrets=rules(tmp_path))
    assert listed.bmc is not None and SECRET not in repr(listed)
    assert listed.bmc.endpoint(listed.id).password == SECRET
    # Made readable after the pass: the reboot that reads it refuses too.
    secret.chmod(0o644)
    with pytest.raises(InventoryError) as caught:
        listed.bmc.endpoint(listed.id)
    message = one_line(caught.value)
    assert f"machine 'rack1-node01': BMC password file {secret} is readable by others (mode 0644)" in message


@pytest.mark.parametrize(
    "content, mode, expected",
    [
        (None, 0o600, "cannot be read: No such file or directory"),
        ("\n", 0o600, "is empty"),
        (SECRET, 0o640, "is readable by others (mode 0640); run: chmod 600 {secret}"),
    ],
    ids=["missing", "empty", "group-readable"],
)
def test_password_file_problems(tmp_path: Path, content: str | None, mode: int, expected: str) -> None:
    secret = write(tmp_path / "password", SECRET)
    secret.chmod(0o600)
    [listed] = load_inventory(bmc_inventory(tmp_path, 'password_file = "password"'), secrets=rules(tmp_path))
    assert listed.bmc is not None
    # Changed after the pass that listed it: the reboot reads the file and refuses.
    if content is None:
        secret.unlink()
    else:
        write(secret, content).chmod(mode)
    with pytest.raises(InventoryError) as caught:
        listed.bmc.endpoint(listed.id, "rack")
    where = f"provider rack: machine 'rack1-node01': BMC password file {secret}"
    assert one_line(caught.value) == f"{where} {expected.format(secret=secret)}"


def test_password_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    [listed] = load_inventory(bmc_inventory(tmp_path, 'password_env = "BMC_PASSWORD_TEST"'), secrets=rules(tmp_path))
    assert listed.bmc is not None
    monkeypatch.delenv("BMC_PASSWORD_TEST", raising=False)
    with pytest.raises(InventoryError) as caught:
        listed.bmc.endpoint(listed.id)
    assert "BMC password variable BMC_PASSWORD_TEST is not set" in one_line(caught.value)
    monkeypatch.setenv("BMC_PASSWORD_TEST", "")
    with pytest.raises(InventoryError, match="BMC_PASSWORD_TEST is empty"):
        listed.bmc.endpoint(listed.id)
    monkeypatch.setenv("BMC_PASSWORD_TEST", SECRET)
    assert listed.bmc.endpoint(listed.id).password == SECRET
    assert os.environ["BMC_PASSWORD_TEST"] not in repr(listed.bmc)


def test_a_missing_password_file_refuses_the_inventory_naming_line_and_machine(tmp_path: Path) -> None:
    inventory = bmc_inventory(tmp_path, 'password_file = "nowhere"')
    with pytest.raises(InventoryError) as refused:
        load_inventory(inventory, secrets=rules(tmp_path))
    assert refused.value.retryable is False
    assert one_line(refused.value) == (
        f"provider static: inventory {inventory} line 2 machine 'rack1-node01': "
        f"BMC password file {tmp_path / 'nowhere'} cannot be read: No such file or directory"
    )


async def test_a_password_file_made_readable_by_others_stops_the_next_pass_of_an_unchanged_inventory(
    tmp_path: Path,
) -> None:
    path = good_inventory(tmp_path)
    provider = StaticProvider("rack", secrets=rules(tmp_path), inventory=path, power=FakePowerControl.factory([]))
    assert len(await provider.list_machines()) == 4
    (tmp_path / "bmc" / "rack1-node01").chmod(0o644)
    with pytest.raises(InventoryError, match=r"line \d+ machine 'rack1-node01': BMC password file .* is readable by"):
        await provider.list_machines()
