"""Property-based fuzzing of what an operator types: a static inventory whose machines carry Redfish and IPMI BMC
tables, a --where query put inside a scope and the running-machines filter, and the options of every provider type.

Any input gives a valid result or the parser's own error naming the problem, never another exception; what is
accepted holds what the parser promises (a port that is a port, a password only from where the rules allow, a
number that is finite and in its bounds, a query whose filters still hold).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from foundation.setting_values import SettingsError, parse_duration
from foundation.settings import Settings
from lifecycle.contracts import RUNNING_MACHINES
from operations.policy import ScopeEscape, restrict
from operations.policy_file import query_problem
from providers.bmc_secrets import BmcSecretRules
from providers.inventory import InventoryError, load_inventory
from providers.inventory_bmc import IpmiBMC, RedfishBMC
from providers.ipmi import IpmiEndpoint
from providers.ironic import IronicProvider
from providers.redfish import RedfishEndpoint
from providers.registry import open_providers
from providers.sim import SimProvider

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

PREFIX = "BMC_PASSWORD_"
PASSWORD_VARIABLE = PREFIX + "RACK1"


def toml_string(text: str) -> str:
    """text as a TOML basic string: JSON's escapes are TOML's, but for DEL, which TOML wants escaped too."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


# Values of every TOML type, the awkward ones first.
ANY_VALUE = st.one_of(
    st.sampled_from(["nan", "inf", "-inf", "-1", "0", "1e308", "-0.0", "true", "[]", "{}", '["a", 1]', "{a = 1}"]),
    st.integers(min_value=-(2**63), max_value=2**63 - 1).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.text(max_size=30).map(toml_string),
)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder with the inventory's place, a BMC secrets directory holding a password file, a link out of it, and
    a file outside it; the BMC password variable set."""
    root = tmp_path_factory.mktemp("site")
    secrets = root / "secrets"
    secrets.mkdir(mode=0o700)
    (secrets / "rack1").write_text("secret\n")
    (secrets / "rack1").chmod(0o600)
    (root / "outside").write_text("secret\n")
    (root / "outside").chmod(0o600)
    (secrets / "link").symlink_to(root / "outside")
    os.environ[PASSWORD_VARIABLE] = "secret"
    yield root
    del os.environ[PASSWORD_VARIABLE]


TYPE_ADDRESS = {"redfish": "url", "ipmi": "host"}
CHOICES = {
    "url": st.sampled_from(['"https://10.0.0.5"', '"https://[fd00::5]:8443"', '"http://10.0.0.5"', '"https://u@h"']),
    "host": st.sampled_from(['"10.0.0.5"', '"bmc-1.rack1"', '"fd00::5"', '"10.0.0.5:623"']),
    "username": st.sampled_from(['"admin"', '"' + "a" * 16 + '"', '"' + "a" * 17 + '"', toml_string("é" * 9)]),
    "password_file": st.sampled_from(['"secrets/rack1"', '"secrets/missing"', '"secrets/link"', '"outside"']),
    "password_env": st.sampled_from([f'"{PASSWORD_VARIABLE}"', f'"{PREFIX}UNSET"', '"HOME"']),
}
BMC_VALUES = {
    "type": st.sampled_from(['"redfish"', '"ipmi"', '"IPMI"', '""', "1"]),
    "url": st.one_of(
        st.sampled_from(
            [
                *('"https://10.0.0.5"', '"https://bmc1.rack1/"', '"https://[fd00::5]:8443"', '"http://10.0.0.5"'),
                *('"https://u:p@10.0.0.5"', '"ftp://10.0.0.5"', '"https://10.0.0.5:99999"', '"https://"'),
                *('"https://[fd00::5"', '"https://10.0.0.5:-1"', '"HTTPS://10.0.0.5"'),
            ]
        ),
        ANY_VALUE,
    ),
    "host": st.one_of(
        st.sampled_from(['"10.0.0.5"', '"bmc-1.rack1"', '"fd00::5"', '"10.0.0.5:623"', '""', '"-x"', '"a b"']),
        ANY_VALUE,
    ),
    "port": st.one_of(st.sampled_from(["623", "1", "65535", "0", "65536", "true", "623.0", '"623"']), ANY_VALUE),
    "username": st.one_of(
        st.sampled_from(['"admin"', '"' + "a" * 16 + '"', '"' + "a" * 17 + '"', toml_string("é" * 9), '""']),
        ANY_VALUE,
    ),
    "password_file": st.one_of(
        st.sampled_from(
            [
                *('"secrets/rack1"', '"secrets/missing"', '"secrets/link"', '"secrets/../outside"', '"outside"'),
                *('"/etc/passwd"', '"secrets"', '""'),
            ]
        ),
        ANY_VALUE,
    ),
    "password_env": st.one_of(
        st.sampled_from([f'"{PASSWORD_VARIABLE}"', f'"{PREFIX}UNSET"', '"HOME"', '"1BAD"', f'"{PREFIX}"', '""']),
        ANY_VALUE,
    ),
    "system": st.sampled_from(['"/redfish/v1/Systems/1"', '"Systems/1"', "1"]),
    "ca_file": st.sampled_from(['"secrets/ca.pem"', '""', "[]"]),
    "verify_tls": st.sampled_from(["true", "false", '"no"']),
    "insecure_http": st.sampled_from(["true", "false", "1"]),
    "password": st.just('"inline"'),
    "unknown": ANY_VALUE,
}


@st.composite
def bmc_tables(draw: st.DrawFn) -> str:
    """A [machines.bmc] table: usually a type and a login, then any of the keys, each from its own awkward values."""
    keys = draw(st.lists(st.sampled_from(sorted(BMC_VALUES)), max_size=3, unique=True))
    if draw(st.integers(0, 3)):
        kind = draw(st.sampled_from(["redfish", "ipmi"]))
        core = ["username", draw(st.sampled_from(["password_file", "password_env"])), TYPE_ADDRESS[kind]]
        # The core keys from their own values alone, so that whole tables are often valid and the checks of what is
        # accepted get to run.
        lines = {"type": f'type = "{kind}"', **{key: f"{key} = {draw(CHOICES[key])}" for key in core}}
    else:
        lines = {}
    lines.update({key: f"{key} = {draw(BMC_VALUES[key])}" for key in keys if key not in lines})
    return "[machines.bmc]\n" + "\n".join(lines.values())


@st.composite
def inventories(draw: st.DrawFn) -> str:
    machines = []
    for n in range(draw(st.integers(1, 3))):
        machine = f'[[machines]]\nid = "m{n}"\nssh = "10.0.1.{n}:22"'
        if draw(st.booleans()):
            machine += f"\nlocation = {draw(st.one_of(st.text(max_size=20).map(toml_string), ANY_VALUE))}"
        if draw(st.integers(0, 4)):
            machine += "\n" + draw(bmc_tables())
        machines.append(machine)
    return "\n\n".join(machines) + "\n"


@FUZZ
@given(document=inventories())
def test_any_inventory_with_bmcs_gives_machines_whose_bmcs_hold_or_an_inventory_error(site, document):
    inventory = site / "inventory.toml"
    inventory.write_text(document)
    rules = BmcSecretRules(site / "secrets", PREFIX, {})
    try:
        machines = load_inventory(inventory, secrets=rules)
    except InventoryError as error:
        assert str(error).startswith(f"provider static: inventory {inventory}") and "\n" not in str(error)
        return
    for machine in machines:
        bmc = machine.bmc
        if bmc is None:
            continue
        assert bmc.username and isinstance(bmc.username, str)
        if bmc.password_env is not None:
            assert bmc.password_file is None and bmc.password_env.startswith(PREFIX)
        else:
            assert bmc.password_file is not None
            real = Path(os.path.realpath(bmc.password_file))
            assert real.parent == Path(os.path.realpath(site / "secrets")), "a password file outside the directory"
        if isinstance(bmc, IpmiBMC):
            assert type(bmc.port) is int and 0 < bmc.port < 65536
            assert bmc.host and len(bmc.username.encode()) <= 16
        else:
            assert isinstance(bmc, RedfishBMC)
            assert re.match(r"https?://[^/@]", bmc.url) and "@" not in bmc.url
        # Reaching it reads the password now: an endpoint, or the inventory's error naming why not.
        try:
            endpoint = bmc.endpoint(machine.id)
        except InventoryError as error:
            assert str(error).startswith(f"provider static: machine {machine.id!r}: BMC password")
            continue
        assert isinstance(endpoint, IpmiEndpoint | RedfishEndpoint) and endpoint.password == "secret"


# --where: the operator's query is put in parentheses after a scope and after the running-machines filter.

WHERE_PIECES = st.sampled_from(
    [
        *("(", ")", "'", '"', "`", "''", " OR ", " or ", " AND ", "||", " NOT ", "MachineStage", " = ", "'WATCHING'"),
        *("--", "-- ", "#", "/*", "*/", ";", "\\", "x", " ", "\n", "\t", "Provider IN ('a', 'b')", "1=1"),
    ]
)
WHERE = st.one_of(st.lists(WHERE_PIECES, max_size=12).map("".join), st.text(max_size=60))
SCOPES = st.sampled_from(
    [None, "Provider IN ('rack1')", "(Provider IN ('rack1')) OR (MachineStage = 'WATCHING')", "MachineStage = 'X'"]
)


def groups(query: str) -> tuple[list[tuple[int, int]], bool]:
    """The parenthesized groups (start, end) of a visibility query as a SQL lexer reads it (quotes doubled or
    escaped with a backslash, comments to the end of the line or the closing */), and whether an OR stands at the
    top level. A comment, or a parenthesis or quote left open, makes the query unreadable: ([], True)."""
    spans, stack, top_level_or, index = [], [], False, 0
    while index < len(query):
        char = query[index]
        if char in "'\"`":
            index += 1
            while index < len(query) and not (query[index] == char and query[index + 1 : index + 2] != char):
                index += 2 if query[index] == "\\" or query[index] == char else 1
            if index >= len(query):
                return [], True
        elif query.startswith(("--", "#", "/*"), index) or char == ";":
            return [], True
        elif char == "(":
            stack.append(index)
        elif char == ")":
            if not stack:
                return [], True
            spans.append((stack.pop(), index))
        elif not stack and (query.startswith("||", index) or re.match(r"(?i)\bor\b", query[index:])):
            top_level_or = top_level_or or (index == 0 or not query[index - 1].isalnum())
        index += 1
    return (spans, top_level_or) if not stack else ([], True)


def enclosed(query: str, prefix: str) -> bool:
    """Whether the query is prefix followed by one parenthesized group that runs to its end, with no OR at its top
    level: what the operator wrote cannot reach past the filters before it."""
    spans, top_level_or = groups(query)
    return not top_level_or and (len(prefix), len(query) - 1) in spans


@FUZZ
@given(scope=SCOPES, where=WHERE)
def test_any_where_is_refused_or_kept_inside_its_scope_and_the_running_machines_filter(scope, where):
    try:
        query = restrict(scope, where)
    except ScopeEscape as refusal:
        assert str(refusal).startswith("the query ") and query_problem(where) is not None
        return
    assert query is not None and query_problem(where) is None
    if scope is not None:
        prefix = f"({scope}) AND "
        assert query.startswith(prefix) and enclosed(query, prefix), query
        assert (0, len(scope) + 1) in groups(query)[0], "the scope's own parenthesis was closed early"
    # What select builds of an accepted query (operations/machine_actions.py), on its own and within a scope.
    running = f"{RUNNING_MACHINES} AND "
    assert enclosed(f"{running}({query})", running), query


def test_the_where_oracle_sees_an_escape_that_query_problem_refuses():
    """The property above holds only if the oracle sees what an escape looks like: it does."""
    running = f"{RUNNING_MACHINES} AND "
    for escape in ("x) OR (y", "x) || (y", "'a' = 'a') OR ('", "x -- ", "x /* "):
        assert not enclosed(f"{running}({escape})", running), escape
    assert enclosed(f"{running}(MachineStage = 'a'')' OR (x))", running)


# Provider options: each type with the options it needs besides the one under test; none is reached over the network.

TYPES = {
    "sim": {"api_url": '"http://127.0.0.1:9"'},
    "static": {"inventory": '"inventory.toml"'},
    "ironic": {
        "endpoint": '"http://127.0.0.1:9"',
        "address_field": '"extra/ssh_address"',
        "image_source": '"http://127.0.0.1:9/os.qcow2"',
    },
}
OPTIONS = {
    "sim": ["api_url", "timeout", "activities_per_second"],
    "static": ["inventory", "graceful_timeout", "power_back_timeout", "activities_per_second"],
    "ironic": [
        *("endpoint", "auth", "username", "password_file", "password_env", "cloud", "clouds_file", "ca_file"),
        *("verify_tls", "timeout", "resource_class", "conductor_group", "owner", "traits", "image_source"),
        *("image_checksum", "instance_info", "root_device", "user_data_file", "address_field", "address_template"),
        *("address_source", "address_interface", "address_ip_version", "ssh_port", "ssh_user", "power_timeout"),
        "activities_per_second",
    ],
}
DURATIONS = {"timeout", "graceful_timeout", "power_back_timeout", "power_timeout"}
STATIC_TIMEOUTS = ("graceful_timeout", "power_back_timeout")
OPTION_VALUES = st.one_of(
    ANY_VALUE,
    st.sampled_from(['"30s"', '"250ms"', '"5m"', '"4h"', '"-1s"', '"1e3s"', '"9' + "9" * 400 + 's"', "1e-300"]),
    st.sampled_from(['"http_basic"', '"none"', '"inspection"', "4", "6", "22", "65536", '["CUSTOM_A"]']),
)


def seconds(value: object) -> float:
    """A duration option as the provider takes it: seconds, or a duration string."""
    return parse_duration(value) if isinstance(value, str) else float(value)  # type: ignore[arg-type]


@FUZZ
@given(kind=st.sampled_from(sorted(TYPES)), data=st.data())
def test_any_provider_option_gives_a_provider_in_bounds_or_a_settings_error_naming_it(tmp_path, kind, data):
    option = data.draw(st.sampled_from(OPTIONS[kind]), label="option")
    value = data.draw(OPTION_VALUES, label="value")
    options = {**TYPES[kind], option: value}
    table = "\n".join(f"{key} = {text}" for key, text in options.items())
    path = tmp_path / "shepherd.toml"
    path.write_text(f'reboot_timeout = "1h"\n[[providers]]\nname = "rack1"\ntype = "{kind}"\n{table}\n')
    try:
        resolved, _ = Settings.resolve({}, config_path=path)
        providers = open_providers(resolved.check())
    except SettingsError as error:
        assert option in str(error) and error.setting in ("providers", "reboot_timeout"), str(error)
        return
    provider = providers["rack1"]
    (instance,) = resolved.provider_instances
    assert math.isfinite(instance.activities_per_second) and instance.activities_per_second >= 0
    if option in DURATIONS:
        taken = seconds(instance.options[option])
        assert math.isfinite(taken) and taken > 0
    if isinstance(provider, SimProvider):
        assert math.isfinite(provider.timeout) and provider.timeout > 0
    if kind == "static":
        graceful, power_back = (seconds(instance.options.get(name, 120)) for name in STATIC_TIMEOUTS)
        assert graceful + 2 * power_back < resolved.reboot_timeout
    if isinstance(provider, IronicProvider):
        ironic = provider.options
        assert all(math.isfinite(t) and t > 0 for t in (ironic.timeout, ironic.power_timeout))
        assert type(ironic.ssh_port) is int and 0 < ironic.ssh_port < 65536
        assert ironic.address_ip_version in (None, 4, 6)
