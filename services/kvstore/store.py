"""`TieredBlockStore`: KV blocks by chained prefix hash, in RAM (bounded, LRU) spilling to disk (bounded, LRU).

A block put in goes to RAM; when RAM is over its bound, its least recently
used blocks move to the disk tier (or are dropped without one), and the disk
tier drops its least recently used when over its own. A block read from disk
comes back into RAM. Every eviction is counted per tier. A put never replaces
a block held in either tier: the first write stands (and its checksum with it),
so a later put cannot swap what a prefix's readers get. Safe to call from
several threads (the service does disk work off its event loop).
"""

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from services.kvstore.block import StoredBlock
from services.kvstore.disk_tier import DiskTier
from shared.engine import KVEventLog

RAM, DISK = "ram", "disk"


@dataclass
class StoreStats:
    puts: int = 0
    kept_first: int = 0  # puts of a block already held: refused, the first write stands
    hits: dict[str, int] = field(default_factory=lambda: {RAM: 0, DISK: 0})
    misses: int = 0
    evictions: dict[str, int] = field(default_factory=lambda: {RAM: 0, DISK: 0})  # RAM: spilled or dropped
    dropped: int = 0  # blocks that left RAM with no disk tier to take them


class TieredBlockStore:
    def __init__(self, ram_bytes: int, disk_bytes: int = 0, disk_dir: str | None = None):
        if ram_bytes < 0 or disk_bytes < 0:
            raise ValueError("tier sizes cannot be negative")
        self.ram_bytes = ram_bytes
        self._ram: OrderedDict[bytes, StoredBlock] = OrderedDict()  # least recently used first
        self.ram_used = 0
        self.disk = DiskTier(disk_dir, disk_bytes) if disk_dir is not None and disk_bytes > 0 else None
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self.kv_events = KVEventLog()  # blocks stored and gone, for the schedulers' prefix index

    def held_hashes(self) -> list[bytes]:
        """Every key held in any tier; restarts the event log (a snapshot covers it)."""
        with self._lock:
            self.kv_events.restart()
            return [*self._ram, *(self.disk.keys() if self.disk is not None else ())]

    def put(self, key: bytes, block: StoredBlock) -> bool:
        """Store `block` under `key`; False (and nothing changes) when a block is held under it already."""
        with self._lock:
            if key in self._ram or (self.disk is not None and key in self.disk):
                self.stats.kept_first += 1
                return False
            self.stats.puts += 1
            self.kv_events.stored(key)
            if block.nbytes > self.ram_bytes:
                self._to_disk(key, block)  # too big for RAM at all
                return True
            self._ram[key] = block
            self.ram_used += block.nbytes
            self._spill()
            return True

    def get(self, key: bytes) -> tuple[StoredBlock, str] | None:
        """The block and the tier it was found in, or None."""
        with self._lock:
            block = self._ram.get(key)
            if block is not None:
                self._ram.move_to_end(key)
                self.stats.hits[RAM] += 1
                return block, RAM
            on_disk = self.disk is not None and key in self.disk
            block = self.disk.get(key) if on_disk else None
            if block is None:
                self.stats.misses += 1
                if on_disk:
                    self.kv_events.removed(key)  # unreadable: the disk tier dropped it
                return None
            self.stats.hits[DISK] += 1
            if block.nbytes <= self.ram_bytes:  # back into RAM: it is in use again
                self.disk.discard(key)
                self._ram[key] = block
                self.ram_used += block.nbytes
                self._spill()
            return block, DISK

    def tier_of(self, key: bytes) -> str | None:
        with self._lock:
            if key in self._ram:
                return RAM
            if self.disk is not None and key in self.disk:
                return DISK
            return None

    def longest_prefix(self, keys: list[bytes]) -> int:
        """How many of `keys` (a chain of block hashes, in order) are stored, counting from the first."""
        with self._lock:
            count = 0
            for key in keys:
                if key not in self._ram and (self.disk is None or key not in self.disk):
                    break
                count += 1
            return count

    def snapshot(self) -> dict:
        with self._lock:
            disk = self.disk
            return {
                "ram": {"bytes": self.ram_used, "capacity_bytes": self.ram_bytes, "blocks": len(self._ram)},
                "disk": {"bytes": disk.bytes_used if disk else 0, "capacity_bytes": disk.capacity_bytes if disk else 0,
                         "blocks": len(disk) if disk else 0, "corrupt_dropped": disk.dropped_corrupt if disk else 0,
                         "misnamed_dropped": disk.dropped_misnamed if disk else 0,
                         "forged_dropped": disk.dropped_forged if disk else 0},
                "puts": self.stats.puts, "kept_first": self.stats.kept_first, "hits": dict(self.stats.hits),
                "misses": self.stats.misses,
                "evictions": {RAM: self.stats.evictions[RAM], DISK: disk.evictions if disk else 0},
                "dropped": self.stats.dropped,
            }

    # ---- internals (lock held) ---------------------------------------------------------------------
    def _spill(self) -> None:
        while self.ram_used > self.ram_bytes and self._ram:
            key, block = self._ram.popitem(last=False)
            self.ram_used -= block.nbytes
            self.stats.evictions[RAM] += 1
            self._to_disk(key, block)

    def _to_disk(self, key: bytes, block: StoredBlock) -> None:
        if self.disk is None:
            self.stats.dropped += 1
            self.kv_events.removed(key)
            return
        for evicted in self.disk.put(key, block):
            self.kv_events.removed(evicted)
        if key not in self.disk:  # too big for the disk tier
            self.kv_events.removed(key)
