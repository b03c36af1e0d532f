"""What the activities share: settings, BMDB, providers, the Temporal client, the SSH key, and what a takeover
hands out: the agent executable and the agents' CA bundle.

Built once per worker process; secrets (the SSH private key, the agent
executable) live here and never in a payload.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import asyncssh
from temporalio import activity
from temporalio.client import Client
from temporalio.common import MetricMeter
from temporalio.exceptions import ApplicationError

from bmdb.migrate import open_bmdb
from bmdb.store import BMDB
from foundation.executables import AgentExecutable, ExecutableTarget, agent_executable_file
from foundation.files import ReloadedFile
from foundation.metrics import WorkerMetrics
from foundation.setting_values import SettingsError
from foundation.settings import Settings
from foundation.ssh_identity import load_or_create_ssh_key, public_key_openssh
from foundation.tls import agent_ca_bundle_file
from lifecycle.takeover_failures import TakeoverTarget
from providers import Provider, ProviderError, ProviderMachine
from providers.registry import open_providers

log = logging.getLogger(__name__)


@dataclass
class ActivityDeps:
    """Everything the activities of one worker process share; built once by open_activity_deps."""

    settings: Settings
    bmdb: BMDB
    providers: dict[str, Provider]
    client: Client
    ssh_key: asyncssh.SSHKey
    ssh_public_key: str
    # The agent executables (one per kind of machine) and the CA bundle (DER each) takeovers hand out, read again
    # when their files change, so an agent upgrade or a CA rotation needs no restart of the workers.
    agent_executable_files: tuple[ReloadedFile[AgentExecutable], ...] = ()
    agent_ca_bundle_file: ReloadedFile[tuple[bytes, ...]] | None = None
    metrics: WorkerMetrics = field(default_factory=lambda: WorkerMetrics.on(MetricMeter.noop))

    def takeover_files(self) -> tuple[tuple[AgentExecutable, ...], tuple[bytes, ...]]:
        """The agent executables and the CA bundle a takeover hands out now: as their files are, or as they were
        when last good (a bad replacement is logged once and left unused)."""
        agents = tuple(file.current() for file in self.agent_executable_files)
        bundle = self.agent_ca_bundle_file.current() if self.agent_ca_bundle_file is not None else ()
        return agents, bundle

    def provider(self, name: str) -> Provider:
        """The provider instance of that name; a non-retryable UnknownProvider error when this worker has none."""
        try:
            return self.providers[name]
        except KeyError:
            raise ApplicationError(
                f"this worker has no provider {name!r} (it has: {', '.join(sorted(self.providers))})",
                type="UnknownProvider",
                non_retryable=True,
            ) from None

    def target(self, machine_id: str, machine: ProviderMachine, pinned_host_key: str | None) -> TakeoverTarget:
        """Where SSH reaches the machine the provider lists (it has an address), as whom, and the host key it must
        show (none before first contact)."""
        assert machine.address is not None
        return TakeoverTarget(
            machine_id=machine_id,
            address=machine.address,
            port=machine.ssh_port,
            username=machine.ssh_user or self.settings.ssh_user,
            pinned_host_key=pinned_host_key,
        )

    async def close(self) -> None:
        """Close every provider, then BMDB."""
        for provider in self.providers.values():
            await provider.close()
        await self.bmdb.close()


async def open_activity_deps(settings: Settings, client: Client, database_url: str) -> ActivityDeps:
    """Read the agent, the SSH key and the CA certificates, open BMDB and the provider; close() gives them back.

    An agent executable or a CA bundle that cannot be handed out is a SettingsError naming its setting."""
    settings.check_agent()
    ssh_key = load_or_create_ssh_key(settings.effective_ssh_key_path)
    ca_path = settings.agent_endpoint_ca_certificate_path
    agent_ca_bundle = agent_ca_bundle_file(ca_path) if ca_path is not None else None
    agent_executables = agent_executable_files(settings)
    bmdb = await open_bmdb(database_url)
    providers = open_providers(settings)
    return ActivityDeps(
        settings=settings,
        bmdb=bmdb,
        providers=providers,
        client=client,
        ssh_key=ssh_key,
        ssh_public_key=public_key_openssh(ssh_key),
        agent_executable_files=agent_executables,
        agent_ca_bundle_file=agent_ca_bundle,
    )


def agent_executable_files(settings: Settings) -> tuple[ReloadedFile[AgentExecutable], ...]:
    """The agent executables of agent_executable_path, each logged (its SHA-256 and the machines it runs on);
    SettingsError naming the setting for one that cannot be handed out, or two for the same kind of machine."""
    files = tuple(agent_executable_file(path) for path in settings.agent_executable_paths)
    seen: dict[ExecutableTarget, Path] = {}
    for file in files:
        agent = file.current()
        if agent.target in seen:
            raise SettingsError(
                "agent_executable_path",
                f"{seen[agent.target]} and {file.path} are both for {agent.target.describe()}: give one per "
                "kind of machine",
            )
        seen[agent.target] = file.path
        log.info("agent executable %s: %s", file.path, agent.describe())
    return files


@asynccontextmanager
async def provider_errors() -> AsyncIterator[None]:
    """Turn provider errors that retrying cannot fix into non-retryable activity errors.

    Retryable ones (timeouts, 5xx) propagate as they are, so the activity's
    retry policy tries again.
    """
    try:
        yield
    except ProviderError as error:
        if error.retryable:
            raise
        raise ApplicationError(str(error), type=type(error).__name__, non_retryable=True) from error


@asynccontextmanager
async def heartbeating(every: float) -> AsyncIterator[None]:
    """Heartbeat the running activity every `every` seconds while the block runs, the first `every` seconds in.

    The server times an attempt's heartbeat timeout from its start, so an attempt whose task never reached its
    worker, or whose worker died, is retried after the heartbeat timeout rather than after the whole start-to-close,
    heartbeat or none. Not at once: an attempt over within `every` seconds (most takeovers) records no heartbeat,
    each a write of the Temporal server and a billed action. Temporal sends the first at once and the rest at most
    once per most of the heartbeat timeout.
    """

    async def beat() -> None:
        while True:
            await asyncio.sleep(every)
            activity.heartbeat()

    beating = asyncio.create_task(beat())
    try:
        yield
    finally:
        beating.cancel()
