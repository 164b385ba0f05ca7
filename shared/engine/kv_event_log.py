"""`KVEventLog`: which blocks a cache stored and removed since the last look, for KV-aware routing.

A block cache (the engine's prefix cache, the kv-store) records each block it
starts or stops holding; a publisher drains the log now and then and tells the
schedulers. Only the latest state of each block is kept (stored then removed
in one interval is just "removed"), and the log is bounded: past its bound it
forgets everything and says so, and the publisher sends a full snapshot
instead. Safe to use from two threads (the engine's records, the event loop
drains).
"""

import threading
from collections import OrderedDict
from dataclasses import dataclass

from shared.engine.kv_connector import KVConnector


@dataclass(slots=True)
class KVEventBatch:
    stored: list[bytes]
    removed: list[bytes]
    lost: bool  # the log overflowed: only a snapshot tells what the cache holds


class KVEventLog:
    def __init__(self, max_pending: int = 1 << 16):
        self.max_pending = max_pending
        self._state: OrderedDict[bytes, bool] = OrderedDict()  # block hash -> held now
        self._lost = False
        self._lock = threading.Lock()

    def stored(self, block_hash: bytes) -> None:
        self._record(block_hash, True)

    def removed(self, block_hash: bytes) -> None:
        self._record(block_hash, False)

    def _record(self, block_hash: bytes, held: bool) -> None:
        with self._lock:
            if self._lost:
                return
            self._state[block_hash] = held
            self._state.move_to_end(block_hash)
            if len(self._state) > self.max_pending:
                self._state.clear()
                self._lost = True

    def drain(self) -> KVEventBatch:
        with self._lock:
            batch = KVEventBatch([h for h, held in self._state.items() if held],
                                 [h for h, held in self._state.items() if not held], self._lost)
            self._state.clear()
            self._lost = False
            return batch

    def restart(self) -> None:
        """Forget what is pending: a snapshot taken at the same moment covers it."""
        with self._lock:
            self._state.clear()
            self._lost = False


class PrefixCacheEvents(KVConnector):
    """Records the engine's prefix-cache changes in a KVEventLog (a listing of the cache covers what is pending)."""

    def __init__(self, events: KVEventLog):
        self.events = events

    def block_stored(self, block_hash: bytes) -> None:
        self.events.stored(block_hash)

    def block_removed(self, block_hash: bytes) -> None:
        self.events.removed(block_hash)

    def cache_listed(self) -> None:
        self.events.restart()
