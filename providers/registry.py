"""Provider types are plugins: entry points of the group ``shepherd.providers``, Shepherd's own among them.

An entry point names a factory ``(instance, settings) -> Provider``; it checks
the instance's options and raises SettingsError naming the one that is wrong.
A third party ships a provider as a package that declares such an entry point.
A factory marks the options that hold secrets with ``@secret_options(...)``:
``shepherd config`` and ``shepherd doctor`` show them as ***, and its errors lose them.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import TypeVar

from foundation.provider_instances import ProviderInstance
from foundation.redaction import redact_text, secret_name
from foundation.setting_values import ENV_PREFIX, SettingsError, is_finite_number, parse_duration
from foundation.settings import Settings
from providers import Provider

ENTRY_POINT_GROUP = "shepherd.providers"

ProviderFactory = Callable[[ProviderInstance, Settings], Provider]
Factory = TypeVar("Factory", bound=Callable[..., object])

# Where @secret_options keeps the names on the factory.
_SECRET_OPTIONS = "shepherd_secret_options"


def secret_options(*names: str) -> Callable[[Factory], Factory]:
    """Mark options of a provider type as secret, on its factory: never shown, never in an error or a log line.

    Options named as secrets (ending in password, token, secret, api_key, ...) are hidden whether marked or not.
    """

    def mark(factory: Factory) -> Factory:
        setattr(factory, _SECRET_OPTIONS, frozenset(names))
        return factory

    return mark


def declared_secret_options(
    instance: ProviderInstance, types: dict[str, EntryPoint] | None = None
) -> frozenset[str] | None:
    """The options of the instance that its type marks secret; None when the type cannot be loaded to say."""
    types = provider_types() if types is None else types
    point = types.get(instance.type)
    if point is None:
        return None
    try:
        factory = point.load()
    except ImportError:
        return None
    return frozenset(getattr(factory, _SECRET_OPTIONS, frozenset()))


def provider_types() -> dict[str, EntryPoint]:
    """Every installed provider type by name, not loaded: a type is imported only when an instance uses it."""
    return {point.name: point for point in entry_points(group=ENTRY_POINT_GROUP)}


def open_providers(settings: Settings) -> dict[str, Provider]:
    """A client of every configured provider instance, by instance name."""
    types = provider_types()
    return {instance.name: open_provider(instance, settings, types) for instance in settings.provider_instances}


def open_provider(
    instance: ProviderInstance, settings: Settings, types: dict[str, EntryPoint] | None = None
) -> Provider:
    """A client of one provider instance; SettingsError when no installed type provides it, it cannot be loaded (a
    missing extra), or an option is wrong."""
    types = provider_types() if types is None else types
    point = types.get(instance.type)
    if point is None:
        raise SettingsError(
            "providers",
            f"instance {instance.name!r} has type {instance.type!r}, which no installed package provides "
            f"(installed: {', '.join(sorted(types)) or 'none'}; entry point group {ENTRY_POINT_GROUP})",
        )
    try:
        factory: ProviderFactory = point.load()
    except ImportError as error:
        # One broken plugin must not stop the instances of the others: only its own instances fail, by name.
        raise SettingsError(
            "providers",
            f"instance {instance.name!r}: provider type {instance.type!r} ({point.value}) cannot be loaded: {error}",
        ) from None
    try:
        return factory(instance, settings)
    except SettingsError as error:
        # A factory may quote an option it refuses; the worker's start, doctor and the logs show this message.
        marked: frozenset[str] = getattr(factory, _SECRET_OPTIONS, frozenset())
        secrets = [value for name, value in instance.options.items() if name in marked or secret_name(name)]
        prefix = f"setting {error.setting} ({ENV_PREFIX}{error.setting.upper()}): "
        problem = redact_text(str(error).removeprefix(prefix), secrets)
        raise SettingsError(error.setting, problem) from None


def unknown_options(instance: ProviderInstance, known: tuple[str, ...]) -> None:
    """Refuse options the type does not take, naming them: a typo must not pass as a default."""
    unknown = sorted(set(instance.options) - set(known))
    if unknown:
        raise SettingsError(
            "providers",
            f"instance {instance.name!r} (type {instance.type}) has no option {', '.join(unknown)}; "
            f"it takes: {', '.join(known) or 'none'}",
        )


def duration_option(instance: ProviderInstance, option: str, default: float) -> float:
    """A positive time option in seconds, given as a number or a duration such as "2m"; default when absent."""
    value = instance.options.get(option, default)
    if isinstance(value, str):
        try:
            value = parse_duration(value)
        except ValueError as error:
            raise SettingsError("providers", f"instance {instance.name!r}: {option}: {error}") from None
    if not is_finite_number(value) or value <= 0:
        raise SettingsError(
            "providers",
            f"instance {instance.name!r}: {option} must be positive, finite seconds or a duration, got {value!r}",
        )
    return float(value)
