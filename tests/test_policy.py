"""Who may do what through the operator API: the policy file, checked at load, its decisions, and its reload."""

from __future__ import annotations

import logging
import os
import tomllib
from pathlib import Path

import pytest

from foundation.setting_values import SettingsError
from foundation.settings import Settings
from operations.policy import (
    Confirmation,
    OneMachine,
    ReloadedPolicy,
    Requester,
    ScopeEscape,
    Selection,
    WholeFleet,
    WholeProvider,
    decide,
    restrict,
)
from operations.policy_file import ACTIONS, DEFAULT_BULK_CONFIRM_OVER, PolicyError, load_policy, parse_policy

EXAMPLE = Path(__file__).resolve().parent.parent / "deploy" / "policy.example.toml"

POLICY = """
[roles]
viewer = ["read", "events-stream"]
operator = ["read", "recover", "restart-agent", "maintenance"]
admin = ["*"]

[[grants]]
role = "viewer"
subjects = ["alice@example.com"]

[[grants]]
role = "operator"
subjects = ["bob@example.com"]
providers = ["rack1"]

[[grants]]
role = "operator"
groups = ["night-shift"]
where = "MachineStage = 'WATCHING'"

[[grants]]
role = "operator"
groups = ["rack2-team"]
providers = ["rack2", "rack3"]

[[grants]]
role = "admin"
certificates = ["CN=fleet-bot,O=Example", "ops-robot"]

[confirmations]
second_person = ["decommission"]
typed = ["release-recoveries"]
bulk_confirm_over = 10
"""

ALICE = Requester("alice@example.com")
BOB = Requester("bob@example.com")


def policy(text: str = POLICY):
    return parse_policy(tomllib.loads(text), "policy.toml")


def test_a_viewer_is_refused_a_decommission_naming_what_is_missing() -> None:
    decision = decide(policy(), ALICE, "decommission", OneMachine("rack1"))
    assert not decision.allowed
    assert decision.refusal == (
        "alice@example.com may not decommission machines of provider rack1: no grant gives 'decommission' there; "
        "grants of alice@example.com: viewer (all providers)"
    )
    assert decide(policy(), ALICE, "read", OneMachine("rack1")).allowed


def test_an_operator_scoped_to_a_provider_acts_only_on_its_machines() -> None:
    allowed = decide(policy(), BOB, "recover", OneMachine("rack1"))
    assert allowed.allowed and allowed.scope is None and allowed.confirmation is Confirmation.NONE
    refused = decide(policy(), BOB, "recover", OneMachine("rack2"))
    assert not refused.allowed
    assert refused.refusal is not None and "grants of bob@example.com: operator (providers rack1)" in refused.refusal
    # Over a selection the provider scope becomes part of the query, so no other provider's machine is reached.
    assert decide(policy(), BOB, "recover", Selection(3)).scope == "(Provider IN ('rack1'))"


def test_nobody_named_nothing_allowed_and_no_policy_grants_nothing() -> None:
    stranger = Requester("mallory@example.com", groups=("everyone",))
    refused = decide(policy(), stranger, "read", Selection())
    assert not refused.allowed and refused.refusal is not None and refused.refusal.endswith("mallory@example.com: none")
    assert not decide(None, ALICE, "read", Selection()).allowed


def test_a_group_grant_and_its_where_scope() -> None:
    night = Requester("carol@example.com", groups=("staff", "night-shift"))
    decision = decide(policy(), night, "recover", OneMachine("rack9"))
    assert decision.allowed and decision.scope == "(MachineStage = 'WATCHING')"
    # A where reaches machines, never a provider's schedule.
    assert not decide(policy(), night, "read", WholeProvider("rack9")).allowed
    day = Requester("dave@example.com", groups=("day-shift",))
    assert not decide(policy(), day, "recover", OneMachine("rack1")).allowed


def test_a_certificate_grant_by_subject_dn_or_common_name() -> None:
    bot = Requester("fleet-bot", certificate="CN=fleet-bot,O=Example", verified_by="certificate")
    decision = decide(policy(), bot, "fleet-pause", WholeFleet())
    assert decision.allowed and decision.scope is None
    robot = Requester("robot", certificate="CN=ops-robot,O=Elsewhere", verified_by="certificate")
    assert decide(policy(), robot, "decommission", OneMachine("rack1")).allowed
    # The same CN under another organisation is not the DN the grant names; nor is a subject the same string.
    assert not decide(policy(), Requester("x", certificate="CN=fleet-bot,O=Other"), "read", WholeFleet()).allowed
    assert not decide(policy(), Requester("CN=fleet-bot,O=Example"), "read", WholeFleet()).allowed


def test_scopes_of_several_grants_are_ored_and_parenthesized() -> None:
    both = Requester("bob@example.com", groups=("night-shift", "rack2-team"))
    decision = decide(policy(), both, "recover", Selection(5))
    assert decision.scope == (
        "((MachineStage = 'WATCHING')) OR ((Provider IN ('rack1'))) OR ((Provider IN ('rack2', 'rack3')))"
    )
    # One grant without scope makes the whole selection reachable.
    admin = Requester("bob@example.com", certificate="CN=ops-robot")
    assert decide(policy(), admin, "recover", Selection(5)).scope is None


def test_an_operators_own_query_cannot_escape_the_scope() -> None:
    scope = decide(policy(), BOB, "recover", Selection(3)).scope
    assert restrict(scope, "MachineStage = 'WATCHING' OR true") == (
        "((Provider IN ('rack1'))) AND (MachineStage = 'WATCHING' OR true)"
    )
    assert restrict(scope, None) == scope and restrict(None, "A = 'b'") == "A = 'b'"
    assert restrict(scope, "ProviderId = 'node-1) OR (x'") == (
        "((Provider IN ('rack1'))) AND (ProviderId = 'node-1) OR (x')"
    )
    for escape in (
        "Provider = 'rack2') OR (Provider = 'rack2'",
        "x) OR (y",
        "Provider = 'rack2' -- ",
        "Provider = 'rack2' /* ",
        "Provider = 'rack2' # ",
        "Provider = 'rack2'; DROP",
        # Balanced to a parser that reads a backslash as a character, escaping to one that reads it as an escape.
        "ProviderId = 'x\\'' ) OR ( Provider = 'rack2\\''",
        "Provider = 'rack2\nx",
        "(Provider = 'rack2'",
        "  ",
    ):
        with pytest.raises(ScopeEscape):
            restrict(scope, escape)


def test_confirmations() -> None:
    admin = Requester("bot", certificate="CN=ops-robot")
    assert decide(policy(), admin, "decommission", OneMachine("rack1")).confirmation is Confirmation.SECOND_PERSON
    assert decide(policy(), admin, "decommission", Selection(2)).confirmation is Confirmation.SECOND_PERSON
    release = decide(policy(), admin, "release-recoveries", WholeProvider("rack1"))
    assert release.confirmation is Confirmation.TYPED
    assert decide(policy(), admin, "recover", Selection(10)).confirmation is Confirmation.NONE
    assert decide(policy(), admin, "recover", Selection(11)).confirmation is Confirmation.TYPED
    assert decide(policy(), admin, "read", Selection(1000)).confirmation is Confirmation.NONE
    default = policy("[roles]\nadmin = ['*']\n[[grants]]\nrole = 'admin'\nsubjects = ['bot']\n")
    over = Selection(DEFAULT_BULK_CONFIRM_OVER + 1)
    assert decide(default, Requester("bot"), "maintenance", over).confirmation is Confirmation.TYPED


def test_an_action_on_a_target_it_cannot_have_is_the_callers_mistake() -> None:
    with pytest.raises(ValueError, match="fleet-pause acts on a provider instance"):
        decide(policy(), ALICE, "fleet-pause", OneMachine("rack1"))
    with pytest.raises(ValueError, match="decommission acts on machines"):
        decide(policy(), ALICE, "decommission", WholeFleet())
    with pytest.raises(ValueError, match="unknown action"):
        decide(policy(), ALICE, "reboot", OneMachine("rack1"))


GRANT = "[roles]\nviewer = ['read']\n[[grants]]\nrole = 'viewer'\n"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("[roles]\nviewer = ['read', 'reboot']\n", "policy.toml: [roles] viewer: unknown action 'reboot'"),
        ("[roles]\nviewer = 'read'\n", "policy.toml: [roles] viewer: must be a list of actions"),
        ("roles = 1\n", "policy.toml: roles: must be a [roles] table"),
        ("[role]\n", "policy.toml: the top level: unknown key 'role'"),
        (GRANT.replace("'viewer'\n", "'boss'\nsubjects = ['a']\n"), "[[grants]] 1: role: 'boss' is not defined"),
        ("[[grants]]\nsubjects = ['a']\n", "policy.toml: [[grants]] 1: role: must name a role of [roles]"),
        (GRANT, "policy.toml: [[grants]] 1 (role viewer): names no one: give subjects, groups or certificates"),
        (GRANT + "subjects = []\ngroups = []\n", "[[grants]] 1 (role viewer): names no one"),
        (GRANT + "subjects = 'alice'\n", "[[grants]] 1 (role viewer): subjects: must be a list of names"),
        (GRANT + "groups = ['']\n", "[[grants]] 1 (role viewer): groups: must be a list of names"),
        (GRANT + "subject = ['a']\n", "[[grants]] 1: unknown key 'subject'"),
        (GRANT + "subjects = ['a']\nwhere = ''\n", "[[grants]] 1 (role viewer): where: is empty"),
        (GRANT + "subjects = ['a']\nwhere = 1\n", "where: must be a visibility query string"),
        (GRANT + "subjects = ['a']\nwhere = \"a = 'b') OR (c = 'd'\"\n", "where: closes a parenthesis it did not"),
        (GRANT + "subjects = ['a']\nproviders = ['Rack1']\n", "providers: 'Rack1' is no provider instance name"),
        (GRANT + "subjects = ['a']\nproviders = []\n", "providers: empty; leave it out for every provider"),
        (GRANT + "certificates = ['CN=a, O=b']\n", "certificates: 'CN=a, O=b' is neither a CN nor a DN"),
        ("[confirmations]\nsecond_person = ['purge']\n", "[confirmations] second_person: unknown action 'purge'"),
        ("[confirmations]\ntyped = ['read']\n", "[confirmations] typed: read only reads and needs none"),
        ("[confirmations]\nbulk_confirm_over = -1\n", "bulk_confirm_over: must be a whole number >= 0, got -1"),
        ("[confirmations]\nbulk_confirm_over = true\n", "bulk_confirm_over: must be a whole number >= 0, got True"),
        ("[confirmations]\nbulk = 5\n", "[confirmations]: unknown key 'bulk'"),
        ("[roles\n", "policy.toml: not TOML: "),
    ],
)
def test_each_mistake_is_refused_at_load_with_one_line_naming_it(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(text)
    with pytest.raises(PolicyError) as caught:
        load_policy(path)
    message = str(caught.value)
    assert message.startswith(str(path)) and error.removeprefix("policy.toml") in message and "\n" not in message


def test_the_example_policy_loads_and_says_what_the_docs_say() -> None:
    example = load_policy(EXAMPLE)
    assert example.roles["admin"] == frozenset(ACTIONS)
    rack1 = Requester("erin@example.com", groups=("rack1-team",))
    assert decide(example, rack1, "recover", OneMachine("rack1")).allowed
    assert not decide(example, rack1, "recover", OneMachine("rack2")).allowed
    assert not decide(example, Requester("v", groups=("shepherd-viewers",)), "recover", OneMachine("rack1")).allowed
    bot = Requester("fleet-bot", certificate="CN=fleet-bot,O=Example", verified_by="certificate")
    assert decide(example, bot, "decommission", OneMachine("rack1")).confirmation is Confirmation.SECOND_PERSON


def test_the_policy_in_the_operations_guide_loads() -> None:
    guide = (EXAMPLE.parent.parent / "docs" / "operations.md").read_text()
    section = guide.split("## Who may do what through the API", 1)[1]
    block = section.split("```toml\n", 1)[1].split("```", 1)[0]
    shown = parse_policy(tomllib.loads(block), "docs/operations.md")
    assert shown.confirmations.second_person == {"decommission"} and len(shown.grants) == 3


def test_the_policy_file_is_read_again_when_it_changes_and_a_broken_one_is_not_taken(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(POLICY)
    now = [0.0]
    reloaded = ReloadedPolicy(path, interval=1.0, clock=lambda: now[0])
    assert not reloaded.decide(ALICE, "recover", OneMachine("rack1")).allowed

    path.write_text(POLICY.replace('viewer = ["read", "events-stream"]', 'viewer = ["read", "recover"]'))
    # Looked at no more often than the interval: the change is seen a second later.
    assert not reloaded.decide(ALICE, "recover", OneMachine("rack1")).allowed
    now[0] = 1.0
    assert reloaded.decide(ALICE, "recover", OneMachine("rack1")).allowed

    caplog.set_level(logging.WARNING, logger="shepherd.files")
    caplog.clear()
    path.write_text(POLICY.replace('role = "viewer"', 'role = "viewers"'))
    now[0] = 2.0
    assert reloaded.decide(ALICE, "recover", OneMachine("rack1")).allowed
    # Warnings only: the reload before logged at INFO, which a process whose root logger a command set up keeps.
    problems = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert len(problems) == 1 and "role: 'viewers' is not defined in [roles]" in problems[0]
    assert str(path) in problems[0] and "\n" not in problems[0]

    path.write_text(POLICY)
    os.utime(path, ns=(1, 1))  # even a file whose modification time goes back is seen changed
    now[0] = 3.0
    assert not reloaded.decide(ALICE, "recover", OneMachine("rack1")).allowed


def test_a_policy_that_does_not_load_at_start_names_the_setting(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text("[roles]\nviewer = ['reboot']\n")
    with pytest.raises(SettingsError, match=r"api_policy_path.*unknown action 'reboot'"):
        ReloadedPolicy(path)
    with pytest.raises(SettingsError, match="api_policy_path"):
        Settings(api_policy_path=tmp_path / "missing.toml").check()
    assert Settings(api_policy_path=EXAMPLE).check().api_policy_path == EXAMPLE
