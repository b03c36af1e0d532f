"""Reaching Temporal at start, and StartupError: why a process or command could not start, in one line.

StartupError names the part, the reason and the setting to look at; the
commands print it as it is. BMDB is opened the same way by bmdb.migrate.open_bmdb.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.client import Client
from temporalio.common import SearchAttributeKey
from temporalio.runtime import Runtime
from temporalio.service import RPCError

from foundation.settings import Settings
from foundation.temporal_connection import TemporalConfigError, load_temporal_connection
from foundation.temporal_payloads import DATA_CONVERTER


class StartupError(Exception):
    """A process cannot start; the message says which part and why."""


async def connect_temporal(
    settings: Settings, runtime: Runtime | None = None, *, environ: Mapping[str, str] | None = None
) -> Client:
    """A Temporal client for the connection in effect (foundation.temporal_connection); environ: the variables
    the Temporal configuration is read from, the process's by default."""
    try:
        connection = load_temporal_connection(settings, environ)
        arguments = connection.connect_arguments()
    except TemporalConfigError as error:
        raise StartupError(str(error)) from None
    try:
        return await Client.connect(**arguments, runtime=runtime or Runtime.default(), data_converter=DATA_CONVERTER)
    except Exception as error:
        raise StartupError(
            f"cannot reach Temporal at {connection.address} ({connection.source('address')}), "
            f"namespace {connection.namespace!r}: {connection.explain(error)}"
        ) from error


async def missing_search_attributes(client: Client, namespace: str, keys: Sequence[SearchAttributeKey]) -> list[str]:
    """The names of keys the namespace has not registered; StartupError when they cannot be listed."""
    try:
        listed = await client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace=namespace))
    except RPCError as error:
        raise StartupError(f"cannot list the search attributes of namespace {namespace!r}: {error}") from error
    return [key.name for key in keys if key.name not in listed.custom_attributes]


def search_attributes_missing(namespace: str, missing: Sequence[str]) -> str:
    """What is wrong with a namespace that lacks these search attributes, with the commands that register them."""
    commands = "; ".join(
        f"temporal operator search-attribute create --namespace {namespace} --name {name} --type Keyword"
        for name in missing
    )
    return f"namespace {namespace!r} lacks the search attributes {', '.join(missing)}; register them once: {commands}"


async def check_search_attributes(client: Client, namespace: str, keys: Sequence[SearchAttributeKey]) -> None:
    """Refuse a namespace without these search attributes, naming the commands that register them."""
    missing = await missing_search_attributes(client, namespace, keys)
    if missing:
        raise StartupError(search_attributes_missing(namespace, missing))
