"""`PrefixIndex`: which workers' (and kv-stores') caches hold which prompt prefixes, from their KV events.

It is a radix tree over block hashes. Because a block's hash is chained (it
covers its parent's), one hash names a whole path from the root, so the tree
is kept as its nodes keyed by hash, each with the set of caches holding that
block; walking a prompt's hashes from the first is walking down the tree, and
a cache's overlap with the prompt is how far down it holds every node.

It is a hint for routing, never needed for correctness: events may be lost
(a gap in a publisher's `seq` drops what is known of it until a snapshot
comes), and the tree is bounded (least recently used nodes go first).
"""

from collections import Counter, OrderedDict
from dataclasses import dataclass

from contracts import KVEvents

KVSTORE = "@kvstore"  # the holder all kv-store instances count as (blocks are spread over them); no instance id has "@"


@dataclass(slots=True)
class _Publisher:
    role: str
    boot_id: str
    seq: int
    in_sync: bool


class PrefixIndex:
    def __init__(self, max_blocks: int = 1 << 18):
        self.max_blocks = max_blocks
        self._holders: OrderedDict[bytes, set[str]] = OrderedDict()  # node -> caches holding it; LRU first
        self._held: dict[str, set[bytes]] = {}  # cache -> its nodes
        self._publishers: dict[str, _Publisher] = {}
        self.counts: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._holders)

    def blocks_of(self, instance_id: str) -> int:
        return len(self._held.get(instance_id, ()))

    # ---- events ---------------------------------------------------------------------------------------
    def apply(self, event: KVEvents) -> bool:
        """Take one message of events; False when the publisher's state is unknown (ask it for a snapshot)."""
        known = self._publishers.get(event.instance_id)
        if known is not None and known.boot_id == event.boot_id and event.seq <= known.seq:
            self.counts["stale_messages"] += 1
            return True  # a late duplicate
        if event.snapshot or known is None or known.boot_id != event.boot_id:
            self.forget(event.instance_id)
            in_sync = event.snapshot
        else:
            in_sync = known.in_sync and event.seq == known.seq + 1
            if not in_sync and known.in_sync:
                self.counts["gaps"] += 1
                self.forget(event.instance_id)  # what it holds is unknown until its snapshot
        self._publishers[event.instance_id] = _Publisher(event.role, event.boot_id, event.seq, in_sync)
        self.counts["messages"] += 1
        for block_hash in event.removed:
            self._drop(block_hash, event.instance_id)
        for block_hash in event.stored:
            self._add(block_hash, event.instance_id)
        return in_sync

    def forget(self, instance_id: str) -> None:
        """Drop everything known of one cache (it left, restarted, or lost events)."""
        self._publishers.pop(instance_id, None)
        for block_hash in self._held.pop(instance_id, ()):
            holders = self._holders.get(block_hash)
            if holders is not None:
                holders.discard(instance_id)
                if not holders:
                    del self._holders[block_hash]

    def instances(self) -> list[str]:
        return list(self._publishers)

    def _add(self, block_hash: bytes, instance_id: str) -> None:
        holders = self._holders.get(block_hash)
        if holders is None:
            holders = self._holders[block_hash] = set()
        else:
            self._holders.move_to_end(block_hash)
        holders.add(instance_id)
        self._held.setdefault(instance_id, set()).add(block_hash)
        while len(self._holders) > self.max_blocks:
            evicted, gone = self._holders.popitem(last=False)
            self.counts["evicted_blocks"] += 1
            for holder in gone:
                held = self._held[holder]
                held.discard(evicted)
                if not held:
                    del self._held[holder]

    def _drop(self, block_hash: bytes, instance_id: str) -> None:
        holders = self._holders.get(block_hash)
        if holders is None:
            return
        holders.discard(instance_id)
        held = self._held.get(instance_id)
        if held is not None:
            held.discard(block_hash)
            if not held:
                del self._held[instance_id]
        if not holders:
            del self._holders[block_hash]

    # ---- queries --------------------------------------------------------------------------------------
    def overlaps(self, hashes: list[bytes]) -> dict[str, int]:
        """For each cache holding the first of `hashes`: how many of them, from the first, it holds.
        All kv-store instances count as one holder, `KVSTORE`."""
        overlap: dict[str, int] = {}
        active: set[str] | None = None
        for depth, block_hash in enumerate(hashes, start=1):
            holders = self._holders.get(block_hash)
            if not holders:
                break
            self._holders.move_to_end(block_hash)
            names = {self._holder_name(h) for h in holders}
            active = names if active is None else active & names
            if not active:
                break
            for name in active:
                overlap[name] = depth
        return overlap

    def _holder_name(self, instance_id: str) -> str:
        publisher = self._publishers.get(instance_id)
        return KVSTORE if publisher is not None and publisher.role == "kvstore" else instance_id
