"""BlockManager and chained block hashes: pure bookkeeping, no model, no tensors."""

import hashlib
import struct

import pytest

from shared.engine.block_hash import (
    BLOCK_HASH_BYTES,
    ROOT_PARENT_HASH,
    block_hashes,
    extend_block_hashes,
    hash_block,
)
from shared.engine.block_manager import BlockManager, PrefixHit
from shared.engine.sampling_params import SamplingParams
from shared.engine.sequence import Sequence

FP = bytes(range(16))
OTHER_FP = bytes(range(1, 17))


def make_seq(tokens, rid="r", arrival=0) -> Sequence:
    tokens = list(tokens)
    return Sequence(
        request_id=rid,
        token_ids=tokens,
        num_prompt_tokens=len(tokens),
        params=SamplingParams(),
        seed=0,
        max_total_tokens=10**6,
        arrival_index=arrival,
    )


def compute_all(bm: BlockManager, seq: Sequence, use_hit: bool = True) -> PrefixHit | None:
    """Admit `seq` (with its prefix hit) and mark every token computed, as the engine does."""
    hit = bm.find_prefix_hit(seq) if use_hit else None
    start = hit.num_tokens if hit else seq.num_computed_tokens
    assert bm.allocate(seq, seq.num_tokens - start, hit)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return hit


def snapshot(bm: BlockManager) -> tuple:
    return (
        list(bm.ref_counts),
        list(bm.hash_of_block),
        dict(bm.block_of_hash),
        list(bm.free_block_ids),
        list(bm.cached_free_block_ids),
        bm.num_evictions,
    )


def check_invariants(bm: BlockManager) -> None:
    """Every block is in exactly one state, and the two hash maps agree."""
    free = list(bm.free_block_ids)
    cached = list(bm.cached_free_block_ids)
    assert len(set(free)) == len(free)
    assert not set(free) & set(cached)
    for block_id in range(bm.num_blocks):
        in_use = bm.ref_counts[block_id] > 0
        assert in_use + (block_id in free) + (block_id in cached) == 1, block_id
        if block_id in cached:
            assert bm.hash_of_block[block_id] is not None
        if block_id in free:
            assert bm.hash_of_block[block_id] is None
    for block_hash, block_id in bm.block_of_hash.items():
        assert bm.hash_of_block[block_id] == block_hash
    assert sum(h is not None for h in bm.hash_of_block) == len(bm.block_of_hash)


# ---- hashes ---------------------------------------------------------------------


def test_hash_block_golden_value_is_stable():
    # Computed once and hard-coded: hashes must be identical across processes and machines.
    assert hash_block(ROOT_PARENT_HASH, [1, 2, 3, 4], b"fingerprint-0123").hex() == "2e9288e79ade3932674f09e609a8d6ef"
    assert block_hashes(list(range(8)), 4, FP)[1].hex() == "8298ffaf21f5d632e89ac9c218da378a"
    # And it is what the docstring says: blake2b over parent, fingerprint, little-endian int64 ids.
    digest = hashlib.blake2b(digest_size=BLOCK_HASH_BYTES)
    digest.update(ROOT_PARENT_HASH + b"fingerprint-0123" + struct.pack("<4q", 1, 2, 3, 4))
    assert hash_block(ROOT_PARENT_HASH, [1, 2, 3, 4], b"fingerprint-0123") == digest.digest()
    assert len(ROOT_PARENT_HASH) == BLOCK_HASH_BYTES == 16


def test_chained_hashes_depend_on_parent_and_fingerprint():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, FP)
    b = block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4, FP)
    assert len(a) == len(b) == 2
    assert a[1] != b[1]  # same tokens, different parent
    assert a == block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, FP)  # deterministic
    assert a[1] == hash_block(a[0], [5, 6, 7, 8], FP)
    assert a[0] == hash_block(ROOT_PARENT_HASH, [1, 2, 3, 4], FP)
    c = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, OTHER_FP)
    assert c[0] != a[0] and c[1] != a[1]  # different model fingerprint
    # Only full blocks are hashed; extending continues the chain.
    assert len(block_hashes([1, 2, 3, 4, 5, 6, 7], 4, FP)) == 1
    partial = block_hashes([1, 2, 3, 4], 4, FP)
    extend_block_hashes(partial, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4, FP)
    assert partial == a


# ---- states and ref counts ------------------------------------------------------


def test_initial_state_and_validation():
    bm = BlockManager(5, 4, FP)
    assert bm.num_free_blocks == 5 and bm.num_used_blocks == 0
    assert list(bm.free_block_ids) == [0, 1, 2, 3, 4]
    assert bm.blocks_needed(0) == 0 and bm.blocks_needed(1) == 1
    assert bm.blocks_needed(4) == 1 and bm.blocks_needed(5) == 2
    with pytest.raises(ValueError):
        BlockManager(0, 4, FP)
    with pytest.raises(ValueError):
        BlockManager(4, 0, FP)


def test_ref_counts_on_shared_prefix_blocks():
    bm = BlockManager(10, 4, FP)
    a = make_seq(range(100, 109), "a")  # 9 tokens: 2 full blocks + 1 partial
    assert compute_all(bm, a).block_ids == []
    assert len(a.block_table) == 3 and a.num_hashed_blocks == 2
    a0, a1, a2 = a.block_table
    assert bm.hash_of_block[a0] is not None and bm.hash_of_block[a1] is not None
    assert bm.hash_of_block[a2] is None

    b = make_seq(list(range(100, 108)) + [7, 7], "b")
    hit = bm.find_prefix_hit(b)
    assert hit.block_ids == [a0, a1] and hit.num_tokens == 8
    assert bm.allocate(b, b.num_tokens - hit.num_tokens, hit)
    assert b.num_computed_tokens == 8 and b.num_hashed_blocks == 2
    assert b.block_table[:2] == [a0, a1] and len(b.block_table) == 3
    b2 = b.block_table[2]
    assert b2 not in a.block_table
    assert bm.ref_counts[a0] == bm.ref_counts[a1] == 2
    assert bm.ref_counts[a2] == bm.ref_counts[b2] == 1
    assert bm.num_used_blocks == 4
    check_invariants(bm)

    bm.free(a)
    assert a.block_table == [] and a.num_hashed_blocks == 0
    assert bm.ref_counts[a0] == bm.ref_counts[a1] == 1  # still held by b
    assert bm.ref_counts[a2] == 0 and a2 in bm.free_block_ids  # unhashed partial: plain free
    assert a0 not in bm.cached_free_block_ids and a1 not in bm.cached_free_block_ids
    assert bm.num_used_blocks == 3
    check_invariants(bm)

    bm.free(b)
    assert bm.ref_counts[a0] == bm.ref_counts[a1] == 0
    assert list(bm.cached_free_block_ids) == [a1, a0]  # hashed: cached-free, tail first
    assert b2 in bm.free_block_ids
    assert bm.num_free_blocks == 10 and bm.num_used_blocks == 0
    check_invariants(bm)
    with pytest.raises(AssertionError):
        bm.release([a0])  # double release is caught


def test_free_list_versus_cached_free_states():
    bm = BlockManager(4, 2, FP)
    seq = make_seq([1, 2, 3, 4, 5], "s")  # blocks: [1,2] [3,4] [5]
    compute_all(bm, seq)
    table = list(seq.block_table)
    assert bm.num_free_blocks == 1 and len(bm.free_block_ids) == 1 and not bm.cached_free_block_ids
    bm.free(seq)
    # Full (hashed) blocks are worth keeping, the partial one is not.
    assert list(bm.cached_free_block_ids) == [table[1], table[0]]
    assert table[2] in bm.free_block_ids
    assert bm.num_free_blocks == 4  # cached-free blocks count as free
    assert bm.num_used_blocks == 0
    check_invariants(bm)


# ---- eviction -----------------------------------------------------------------


def test_eviction_is_lru_tail_first_and_drops_hash_entry():
    bm = BlockManager(4, 2, FP)
    a = make_seq([1, 2, 3, 4, 5], "a")
    compute_all(bm, a)
    a0, a1, a2 = a.block_table
    hashes = list(a.block_hashes)
    bm.free(a)
    # Free list first: no eviction while plain free blocks remain.
    taken = bm.allocate_blocks(2)
    assert sorted(taken) == sorted([a2, 3]) and bm.num_evictions == 0
    assert set(bm.block_of_hash) == set(hashes)
    # Then the least recently freed cached block: the tail of a's prefix.
    assert bm.allocate_blocks(1) == [a1]
    assert bm.num_evictions == 1
    assert hashes[1] not in bm.block_of_hash and bm.hash_of_block[a1] is None
    assert bm.block_of_hash[hashes[0]] == a0
    again = make_seq([1, 2, 3, 4, 5], "again")
    assert bm.find_prefix_hit(again).block_ids == [a0]
    assert bm.allocate_blocks(1) == [a0]
    assert bm.num_evictions == 2 and bm.block_of_hash == {}
    assert bm.find_prefix_hit(again).block_ids == []
    assert bm.allocate_blocks(1) is None  # nothing left
    check_invariants(bm)


def test_eviction_order_is_least_recently_freed_first():
    bm = BlockManager(4, 2, FP)
    a = make_seq([1, 2, 9], "a")  # 1 full block
    b = make_seq([3, 4, 9], "b")
    compute_all(bm, a)
    compute_all(bm, b)
    a0, b0 = a.block_table[0], b.block_table[0]
    bm.free(a)
    bm.free(b)
    assert list(bm.cached_free_block_ids) == [a0, b0]
    # Reviving a0 through a prefix hit and freeing it again makes it the most recent.
    c = make_seq([1, 2, 8], "c")
    hit = compute_all(bm, c)
    assert hit.block_ids == [a0] and bm.ref_counts[a0] == 1
    assert a0 not in bm.cached_free_block_ids
    bm.free(c)
    assert list(bm.cached_free_block_ids) == [b0, a0]
    assert len(bm.free_block_ids) == 2
    first = bm.allocate_blocks(3)
    assert first[2] == b0 and bm.num_evictions == 1
    assert bm.find_prefix_hit(make_seq([3, 4, 9])).block_ids == []
    assert bm.find_prefix_hit(make_seq([1, 2, 9])).block_ids == [a0]
    check_invariants(bm)


# ---- prefix hits ----------------------------------------------------------------


def test_prefix_hit_leaves_at_least_one_token_to_compute():
    bm = BlockManager(16, 4, FP)
    a = make_seq(range(12), "a")  # exactly 3 full blocks
    compute_all(bm, a)
    assert a.num_hashed_blocks == 3
    # A prompt of exactly k full blocks hits at most k-1 of them.
    same = make_seq(range(12), "same")
    hit = bm.find_prefix_hit(same)
    assert hit.block_ids == a.block_table[:2] and hit.num_tokens == 8
    assert bm.find_prefix_hit(make_seq(range(8))).num_tokens == 4
    assert bm.find_prefix_hit(make_seq(range(4))).num_tokens == 0
    assert bm.find_prefix_hit(make_seq(range(3))).num_tokens == 0
    assert bm.find_prefix_hit(make_seq([0])).num_tokens == 0
    # One token more and all k blocks hit.
    longer = make_seq(list(range(12)) + [99], "longer")
    hit = bm.find_prefix_hit(longer)
    assert hit.block_ids == a.block_table[:3] and hit.num_tokens == 12
    # After admission exactly the uncovered tail is left.
    assert bm.allocate(longer, 1, hit)
    assert longer.num_uncomputed_tokens == 1 and len(longer.block_table) == 4


def test_prefix_hit_stops_at_first_miss():
    bm = BlockManager(16, 4, FP)
    a = make_seq(range(13), "a")
    compute_all(bm, a)
    a0, a1, a2, _ = a.block_table
    # Different second block: the chain breaks there even though block 3's tokens match.
    b = make_seq(list(range(4)) + [50, 51, 52, 53] + list(range(8, 13)), "b")
    assert bm.find_prefix_hit(b).block_ids == [a0]
    # Drop the middle entry (as an eviction would): the later entry is not used.
    bm._forget(a1)
    c = make_seq(range(13), "c")
    hit = bm.find_prefix_hit(c)
    assert hit.block_ids == [a0] and hit.num_tokens == 4
    assert bm.block_of_hash[c.block_hashes[2]] == a2  # still cached, but unreachable


def test_prefix_hit_respects_fingerprint_and_disabled_caching():
    bm = BlockManager(8, 4, FP)
    compute_all(bm, make_seq(range(9), "a"))
    other = BlockManager(8, 4, OTHER_FP)
    other.block_of_hash = dict(bm.block_of_hash)  # same cache content, different model
    assert other.find_prefix_hit(make_seq(range(9))).block_ids == []
    off = BlockManager(8, 4, FP, enable_prefix_caching=False)
    s = make_seq(range(9), "s")
    compute_all(off, s)
    assert off.block_of_hash == {} and s.num_hashed_blocks == 0
    assert off.find_prefix_hit(make_seq(range(9))) == PrefixHit([], 0)
    off.free(s)
    assert len(off.free_block_ids) == 8 and not off.cached_free_block_ids


# ---- allocation -----------------------------------------------------------------


def test_allocate_grows_block_table_incrementally():
    bm = BlockManager(8, 4, FP)
    s = make_seq(range(10), "s")
    assert bm.allocate(s, 3)
    assert len(s.block_table) == 1
    s.num_computed_tokens = 3
    assert bm.allocate(s, 1)  # 4 tokens still fit one block
    assert len(s.block_table) == 1
    s.num_computed_tokens = 4
    assert bm.allocate(s, 6)
    assert len(s.block_table) == 3 and bm.num_used_blocks == 3
    assert bm.allocate(s, 0) and len(s.block_table) == 3


def test_allocate_returns_false_and_changes_nothing_when_short():
    bm = BlockManager(4, 4, FP)
    a = make_seq(range(9), "a")
    compute_all(bm, a)  # 3 blocks in use, 2 of them hashed
    b = make_seq(range(100, 108), "b")
    before = snapshot(bm)
    assert not bm.can_allocate(b, 8)
    assert not bm.allocate(b, 8)
    assert snapshot(bm) == before
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.num_hashed_blocks == 0
    # With a hit on blocks in use: the hit costs nothing, but the tail still does not fit.
    c = make_seq(list(range(8)) + list(range(50, 59)), "c")
    hit = bm.find_prefix_hit(c)
    assert len(hit.block_ids) == 2
    before = snapshot(bm)
    assert not bm.allocate(c, c.num_tokens - hit.num_tokens, hit)
    assert snapshot(bm) == before
    assert c.block_table == [] and c.num_computed_tokens == 0 and c.num_hashed_blocks == 0
    # allocate_blocks too.
    assert bm.allocate_blocks(2) is None
    assert snapshot(bm) == before
    check_invariants(bm)


def test_reviving_cached_free_blocks_counts_against_free_blocks():
    bm = BlockManager(4, 4, FP)
    a = make_seq(range(12), "a")  # 3 full blocks
    compute_all(bm, a)
    bm.free(a)
    assert len(bm.cached_free_block_ids) == 3 and len(bm.free_block_ids) == 1
    other = bm.allocate_blocks(1)  # takes the one plain free block
    assert bm.num_evictions == 0
    b = make_seq(list(range(12)) + [77], "b")
    hit = bm.find_prefix_hit(b)
    assert len(hit.block_ids) == 3
    # 1 new block + 3 revived > 3 free: must refuse (else the new block would evict a hit block).
    before = snapshot(bm)
    assert not bm.can_allocate(b, 1, hit)
    assert not bm.allocate(b, 1, hit)
    assert snapshot(bm) == before and b.block_table == [] and b.num_computed_tokens == 0
    # With the other block back, it fits exactly and nothing is evicted.
    bm.release(other)
    assert bm.allocate(b, 1, hit)
    assert bm.num_free_blocks == 0 and bm.num_evictions == 0
    assert b.block_table[:3] == hit.block_ids and b.num_computed_tokens == 12
    assert all(bm.ref_counts[x] == 1 for x in b.block_table)
    assert all(bm.block_of_hash[h] == x for h, x in zip(b.block_hashes, b.block_table[:3]))
    check_invariants(bm)


def test_hit_on_blocks_in_use_is_free_of_charge():
    bm = BlockManager(5, 4, FP)
    a = make_seq(range(9), "a")  # 3 blocks, 2 hashed; a keeps them
    compute_all(bm, a)
    assert bm.num_free_blocks == 2
    b = make_seq(list(range(8)) + list(range(50, 55)), "b")  # 13 tokens
    hit = bm.find_prefix_hit(b)
    assert hit.block_ids == a.block_table[:2]
    assert bm.can_allocate(b, 5, hit)  # 2 new blocks, the shared ones cost nothing
    assert not bm.can_allocate(b, 9, hit)  # 3 new blocks
    assert bm.allocate(b, 5, hit)
    assert bm.num_free_blocks == 0
    assert [bm.ref_counts[x] for x in b.block_table] == [2, 2, 1, 1]
    check_invariants(bm)


def test_free_releases_tail_first():
    bm = BlockManager(8, 2, FP)
    s = make_seq(range(8), "s")  # 4 full blocks
    compute_all(bm, s)
    table = list(s.block_table)
    assert s.num_hashed_blocks == 4
    bm.free(s)
    assert list(bm.cached_free_block_ids) == table[::-1]
    # So eviction takes the end of the prefix first.
    bm.allocate_blocks(len(bm.free_block_ids))
    assert bm.allocate_blocks(1) == [table[3]]
    assert bm.find_prefix_hit(make_seq(range(9))).block_ids == table[:3]


# ---- cache_full_blocks -----------------------------------------------------------


def test_cache_full_blocks_registers_only_fully_computed_blocks():
    bm = BlockManager(8, 4, FP)
    s = make_seq(range(10), "s")
    assert bm.allocate(s, 10)
    b0, b1, b2 = s.block_table
    s.num_computed_tokens = 3
    bm.cache_full_blocks(s)
    assert s.num_hashed_blocks == 0 and bm.block_of_hash == {}
    s.num_computed_tokens = 6
    bm.cache_full_blocks(s)
    assert s.num_hashed_blocks == 1
    assert bm.block_of_hash == {s.block_hashes[0]: b0}
    assert bm.hash_of_block[b1] is None
    s.num_computed_tokens = 10
    bm.cache_full_blocks(s)
    assert s.num_hashed_blocks == 2
    assert bm.block_of_hash == {s.block_hashes[0]: b0, s.block_hashes[1]: b1}
    assert bm.hash_of_block[b2] is None  # partial block never registered
    s.token_ids += [10, 11]
    s.num_computed_tokens = 12
    bm.cache_full_blocks(s)
    assert s.num_hashed_blocks == 3 and bm.hash_of_block[b2] == s.block_hashes[2]
    check_invariants(bm)


def test_cache_full_blocks_never_beyond_block_table():
    bm = BlockManager(8, 4, FP)
    s = make_seq(range(12), "s")
    assert bm.allocate(s, 4)  # only 1 block held
    s.num_computed_tokens = 12  # inconsistent on purpose: capped by the block table
    bm.cache_full_blocks(s)
    assert s.num_hashed_blocks == 1 and len(bm.block_of_hash) == 1


def test_identical_blocks_computed_concurrently_keep_the_first():
    bm = BlockManager(8, 4, FP)
    a = make_seq(range(9), "a")
    b = make_seq(range(9), "b")
    # Both admitted before either computed anything: no hit for b.
    assert bm.allocate(a, 9, bm.find_prefix_hit(a))
    assert bm.allocate(b, 9, bm.find_prefix_hit(b))
    assert not set(a.block_table) & set(b.block_table)
    for s in (a, b):
        s.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    bm.cache_full_blocks(b)
    assert a.num_hashed_blocks == b.num_hashed_blocks == 2
    assert bm.block_of_hash == {a.block_hashes[0]: a.block_table[0], a.block_hashes[1]: a.block_table[1]}
    assert bm.hash_of_block[b.block_table[0]] is None and bm.hash_of_block[b.block_table[1]] is None
    bm.free(b)  # b's duplicates are not worth keeping
    assert not bm.cached_free_block_ids and len(bm.free_block_ids) == 8 - 3
    a0, a1, _ = a.block_table
    bm.free(a)
    assert list(bm.cached_free_block_ids) == [a1, a0]
    # The kept entry serves later hits.
    assert bm.find_prefix_hit(make_seq(range(9))).block_ids == [a0, a1]
    check_invariants(bm)


# ---- reset ----------------------------------------------------------------------


def test_reset_prefix_cache():
    bm = BlockManager(8, 4, FP)
    a = make_seq(range(9), "a")
    compute_all(bm, a)
    bm.free(a)
    assert len(bm.cached_free_block_ids) == 2 and len(bm.block_of_hash) == 2
    bm.reset_prefix_cache()
    assert not bm.cached_free_block_ids and bm.block_of_hash == {}
    assert all(h is None for h in bm.hash_of_block)
    assert bm.num_free_blocks == 8 and len(bm.free_block_ids) == 8
    assert bm.num_evictions == 0
    assert bm.find_prefix_hit(make_seq(range(9))).block_ids == []
    check_invariants(bm)
    # Blocks in use are untouched by a reset.
    b = make_seq(range(9), "b")
    compute_all(bm, b)
    refs = list(bm.ref_counts)
    bm.reset_prefix_cache()
    assert bm.ref_counts == refs and bm.num_used_blocks == 3
    check_invariants(bm)
    bm.free(b)
    assert bm.num_free_blocks == 8
    check_invariants(bm)


def test_kv_events_follow_what_the_prefix_cache_holds():
    from shared.engine.kv_event_log import KVEventLog, PrefixCacheEvents

    events = KVEventLog()
    bm = BlockManager(4, 2, FP, connector=PrefixCacheEvents(events))
    a = make_seq([1, 2, 3, 4, 5], "a")
    compute_all(bm, a)
    hashes = list(a.block_hashes)
    batch = events.drain()
    assert batch.stored == hashes and batch.removed == [] and len(hashes) == 2  # full blocks only
    b = make_seq([1, 2, 3, 4, 9], "b")
    compute_all(bm, b)  # the same two blocks, from the cache: nothing new
    assert events.drain().stored == []
    bm.free(a)
    bm.free(b)
    bm.allocate_blocks(3)  # two plain free blocks, then the least recently freed cached one goes
    assert events.drain().removed == [hashes[1]]
    assert bm.held_hashes() == [hashes[0]]
    bm.reset_prefix_cache()
    assert events.drain().removed == [hashes[0]] and bm.held_hashes() == []
