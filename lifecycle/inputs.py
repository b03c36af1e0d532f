"""Workflow inputs made from settings: the one place where a setting becomes a payload.

A workflow never reads settings; what it needs of them travels in its input,
so a run keeps the values it started with and the UI shows them.
"""

from __future__ import annotations

from foundation.settings import Settings
from lifecycle.contracts import Backoff, FleetInput, LifecyclePolicy, MachineInput, RecoveryHoldRule, WatchdogInput
from proto import AGENT_MAX_RETRY_INTERVAL


def lifecycle_policy(settings: Settings) -> LifecyclePolicy:
    """Back-offs and attempt timeouts of every lifecycle step."""
    return LifecyclePolicy(
        provision_backoff=Backoff(
            settings.provision_backoff_initial,
            settings.provision_backoff_maximum,
            settings.provision_backoff_multiplier,
        ),
        agent_start_backoff=Backoff(
            settings.agent_start_backoff_initial,
            settings.agent_start_backoff_maximum,
            settings.agent_start_backoff_multiplier,
        ),
        recovery_backoff=Backoff(
            settings.recovery_backoff_initial, settings.recovery_backoff_maximum, settings.recovery_backoff_multiplier
        ),
        # An attempt may take every retry of its provider calls, SSH connect and run included.
        provision_timeout=3 * settings.provider_timeout + 30,
        agent_start_timeout=settings.provider_timeout + settings.ssh_connect_timeout + settings.ssh_exec_timeout + 30,
        recovery_timeout=settings.reboot_timeout + 30,
        boot_deadline=settings.boot_deadline,
        recovery_budget=settings.recovery_budget,
        recovery_budget_window=settings.recovery_budget_window,
        provisioning_deadline=settings.provisioning_deadline,
        agent_start_deadline=settings.agent_start_deadline,
    )


def machine_input(settings: Settings, provider: str, provider_id: str, machine_id: str) -> MachineInput:
    """The first run's input of a machine's workflow."""
    return MachineInput(
        provider=provider,
        provider_id=provider_id,
        machine_id=machine_id,
        policy=lifecycle_policy(settings),
        # Started with initial_search_attributes, which show its first stage.
        search_attributes_carried=True,
    )


def fleet_input(settings: Settings, provider: str) -> FleetInput:
    """The input the fleet schedule of that provider instance starts every pass with."""
    return FleetInput(
        provider=provider,
        max_machines=settings.max_machines,
        chunk_size=settings.chunk_size,
        device_creation_interval=settings.device_creation_interval,
        first_heartbeat_within=settings.first_heartbeat_timeout,
        heartbeat_within=settings.heartbeat_timeout,
        recovery_hold=recovery_hold_rule(settings),
    )


def watchdog_input(settings: Settings, provider: str, as_of: str) -> WatchdogInput:
    """A worker's look for the provider instance's silent machines as of that time, by the rule a pass uses."""
    return WatchdogInput(
        provider=provider,
        as_of=as_of,
        first_heartbeat_within=settings.first_heartbeat_timeout,
        heartbeat_within=settings.heartbeat_timeout,
        hold_rule=recovery_hold_rule(settings),
    )


def recovery_hold_rule(settings: Settings) -> RecoveryHoldRule:
    """When the watchdog holds a provider's recoveries rather than signalling its silent machines."""
    return RecoveryHoldRule(
        min_machines=settings.recovery_hold_min_machines,
        fraction=settings.recovery_hold_fraction,
        # Healthy agents call every interval: three without any heartbeat at all is the path, not the machines.
        quiet_path_after=min(settings.heartbeat_timeout, 3 * settings.heartbeat_interval),
        # Every live agent is back within its longest retry wait and an interval after the path is.
        grace_after_hold=max(settings.heartbeat_timeout, AGENT_MAX_RETRY_INTERVAL + settings.heartbeat_interval),
    )
