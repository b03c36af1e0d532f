"""The cap on the heartbeat port's connections from one address: gRPC's core caps a server's connections in all
(build_server) but not by address, and Python sees a connection only through its calls.

A ConnectionGuard looks now and then at the kernel's table of TCP connections to the port and, for an address
holding more than its cap in this process, shuts the extra connections down under gRPC's feet: gRPC then finds its
peer gone and frees the connection as it would any other. A connection with no heartbeat stream goes first, so an
agent keeps the stream it opened as it connected while a flood's silent connections go.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
import sys
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from temporalio.common import MetricMeter

from processes.heartbeat_admission import address_of

log = logging.getLogger("shepherd.heartbeat")

# How often the guard looks. A connection costs ~55 KiB: 5 s of a flood at the accept rate is memory the host has.
CHECK_EVERY = 5.0

# One line an address at most this often, with how many were closed meanwhile.
LOG_EVERY = 60.0

# Addresses whose last line is remembered, the least recently logged forgotten first.
LOGGED_ADDRESSES = 1_000

# The kernel's tables of TCP sockets and their counts, of this process's network namespace.
TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
SOCKSTATS = (Path("/proc/net/sockstat"), Path("/proc/net/sockstat6"))

# The table's state of an open connection (include/net/tcp_states.h).
ESTABLISHED = "01"

TOO_MANY_LOG = (
    "closed %d heartbeat connections from %s: it held more than %d at once in this process "
    "(setting heartbeat_max_connections_per_address)"
)


@dataclass(frozen=True)
class Connection:
    """An open TCP connection to the port: the socket's inode and the peer's address and port."""

    inode: int
    host: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int

    @property
    def peer(self) -> str:
        """The peer as gRPC's context.peer() names it."""
        if isinstance(self.host, ipaddress.IPv6Address):
            return f"ipv6:[{self.host}]:{self.port}"
        return f"ipv4:{self.host}:{self.port}"


def parse_tcp_table(text: str, local_port: int) -> list[Connection]:
    """The open connections to local_port in the text of /proc/net/tcp or /proc/net/tcp6 (whose addresses are
    32-bit words in this host's byte order); an IPv4 peer on a dual-stack socket as its IPv4 address."""
    suffix = f":{local_port:04X}"
    connections = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or not fields[1].endswith(suffix) or fields[3] != ESTABLISHED:
            continue
        inode = int(fields[9])
        if inode == 0:
            continue  # not yet accepted: no process holds it
        remote, _, port = fields[2].partition(":")
        connections.append(Connection(inode, _address_of_hex(remote), int(port, 16)))
    return connections


def _address_of_hex(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    words = bytes.fromhex(text)
    if sys.byteorder == "little":
        words = b"".join(words[i : i + 4][::-1] for i in range(0, len(words), 4))
    if len(words) == 4:
        return ipaddress.IPv4Address(words)
    address = ipaddress.IPv6Address(words)
    return address.ipv4_mapped or address


def _open_sockets(text: str) -> int:
    """The TCP sockets in use by the counts of /proc/net/sockstat or sockstat6, 0 when it names none."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] in ("TCP:", "TCP6:") and "inuse" in fields:
            return int(fields[fields.index("inuse") + 1])
    return 0


class ConnectionGuard:
    """Shuts down the connections to port that one address (address_of, an IPv6 /64 by default) holds past
    per_address in this process. holding_streams names the peers (context.peer()) with a heartbeat stream open,
    most_streams_from_one_address says the most streams one address holds open."""

    def __init__(
        self,
        port: int,
        per_address: int,
        *,
        ipv6_prefix: int = 64,
        holding_streams: Callable[[], Collection[str]] = frozenset,
        most_streams_from_one_address: Callable[[], int] = lambda: 0,
        meter: MetricMeter = MetricMeter.noop,
        every: float = CHECK_EVERY,
        tables: Iterable[Path] = TABLES,
        sockstats: Iterable[Path] = SOCKSTATS,
        descriptors: Path = Path("/proc/self/fd"),
    ) -> None:
        self.port, self.per_address, self.ipv6_prefix, self.every = port, per_address, ipv6_prefix, every
        self.holding_streams = holding_streams
        self.most_streams_from_one_address = most_streams_from_one_address
        self.tables, self.sockstats, self.descriptors = tuple(tables), tuple(sockstats), descriptors
        self.closed = meter.create_counter(
            "shepherd_heartbeat_connections_closed_total",
            "Heartbeat connections the server shut down, by reason (too_many_from_address)",
        ).with_additional_attributes({"reason": "too_many_from_address"})
        # Address -> (when last logged, closed since and not logged).
        self._logged: OrderedDict[str, tuple[float, int]] = OrderedDict()

    async def run(self, stop: asyncio.Event) -> None:
        """Look every `every` seconds until stop is set; a failed look is logged and the next one made."""
        while not stop.is_set():
            try:
                await self.check()
            except (OSError, ValueError) as error:  # a table unreadable, or in a shape not known here
                log.warning("could not look at the heartbeat port's connections: %s", error)
            try:
                await asyncio.wait_for(stop.wait(), self.every)
            except TimeoutError:
                pass

    async def check(self) -> dict[str, int]:
        """One look: the connections closed, by address. The files are read on a thread, as a fleet's table is
        megabytes."""
        # Taken on the event loop, where the service changes them.
        streaming = set(self.holding_streams())
        most = self.most_streams_from_one_address()
        over = await asyncio.to_thread(self.over_cap, len(streaming), most)
        if not over:
            return {}
        closed = await asyncio.to_thread(self.close_extras, over, streaming)
        for address, count in closed.items():
            self.closed.add(count)
            self._log(address, count)
        return closed

    def over_cap(self, streaming: int = 0, most_streams: int = 0) -> dict[str, list[Connection]]:
        """The connections to the port, by address, of the addresses holding more than the cap in this network
        namespace (so perhaps in this process).

        The counts of sockets are read first, and the tables only when they leave room for an address over the cap:
        an address holds at most its streams' connections (most_streams at most) and every connection without a
        stream (the sockets in use less the streaming connections of this process). So a healthy fleet, an agent a
        stream, costs one small read a look however large it is.
        """
        if self.per_address <= 0:
            return {}
        counted = [_open_sockets(path.read_text()) for path in self.sockstats if path.exists()]
        if counted and most_streams + max(0, sum(counted) - streaming) <= self.per_address:
            return {}
        by_address: dict[str, list[Connection]] = {}
        for path in self.tables:
            if path.exists():
                for connection in parse_tcp_table(path.read_text(), self.port):
                    by_address.setdefault(self.address_of(connection), []).append(connection)
        return {address: each for address, each in by_address.items() if len(each) > self.per_address}

    def address_of(self, connection: Connection) -> str:
        """What the connection counts as in the per-address limits, as the service counts its peer."""
        return address_of(connection.peer, self.ipv6_prefix)

    def close_extras(self, over: dict[str, list[Connection]], streaming: Collection[str]) -> dict[str, int]:
        """Shut down what each address holds in this process past the cap: those without a stream first, then
        the highest socket inode first (roughly the newest: the kernel hands inodes out in batches a CPU, so their
        order is not quite the order the connections came in). The connections closed, by address."""
        ours = self._descriptors_by_inode()
        closed: Counter[str] = Counter()
        for address, connections in over.items():
            held = [each for each in connections if each.inode in ours]
            held.sort(key=lambda each: (each.peer in streaming, -each.inode))
            for connection in held[: max(0, len(held) - self.per_address)]:
                if _shut_down(ours[connection.inode], connection.inode):
                    closed[address] += 1
        return dict(closed)

    def _descriptors_by_inode(self) -> dict[int, int]:
        """Socket inode -> a descriptor of this process on it."""
        found = {}
        for name in os.listdir(self.descriptors):
            try:
                target = os.readlink(self.descriptors / name)
            except OSError:
                continue  # closed meanwhile
            if target.startswith("socket:["):
                found[int(target[8:-1])] = int(name)
        return found

    def _log(self, address: str, count: int) -> None:
        now = time.monotonic()
        last, unlogged = self._logged.pop(address, (float("-inf"), 0))
        if now - last < LOG_EVERY:
            self._logged[address] = (last, unlogged + count)
        else:
            self._logged[address] = (now, 0)
            log.warning(TOO_MANY_LOG, count + unlogged, address, self.per_address)
        if len(self._logged) > LOGGED_ADDRESSES:
            self._logged.popitem(last=False)


def _shut_down(descriptor: int, inode: int) -> bool:
    """Shut down the connection on descriptor, through a copy of it: gRPC's own descriptor stays gRPC's to close.
    False when the descriptor was closed, or taken by another socket, since it was listed."""
    try:
        copy = os.dup(descriptor)
    except OSError:
        return False
    try:
        if os.fstat(copy).st_ino != inode:
            return False
        with socket.socket(fileno=copy) as connection:
            copy = -1  # closed with the socket object
            connection.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        if copy >= 0:
            os.close(copy)
