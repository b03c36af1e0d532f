"""What makes a heartbeat authentic, checked so that a refusal takes as long whatever its reason.

Every request is signed with the ed25519 key the agent reported at takeover. The signatures are checked on threads
of their own, those that arrive meanwhile together (SignatureChecks). A machine without an agent key is checked
against a dummy key, and the BMDB read it skips is waited for as long as one takes (StandIn): an unknown machine,
a wrong key and a bad signature cannot be told apart by the answer or by its time. AgentKeys finds the key a
request is checked against, from a cache of the running agents' keys or else from BMDB.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from bmdb.store import BMDB
from foundation.precise_sleep import precise_sleep
from processes.heartbeat_admission import REQUEST_ADDRESS, KeyReads
from proto import agent_api_pb2
from proto.signing import signing_payload

# Threads checking signatures: a check lets go of the GIL, so on a host with two cores or more two of them check
# a large batch in half the time, and the heartbeats waiting on it are answered sooner.
SIGNATURE_THREADS = 2

# A batch is split over the threads only from this many checks a thread: below it a second hop costs more than it
# saves.
SPLIT_ABOVE = 8

# How much each new duration moves a StandIn's averages.
STAND_IN_WEIGHT = 1 / 32

# Agent keys kept in memory, least recently used dropped first: 100,000 keys are about 20 MB.
KEY_CACHE_SIZE = 100_000

# Machine ids BMDB has no agent for, remembered a while: a flood of them costs no BMDB reads.
UNKNOWN_CACHE_SIZE = 100_000

# How long an id BMDB had no agent key for is answered without asking again: a flood of one id costs a read a
# second. No longer, because a new agent's first heartbeat can come before its takeover has recorded its key, and
# its next try, a few seconds on, must find it.
UNKNOWN_FOR_SECONDS = 1.0

# Verified when a machine has no agent key, so an unknown id costs what a wrong key does.
DUMMY_KEY = Ed25519PrivateKey.from_private_bytes(bytes(32)).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


class StandIn:
    """Waits as long as an operation takes on average, for answers that skip it but must not be told apart.

    Both averages move: the operation's duration, and how much longer than asked
    a wait lasts (waking takes its time too), so the waits last what the
    operation does. The waits are precise below the millisecond, where
    asyncio's own timers are not: waits that were often too short and sometimes
    a millisecond too long would match on average and still be told apart.
    """

    def __init__(self, sleep: Callable[[float], Awaitable[None]] = precise_sleep) -> None:
        self._sleep = sleep
        self.seconds = 0.0
        self._overshoot = 0.0
        self._timed = 0

    def add(self, seconds: float) -> None:
        """Count one run of the operation and how long it took."""
        self._timed += 1
        # The first runs weigh more, so the average starts at a real duration rather than at zero.
        self.seconds += (seconds - self.seconds) * max(STAND_IN_WEIGHT, 1 / self._timed)

    async def wait(self) -> None:
        """Wait as long as the operation takes on average, allowing for how much waits overshoot."""
        asked = max(0.0, self.seconds - self._overshoot)
        started = time.perf_counter()
        await self._sleep(asked)
        self._overshoot += (time.perf_counter() - started - asked - self._overshoot) * STAND_IN_WEIGHT


class SignatureChecks:
    """Checks signatures in threads of their own, those that arrive meanwhile together in one hop.

    An ed25519 check lets go of the GIL, so the checks run beside the event
    loop, on other cores where there are any, while gRPC and BMDB go on.
    """

    def __init__(self, threads: int = SIGNATURE_THREADS) -> None:
        # A thread each, so that a small batch always goes to the first: with one pool of several threads the
        # hops of the unary call's small batches wandered between them and it took 15% fewer heartbeats a second.
        self._executors = [
            ThreadPoolExecutor(1, thread_name_prefix=f"signature-checks-{number}") for number in range(threads)
        ]
        self._waiting: list[tuple[bytes, agent_api_pb2.HeartbeatRequest, asyncio.Future[bool]]] = []
        self._checking: asyncio.Task[None] | None = None

    async def signed_by(self, key: bytes, request: agent_api_pb2.HeartbeatRequest) -> bool:
        """Whether request carries a valid signature by the ed25519 public key, checked with others waiting."""
        outcome: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiting.append((key, request, outcome))
        if self._checking is None:
            self._checking = asyncio.create_task(self._check_while_waiting())
        return await outcome

    def close(self) -> None:
        """Shut the checking threads down, dropping the checks not yet begun."""
        for executor in self._executors:
            executor.shutdown(wait=False, cancel_futures=True)

    async def _check_while_waiting(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._waiting:
                batch, self._waiting = self._waiting, []
                try:
                    verdicts = await self._check_on_threads(loop, batch)
                except asyncio.CancelledError:
                    for _, _, outcome in batch:
                        outcome.cancel()
                    raise
                except Exception as error:  # a fault of ours: its callers hear it rather than wait forever
                    for _, _, outcome in batch:
                        if not outcome.done():
                            outcome.set_exception(error)
                    raise
                for (_, _, outcome), verdict in zip(batch, verdicts, strict=True):
                    if not outcome.done():
                        outcome.set_result(verdict)
        finally:
            self._checking = None

    async def _check_on_threads(
        self,
        loop: asyncio.AbstractEventLoop,
        batch: list[tuple[bytes, agent_api_pb2.HeartbeatRequest, asyncio.Future[bool]]],
    ) -> list[bool]:
        # A small batch in one hop; a large one split over the threads, which check side by side.
        parts = min(len(self._executors), max(1, len(batch) // SPLIT_ABOVE))
        if parts == 1:
            return await loop.run_in_executor(self._executors[0], _check_all, batch)
        size = -(-len(batch) // parts)
        chunks = [batch[start : start + size] for start in range(0, len(batch), size)]
        verdicts = await asyncio.gather(
            *(
                loop.run_in_executor(executor, _check_all, chunk)
                for executor, chunk in zip(self._executors[: len(chunks)], chunks, strict=True)
            )
        )
        return [verdict for chunk in verdicts for verdict in chunk]


def _check_all(batch: list[tuple[bytes, agent_api_pb2.HeartbeatRequest, asyncio.Future[bool]]]) -> list[bool]:
    return [_signed_by(key, request) for key, request, _ in batch]


def _signed_by(key: bytes, request: agent_api_pb2.HeartbeatRequest) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(key).verify(
            request.signature, signing_payload(request.machine_id, request.sent_at_unix_ms, request.nonce)
        )
    except (InvalidSignature, ValueError):
        return False
    return True


class AgentKeys:
    """The agent key that signed a heartbeat, from a cache or else from BMDB, found in the same time whether or not
    there is one.

    A cached key saves the heartbeat a BMDB statement. It never lets a heartbeat in on its own: the recording
    statement checks the key against BMDB again, and a miss re-reads it.
    """

    def __init__(
        self,
        bmdb: BMDB,
        *,
        unknown_for: float = UNKNOWN_FOR_SECONDS,
        cache_size: int = KEY_CACHE_SIZE,
        sleep: Callable[[float], Awaitable[None]] = precise_sleep,
        reads: KeyReads | None = None,
    ) -> None:
        self.bmdb = bmdb
        # The BMDB reads requests may cause; past them a request is answered as one for an unknown machine.
        self.reads = reads or KeyReads(0, 0)
        self.reads_refused = 0
        self.signatures = SignatureChecks()
        self.key_read_time = StandIn(sleep)
        self._keys: OrderedDict[uuid.UUID, bytes] = OrderedDict()
        self._cache_size = cache_size
        # Machine id -> until when BMDB is not asked again for it (it had no agent key).
        self._unknown: OrderedDict[uuid.UUID, float] = OrderedDict()
        self._unknown_for = unknown_for

    async def load(self) -> int:
        """Cache the running agents' keys, as many as the cache holds; how many were loaded."""
        keys = await self.bmdb.agent_public_keys(self._cache_size)
        self._keys.update(keys)
        return len(keys)

    def close(self) -> None:
        """Stop the signature threads."""
        self.signatures.close()

    def forget(self, machine_id: uuid.UUID) -> None:
        """Drop a machine's cached key: its agent was replaced or forgotten since."""
        self._keys.pop(machine_id, None)

    async def signing_key(self, machine_id: uuid.UUID, request: agent_api_pb2.HeartbeatRequest) -> bytes | None:
        """The machine's agent key that signed this request; None when there is none, or it did not sign it.

        Every refusal costs one signature check and one BMDB read, or the time of one: an unknown id and a wrong
        key cannot be told apart by how long the answer takes.
        """
        cached = self._keys.get(machine_id)
        if cached is not None and await self.signatures.signed_by(cached, request):
            self._keys.move_to_end(machine_id)
            return cached
        now = time.monotonic()
        if self._unknown.get(machine_id, 0.0) > now:
            # Waiting costs neither BMDB nor CPU, and a prober cannot renew the entry: it lapses.
            await self.key_read_time.wait()
            key = None
        elif not self.reads.allow(REQUEST_ADDRESS.get()):
            # Past the reads its address (or everyone) may cause: refused as an unknown machine, in the same time.
            # A real agent refused so retries, and its next heartbeat finds a budget again.
            self.reads_refused += 1
            await self.key_read_time.wait()
            key = None
        else:
            started = time.perf_counter()
            key = await self.bmdb.agent_public_key(machine_id)
            self.key_read_time.add(time.perf_counter() - started)
            self._remember_unknown(machine_id, None if key is not None else now + self._unknown_for)
        if key is None:
            # Checked against a dummy key, for the time of a real check; the answer is no whatever it says.
            await self.signatures.signed_by(DUMMY_KEY, request)
            return None
        # The key BMDB holds is the cached one that did not verify: no second check needed to say no.
        if key == cached or not await self.signatures.signed_by(key, request):
            return None
        self._keys[machine_id] = key
        self._keys.move_to_end(machine_id)
        if len(self._keys) > self._cache_size:
            self._keys.popitem(last=False)
        return key

    def _remember_unknown(self, machine_id: uuid.UUID, until: float | None) -> None:
        """Keep BMDB from being asked about a machine without an agent key until `until`; None forgets it."""
        self._unknown.pop(machine_id, None)
        if until is None:
            return
        self._unknown[machine_id] = until
        if len(self._unknown) > UNKNOWN_CACHE_SIZE:
            self._unknown.popitem(last=False)
