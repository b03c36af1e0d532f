"""The provider a deployment's settings name."""

from __future__ import annotations

from foundation.settings import Settings, SettingsError
from providers import Provider
from providers.sim import SimProvider


def provider_from_settings(settings: Settings) -> Provider:
    """The provider client of settings.provider, configured from settings."""
    if settings.provider == "sim":
        return SimProvider(settings.sim_api_url, timeout=settings.provider_timeout)
    raise SettingsError("provider", f"unknown provider {settings.provider!r}")
