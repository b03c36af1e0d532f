"""What the activities share: settings, BMDB, providers, the Temporal client, the SSH key.

Built once per worker process; secrets (the SSH private key, the agent
executable) live here and never in a payload.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import asyncssh
from temporalio.client import Client
from temporalio.common import MetricMeter
from temporalio.exceptions import ApplicationError

from bmdb.store import BMDB
from foundation.metrics import WorkerMetrics
from foundation.settings import Settings
from providers import Provider, ProviderError


@dataclass
class ActivityDeps:
    settings: Settings
    bmdb: BMDB
    providers: dict[str, Provider]
    client: Client
    ssh_key: asyncssh.SSHKey
    ssh_public_key: str
    agent_executable: bytes = b""
    ca_certificate: bytes = b""
    metrics: WorkerMetrics = field(default_factory=lambda: WorkerMetrics.on(MetricMeter.noop))

    def provider(self, name: str) -> Provider:
        try:
            return self.providers[name]
        except KeyError:
            raise ApplicationError(
                f"this worker has no provider {name!r} (it has: {', '.join(sorted(self.providers))})",
                type="UnknownProvider",
                non_retryable=True,
            ) from None

    async def close(self) -> None:
        for provider in self.providers.values():
            await provider.close()
        await self.bmdb.close()


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
