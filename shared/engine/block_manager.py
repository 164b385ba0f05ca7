"""Paged KV block allocator with ref counts and a prefix cache.

Blocks hold `block_size` tokens of KV. A block is in exactly one of three
states: in use (ref_count > 0), cached-free (ref_count == 0 but holding a
hashed full block that a later request may reuse; evicted LRU-first when
memory is needed) or free (ref_count == 0, no content worth keeping).
"""

from collections import OrderedDict, deque
from dataclasses import dataclass

from shared.engine.block_hash import extend_block_hashes
from shared.engine.kv_connector import KVConnector
from shared.engine.sequence import Sequence


@dataclass(slots=True)
class PrefixHit:
    """The cached blocks a sequence can start from, and the tokens they cover."""

    block_ids: list[int]
    num_tokens: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, fingerprint: bytes, enable_prefix_caching: bool = True,
                 connector: KVConnector | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.hash_of_block: list[bytes | None] = [None] * num_blocks
        self.block_of_hash: dict[bytes, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.cached_free_block_ids: OrderedDict[int, None] = OrderedDict()  # LRU order: oldest first
        self.num_evictions = 0
        self.connector = connector or KVConnector()  # told of blocks entering and leaving the prefix cache

    def held_hashes(self) -> list[bytes]:
        """Every block hash the prefix cache holds now (the connector hears that the cache was listed)."""
        self.connector.cache_listed()
        return list(self.block_of_hash)

    # ---- accounting -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.cached_free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -------------------------------------------------------------
    def update_hashes(self, seq: Sequence) -> None:
        extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, self.fingerprint, seq.params.cache_salt)

    def find_prefix_hit(self, seq: Sequence) -> PrefixHit:
        """Longest run of cached blocks matching the start of `seq`.

        At least one token is always left to compute, so the step that follows
        produces logits to sample from.
        """
        if not self.enable_prefix_caching:
            return PrefixHit([], 0)
        self.update_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        block_ids: list[int] = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block_id = self.block_of_hash.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return PrefixHit(block_ids, len(block_ids) * self.block_size)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of `seq` whose every token now has KV computed."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if num_full <= seq.num_hashed_blocks:
            return
        self.update_hashes(seq)
        for index in range(seq.num_hashed_blocks, num_full):
            block_hash = seq.block_hashes[index]
            block_id = seq.block_table[index]
            # An identical block computed concurrently by another sequence keeps the entry.
            if block_hash not in self.block_of_hash and self.hash_of_block[block_id] is None:
                self.block_of_hash[block_hash] = block_id
                self.hash_of_block[block_id] = block_hash
                self.connector.block_stored(block_hash)
        seq.num_hashed_blocks = num_full

    # ---- allocation ---------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        return self._num_blocks_to_take(seq, num_new_tokens, hit) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Give `seq` blocks for `num_new_tokens` more tokens; False (and no change) if short.

        `hit` (first allocation only) adopts cached prefix blocks and marks
        their tokens computed.
        """
        if not self.can_allocate(seq, num_new_tokens, hit):
            return False
        if hit is not None and hit.block_ids:
            for block_id in hit.block_ids:
                self._take(block_id)
            seq.block_table.extend(hit.block_ids)
            seq.num_computed_tokens = hit.num_tokens
            seq.num_hashed_blocks = len(hit.block_ids)
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(needed):
            seq.block_table.append(self._take_new_block())
        return True

    def allocate_blocks(self, count: int) -> list[int] | None:
        """Take `count` fresh blocks outside any sequence (e.g. to import KV into)."""
        if count > self.num_free_blocks:
            return None
        return [self._take_new_block() for _ in range(count)]

    def free(self, seq: Sequence) -> None:
        # Release the tail first, so that under memory pressure the LRU evicts
        # the end of a prefix before its (more shareable) beginning.
        self.release(reversed(seq.block_table))
        seq.block_table.clear()
        seq.num_hashed_blocks = 0

    def release(self, block_ids) -> None:
        for block_id in block_ids:
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0, f"block {block_id} released twice"
            if self.ref_counts[block_id] == 0:
                if self.hash_of_block[block_id] is not None:
                    self.cached_free_block_ids[block_id] = None
                else:
                    self.free_block_ids.append(block_id)

    def reset_prefix_cache(self) -> None:
        for block_id in list(self.cached_free_block_ids):
            self._forget(block_id)
            self.free_block_ids.append(block_id)
        self.cached_free_block_ids.clear()

    # ---- internals ----------------------------------------------------------------
    def _num_blocks_to_take(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None) -> int:
        num_computed = seq.num_computed_tokens
        num_held = len(seq.block_table)
        revived = 0
        if hit is not None and hit.block_ids:
            num_computed, num_held = hit.num_tokens, len(hit.block_ids)
            revived = sum(1 for b in hit.block_ids if self.ref_counts[b] == 0)
        return max(0, self.blocks_needed(num_computed + num_new_tokens) - num_held) + revived

    def _take(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.cached_free_block_ids[block_id]
        self.ref_counts[block_id] += 1

    def _take_new_block(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        else:
            block_id, _ = self.cached_free_block_ids.popitem(last=False)
            self._forget(block_id)
            self.num_evictions += 1
        self.ref_counts[block_id] = 1
        return block_id

    def _forget(self, block_id: int) -> None:
        block_hash = self.hash_of_block[block_id]
        if block_hash is not None:
            del self.block_of_hash[block_hash]
            self.hash_of_block[block_id] = None
            self.connector.block_removed(block_hash)
