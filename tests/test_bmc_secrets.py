"""An inventory may be another's file: what it names is sent to the BMC it gives, so it reads only what was set aside
for BMCs. Password files inside the BMC secrets directory (links and .. followed), never one of Shepherd's own
keys, variables of the BMC password prefix, https:// BMCs unless the table consents; `shepherd inventory check`
holds an inventory to the same rules before it reaches any BMC."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from foundation.settings import Settings
from providers.bmc_secrets import BmcSecretRules
from providers.inventory import InventoryError, load_inventory
from providers.static import StaticProvider
from shepherd.commands.dev_stack.stack_settings import DevOptions, dev_settings
from tests.sshd_fixtures import free_port

SECRET = "the-bmc-password"
KEY_TEXT = "-----BEGIN OPENSSH PRIVATE KEY-----\nnot a BMC password\n"


@dataclass
class Host:
    """A worker's host: /etc/shepherd with its inventory and BMC folder, Shepherd's state with its SSH key."""

    root: Path

    @property
    def bmc(self) -> Path:
        return self.root / "etc" / "bmc"

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def inventory(self) -> Path:
        return self.root / "etc" / "inventory.toml"

    def settings(self, **changes: object) -> Settings:
        return Settings(state_dir=self.state, bmc_secrets_dir=self.bmc).replace(**changes)

    def rules(self, environ: dict[str, str] | None = None, **changes: object) -> BmcSecretRules:
        return BmcSecretRules.from_settings(
            self.settings(**changes), {"TEMPORAL_CONFIG_FILE": os.devnull, **(environ or {})}
        )

    def inventory_naming(self, password_file: str, url: str = "https://10.0.1.11") -> Path:
        consent = "insecure_http = true\n" if url.startswith("http://") else ""
        self.inventory.write_text(
            '[[machines]]\nid = "rack1-node01"\nssh = "10.0.0.11"\n[machines.bmc]\ntype = "redfish"\n'
            f'url = "{url}"\n{consent}username = "admin"\npassword_file = "{password_file}"\n'
        )
        return self.inventory


def owner_only(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o600)
    return path


@pytest.fixture
def host(tmp_path: Path) -> Host:
    found = Host(tmp_path)
    owner_only(found.bmc / "rack1-node01", SECRET)
    owner_only(found.state / "ssh_key", KEY_TEXT)
    return found


def refusal(inventory: Path, rules: BmcSecretRules) -> str:
    with pytest.raises(InventoryError) as refused:
        load_inventory(inventory, "rack1", secrets=rules)
    message = str(refused.value)
    assert message.startswith(
        f"provider rack1: inventory {inventory} line 1 machine 'rack1-node01': BMC password file "
    )
    assert SECRET not in message and "not a BMC password" not in message
    return message


def test_a_password_file_in_the_bmc_secrets_directory_serves(host: Host) -> None:
    owner_only(host.bmc / "rack1" / "node01", SECRET)
    # A link that stays inside the directory is as good as the file it names.
    (host.bmc / "current").symlink_to(host.bmc / "rack1" / "node01")
    for named in ("bmc/rack1-node01", str(host.bmc / "rack1" / "node01"), "bmc/current", "bmc/rack1/../rack1-node01"):
        [machine] = load_inventory(host.inventory_naming(named), "rack1", secrets=host.rules())
        assert machine.bmc is not None and machine.bmc.endpoint(machine.id, "rack1").password == SECRET


@pytest.mark.parametrize(
    "named",
    ["../state/ssh_key", "bmc/../../state/ssh_key", "{root}/state/ssh_key", "bmc/rack1-node01/../../../state/ssh_key"],
    ids=["relative", "dot-dot out of the directory", "absolute", "through a file name"],
)
def test_a_password_file_outside_the_directory_is_refused(host: Host, named: str) -> None:
    inventory = host.inventory_naming(named.format(root=host.root))
    message = refusal(inventory, host.rules())
    assert f"is outside the BMC secrets directory {host.bmc}" in message
    assert "put it there, or set bmc_secrets_dir" in message


def test_a_link_out_of_the_directory_is_judged_where_it_leads(host: Host) -> None:
    (host.bmc / "rack1-node02").symlink_to(host.state / "ssh_key")
    message = refusal(host.inventory_naming("bmc/rack1-node02"), host.rules())
    assert f"bmc/rack1-node02 is outside the BMC secrets directory {host.bmc} (it resolves to " in message
    assert f"{host.state / 'ssh_key'})" in message


def test_shepherds_own_files_are_refused_even_inside_the_directory(host: Host) -> None:
    key = owner_only(host.bmc / "ssh_key", KEY_TEXT)
    message = refusal(host.inventory_naming("bmc/ssh_key"), host.rules(ssh_key_path=key))
    assert message.endswith("bmc/ssh_key is Shepherd's SSH key (setting ssh_key_path), never a BMC password")

    # Linked to from a name of its own, or hard-linked: the same file.
    (host.bmc / "innocent").symlink_to(key)
    message = refusal(host.inventory_naming("bmc/innocent"), host.rules(ssh_key_path=key))
    assert "is Shepherd's SSH key (setting ssh_key_path)" in message
    tls_key = owner_only(host.root / "etc" / "tls" / "heartbeat.key", KEY_TEXT)
    os.link(tls_key, host.bmc / "rack1-node03")
    message = refusal(host.inventory_naming("bmc/rack1-node03"), host.rules(heartbeat_tls_key_path=tls_key))
    assert "is the file of setting heartbeat_tls_key_path, never a BMC password" in message

    # The Temporal client's key and its configuration file, named by its variables.
    temporal_key = owner_only(host.bmc / "temporal.key", KEY_TEXT)
    temporal_toml = owner_only(host.bmc / "temporal.toml", '[profile.default]\napi_key = "k"\n')
    temporal_certificate = owner_only(host.bmc / "temporal.pem", "a certificate")
    environ = {
        "TEMPORAL_TLS_CLIENT_KEY_PATH": str(temporal_key),
        "TEMPORAL_TLS_CLIENT_CERT_PATH": str(temporal_certificate),
    }
    message = refusal(host.inventory_naming("bmc/temporal.key"), host.rules(environ))
    assert "is the Temporal client's TEMPORAL_TLS_CLIENT_KEY_PATH" in message
    message = refusal(
        host.inventory_naming("bmc/temporal.toml"), host.rules({"TEMPORAL_CONFIG_FILE": str(temporal_toml)})
    )
    assert "is the Temporal client configuration (TEMPORAL_CONFIG_FILE), with its API key" in message
    # BMDB's client key, named in its URL.
    url = f"postgresql://shepherd@db/bmdb?sslmode=verify-full&sslkey={host.bmc / 'bmdb.key'}"
    owner_only(host.bmc / "bmdb.key", KEY_TEXT)
    message = refusal(host.inventory_naming("bmc/bmdb.key"), host.rules(database_url=url))
    assert "is BMDB's sslkey (setting database_url)" in message


async def test_a_file_swapped_for_a_link_after_the_pass_is_refused_when_the_password_is_read(host: Host) -> None:
    provider = StaticProvider("rack1", host.inventory_naming("bmc/rack1-node01"), secrets=host.rules())
    [listed] = await provider.list_machines()
    [machine] = load_inventory(host.inventory, "rack1", secrets=host.rules())
    assert machine.bmc is not None

    (host.bmc / "rack1-node01").unlink()
    (host.bmc / "rack1-node01").symlink_to(host.state / "ssh_key")
    with pytest.raises(InventoryError) as refused:
        machine.bmc.endpoint(machine.id, "rack1")
    assert str(refused.value).startswith(
        f"provider rack1: machine 'rack1-node01': BMC password file {host.bmc / 'rack1-node01'} is outside the BMC "
        "secrets directory"
    )
    # The inventory itself is unchanged, so the next pass checks the file from its cached parse, and refuses too.
    with pytest.raises(InventoryError, match=r"line 1 machine 'rack1-node01': BMC password file .* is outside"):
        await provider.list_machines()
    await provider.close()
    assert listed.provider_id == "rack1-node01"


def test_the_rules_come_from_the_settings(tmp_path: Path) -> None:
    rules = BmcSecretRules.from_settings(Settings(state_dir=tmp_path), {"TEMPORAL_CONFIG_FILE": os.devnull})
    assert (rules.directory, rules.variable_prefix) == (Path("/etc/shepherd/bmc"), "BMC_PASSWORD_")
    assert rules.own_files[tmp_path / "ssh_key"] == "Shepherd's SSH key (setting ssh_key_path)"
    assert rules.variable_refusal("BMC_PASSWORD_RACK1") is None
    assert "TEMPORAL_API_KEY does not start with BMC_PASSWORD_" in (rules.variable_refusal("TEMPORAL_API_KEY") or "")
    for prefix, problem in (
        ("SHEPHERD_", "must not reach the SHEPHERD_ variables"),
        ("SHEPHERD_DATABASE_", "must not reach the SHEPHERD_ variables"),
        ("S", "must not reach the SHEPHERD_ variables"),
        ("TEMPORAL_API", "must not reach the TEMPORAL_ variables"),
        ("", "must be the start of a variable name"),
        ("BMC-", "must be the start of a variable name"),
    ):
        with pytest.raises(ValueError, match=problem):
            Settings(bmc_password_env_prefix=prefix).check()


@asynccontextmanager
async def witness() -> AsyncIterator[tuple[int, list[str]]]:
    """A port that records every connection made to it, where a BMC would answer: (port, who connected)."""
    seen: list[str] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(str(writer.get_extra_info("peername")))
        writer.close()

    server = await asyncio.start_server(record, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], seen
    finally:
        server.close()
        await server.wait_closed()


async def test_inventory_check_sends_no_secret_to_a_bmc_the_rules_refuse(host: Host, shepherd_cli) -> None:
    env = {
        "SHEPHERD_STATE_DIR": str(host.state),
        "SHEPHERD_BMC_SECRETS_DIR": str(host.bmc),
        "SHEPHERD_PROVIDER_TIMEOUT": "2s",
        "TEMPORAL_CONFIG_FILE": os.devnull,
    }
    # The command logs in with Shepherd's own key, created where the state dir says.
    (host.state / "ssh_key").unlink()
    async with witness() as (port, seen):
        url = f"http://127.0.0.1:{port}"

        def inventory(password: str, *, consent: bool) -> str:
            host.inventory.write_text(
                f'[[machines]]\nid = "rack1-node01"\nssh = "127.0.0.1:{free_port()}"\n'
                f'[machines.bmc]\ntype = "redfish"\nurl = "{url}"\nusername = "admin"\n{password}\n'
                + ("insecure_http = true\n" if consent else "")
            )
            return str(host.inventory)

        for password, consent, problem in (
            ('password_file = "bmc/rack1-node01"', False, "write insecure_http = true in this [machines.bmc]"),
            ('password_file = "../state/ssh_key"', True, "is outside the BMC secrets directory"),
            ('password_env = "SHEPHERD_DATABASE_URL"', True, "SHEPHERD_DATABASE_URL does not start with BMC_PASSWORD_"),
        ):
            code, out, err = await shepherd_cli(env, "inventory", "check", inventory(password, consent=consent))
            assert (code, out) == (1, ""), err
            assert "line 1 machine 'rack1-node01': " in err and problem in err, err
        assert seen == [], "no BMC was reached"

        # The same inventory within the rules does reach the BMC: the witness sees the probe.
        code, out, _ = await shepherd_cli(
            env, "inventory", "check", inventory('password_file = "bmc/rack1-node01"', consent=True)
        )
        assert code == 1 and "rack1-node01  FAIL" in out
        assert seen, "the BMC within the rules was probed"


def test_shepherd_dev_takes_bmc_passwords_from_the_inventorys_folder_unless_told_otherwise(host: Host) -> None:
    inventory = host.inventory_naming("bmc/rack1-node01")
    options = DevOptions(inventory=inventory, agent_endpoint="127.0.0.1:8900")
    assert dev_settings(Settings(), host.state, options).effective_bmc_secrets_dir == inventory.parent
    told = Settings(bmc_secrets_dir=host.bmc)
    assert dev_settings(told, host.state, options).effective_bmc_secrets_dir == host.bmc
    assert dev_settings(Settings(), host.state, DevOptions()).effective_bmc_secrets_dir == Path("/etc/shepherd/bmc")


def test_the_deploy_example_inventory_keeps_to_the_default_rules(tmp_path: Path) -> None:
    example = (Path(__file__).parent.parent / "deploy" / "inventory.example.toml").read_text()
    # The example's /etc/shepherd/bmc, here: the default directory, moved under the test's folder.
    bmc = tmp_path / "etc" / "shepherd" / "bmc"
    for name in ("rack1-node01", "rack2-node07"):
        owner_only(bmc / name, SECRET)
    inventory = tmp_path / "inventory.toml"
    inventory.write_text(example.replace("/etc/shepherd/bmc", str(bmc)))
    defaults = Settings(state_dir=tmp_path / "state")
    rules = BmcSecretRules.from_settings(defaults, {"TEMPORAL_CONFIG_FILE": os.devnull})
    machines = load_inventory(inventory, secrets=BmcSecretRules(bmc, rules.variable_prefix, rules.own_files))
    assert [machine.id for machine in machines] == ["rack1-node01", "rack1-node02", "rack2-node07", "lab-v6-01"]
