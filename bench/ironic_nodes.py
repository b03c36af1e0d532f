"""Ironic nodes for the Ironic benchmarks, set up past the code under test, and openstacksdk as a script opens it."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping
from typing import Any

from tests.ironic_fixtures import Ironic

# Nodes taken through Ironic's states at once: its SQLite serialises the rest.
IN_PARALLEL = 4


def provider_options(ironic: Ironic) -> dict[str, Any]:
    """The options of the ironic provider instance the benchmarks run: the bench nodes, found at extra/ssh_address."""
    return {
        "endpoint": ironic.url,
        "resource_class": "bench",
        "image_source": "http://127.0.0.1:9/os.qcow2",
        "address_field": "extra/ssh_address",
        "timeout": 120,
    }


def enroll_available(
    ironic: Ironic, count: int, *, extra_of: Callable[[int], Mapping[str, Any]] | None = None
) -> list[str]:
    """count fake-hardware nodes of resource class bench, taken to available, a few at a time; their UUIDs in the
    order of n. extra_of(n): the extra of node n, where SSH reaches the machine behind it."""

    def enroll(n: int) -> str:
        fields: dict[str, Any] = {"name": f"bench-{n:05d}", "resource_class": "bench"}
        if extra_of is not None:
            fields["extra"] = dict(extra_of(n))
        return ironic.enroll(**fields)

    return in_parallel(enroll, range(count))


def in_parallel(act: Callable[[Any], Any], items: Any) -> list[Any]:
    """act on every item, IN_PARALLEL at once; the results in the items' order."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=IN_PARALLEL) as pool:
        return list(pool.map(act, items))


def script_connection(ironic: Ironic) -> Any:
    """An openstacksdk connection to the Ironic, as an operator's script opens one for a standalone Ironic."""
    import openstack.connection

    return openstack.connection.Connection(
        auth_type="none", auth={"endpoint": ironic.url}, baremetal_endpoint_override=ironic.url
    )
