"""`KVEventPublisher`: tells the schedulers which blocks this worker's (or kv-store's) cache holds.

Every `interval_s` it drains the cache's `KVEventLog` into one `KVEvents`
message (several when long) on the shared KV-events subject. It starts with a
snapshot, and sends one again when its log overflowed or a scheduler asks
(one that started late, or saw a gap in `seq`). Events travel on core NATS and
may be lost: the schedulers' index is a hint, never needed for correctness.
"""

import asyncio
from collections.abc import Awaitable, Callable

from contracts import KVEvents, KVSnapshotRequest, Subjects, sent_by
from shared.bus.subscribe import subscribe_typed
from shared.engine import KVEventLog, PrefixCacheEvents
from shared.telemetry.logging import get_logger

log = get_logger(__name__)

MAX_HASHES_PER_MESSAGE = 16384  # 16-byte hashes: well under NATS's default 1 MiB payload


class KVEventPublisher:
    def __init__(self, *, nc, subjects: Subjects, instance_id: str, role: str, boot_id: str, events: KVEventLog,
                 held_hashes: Callable[[], Awaitable[list[bytes]]], interval_s: float = 0.1):
        """`held_hashes()` returns every block the cache holds and restarts `events`, atomically with
        respect to whoever records into it."""
        self.nc = nc
        self.subjects = subjects
        self.instance_id = instance_id
        self.role = role
        self.boot_id = boot_id
        self.events = events
        self.held_hashes = held_hashes
        self.interval_s = interval_s
        self._seq = 0
        self._snapshot_wanted = asyncio.Event()
        self._snapshot_wanted.set()  # the first message is a snapshot
        self.counts = {"messages": 0, "stored": 0, "removed": 0, "snapshots": 0}

    async def start(self) -> list[asyncio.Task]:
        await subscribe_typed(self.nc, self.subjects.kv_snapshot(self.instance_id), KVSnapshotRequest,
                              self._on_snapshot_request)
        return [asyncio.create_task(self._run(), name="kv-events")]

    async def _on_snapshot_request(self, request: KVSnapshotRequest, msg) -> None:
        self._snapshot_wanted.set()

    async def _run(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self.interval_s):
                    await self._snapshot_wanted.wait()
            except TimeoutError:
                pass
            try:
                await self.publish_pending()
            except Exception as exc:  # the connection is reconnecting: what was lost goes again in a snapshot
                log.warning("could not publish KV events", error=repr(exc))
                self._snapshot_wanted.set()
                await asyncio.sleep(1.0)

    async def publish_pending(self) -> None:
        if self._snapshot_wanted.is_set():
            self._snapshot_wanted.clear()
            await self._publish(await self.held_hashes(), [], snapshot=True)
            return
        batch = self.events.drain()
        if batch.lost:
            self._snapshot_wanted.set()
            return
        if batch.stored or batch.removed:
            await self._publish(batch.stored, batch.removed, snapshot=False)

    async def _publish(self, stored: list[bytes], removed: list[bytes], snapshot: bool) -> None:
        self.counts["stored"] += len(stored)
        self.counts["removed"] += len(removed)
        self.counts["snapshots"] += snapshot
        first = True
        while first or stored or removed:
            room = MAX_HASHES_PER_MESSAGE
            chunk_removed, removed = removed[:room], removed[room:]
            room -= len(chunk_removed)
            chunk_stored, stored = stored[:room], stored[room:]
            message = KVEvents(instance_id=self.instance_id, role=self.role, boot_id=self.boot_id, seq=self._seq,
                               snapshot=snapshot and first, stored=chunk_stored, removed=chunk_removed)
            self._seq += 1
            first = False
            self.counts["messages"] += 1
            await self.nc.publish(sent_by(self.subjects.kv_events, self.role, self.instance_id), message.encode())


def engine_kv_events(*, nc, subjects: Subjects, identity, engine, engine_loop) -> KVEventPublisher:
    """A publisher of the engine's prefix-cache events (recorded from now on)."""
    events = KVEventLog()
    engine.connect(PrefixCacheEvents(events))
    return KVEventPublisher(nc=nc, subjects=subjects, instance_id=identity.instance_id, role=identity.role,
                            boot_id=identity.boot_id, events=events,
                            held_hashes=lambda: engine_loop.call(lambda e: e.block_manager.held_hashes()))


def kv_hashing(engine) -> dict:
    """What a scheduler needs to hash prompts into this engine's block hashes (its registry entry's fields)."""
    return {"kv_block_size": engine.config.block_size, "kv_fingerprint": engine.fingerprint}

