"""The scheduler's prefix index, the KV event log and the KV-aware ranking: pure, no NATS."""

from contracts import KVEvents, ServiceInfo
from services.scheduler.prefix_index import KVSTORE, PrefixIndex
from services.scheduler.worker_choice import cached_blocks, kv_cost, pick_prefill_worker, rank_by_kv
from shared.engine.block_hash import block_hashes
from shared.engine.kv_event_log import KVEventLog

FP = b"fingerprint"
CHAIN = block_hashes(list(range(64)), 8, FP)  # 8 blocks, chained


def event(instance, seq, stored=(), removed=(), snapshot=False, boot="b1", role="decode"):
    return KVEvents(instance_id=instance, role=role, boot_id=boot, seq=seq, snapshot=snapshot,
                    stored=list(stored), removed=list(removed))


def test_overlap_is_the_prefix_each_cache_holds_from_the_first_block():
    index = PrefixIndex()
    assert index.apply(event("a", 0, CHAIN[:6], snapshot=True))
    assert index.apply(event("b", 0, CHAIN[:2] + CHAIN[3:8], snapshot=True))  # b lacks block 2
    assert index.overlaps(CHAIN) == {"a": 6, "b": 2}
    assert index.apply(event("a", 1, removed=[CHAIN[0]]))
    assert index.overlaps(CHAIN) == {"b": 2}


def test_kv_store_instances_count_as_one_holder():
    index = PrefixIndex()
    index.apply(event("kvstore-0", 0, CHAIN[0::2], snapshot=True, role="kvstore"))
    index.apply(event("kvstore-1", 0, CHAIN[1::2], snapshot=True, role="kvstore"))
    assert index.overlaps(CHAIN) == {KVSTORE: 8}


def test_a_gap_forgets_the_publisher_until_its_snapshot():
    index = PrefixIndex()
    assert index.apply(event("a", 0, CHAIN[:4], snapshot=True))
    assert not index.apply(event("a", 2, CHAIN[4:5]))  # message 1 was lost
    assert index.counts["gaps"] == 1 and index.overlaps(CHAIN) == {}  # what it holds is unknown
    assert not index.apply(event("a", 3, CHAIN[5:6]))  # still out of sync
    assert index.apply(event("a", 4, CHAIN[:3], snapshot=True))
    assert index.overlaps(CHAIN) == {"a": 3}
    assert index.apply(event("a", 4, CHAIN[:8]))  # a late duplicate changes nothing
    assert index.overlaps(CHAIN) == {"a": 3}


def test_a_restart_or_a_late_start_needs_a_snapshot():
    index = PrefixIndex()
    assert not index.apply(event("a", 7, CHAIN[:2]))  # joined late: deltas alone are not the whole cache
    assert index.apply(event("a", 0, CHAIN[:4], snapshot=True))
    assert index.apply(event("a", 0, CHAIN[:1], snapshot=True, boot="b2"))  # restarted: its old cache is gone
    assert index.overlaps(CHAIN) == {"a": 1}
    index.forget("a")
    assert index.overlaps(CHAIN) == {} and len(index) == 0 and index.instances() == []


def test_bounded_least_recently_used_blocks_go_first():
    index = PrefixIndex(max_blocks=4)
    index.apply(event("a", 0, CHAIN[:4], snapshot=True))
    index.overlaps(CHAIN[:1])  # block 0 used again
    index.apply(event("b", 0, CHAIN[4:6], snapshot=True))
    assert len(index) == 4 and index.counts["evicted_blocks"] == 2
    assert index.overlaps(CHAIN) == {"a": 1}  # blocks 1 and 2 went; block 0 stayed
    assert index.blocks_of("a") == 2 and index.blocks_of("b") == 2


def test_event_log_keeps_the_latest_state_and_overflows_to_a_snapshot():
    log = KVEventLog(max_pending=3)
    log.stored(b"x")
    log.stored(b"y")
    log.removed(b"x")
    batch = log.drain()
    assert batch.stored == [b"y"] and batch.removed == [b"x"] and not batch.lost
    for name in (b"1", b"2", b"3", b"4"):
        log.stored(name)
    batch = log.drain()
    assert batch.lost and batch.stored == [] and batch.removed == []
    assert not log.drain().lost


def worker(instance, used=0, total=100, uses_kv_store=False, running=0):
    return ServiceInfo(instance_id=instance, role="decode", state="ready", served_model_name="m", max_num_seqs=8,
                       num_running=running, kv_blocks_total=total, kv_blocks_free=total - used,
                       uses_kv_store=uses_kv_store)


def test_kv_ranking_trades_the_cached_prefix_against_load():
    a, b = worker("a", used=10), worker("b", used=0)
    assert kv_cost(a, 20, 16, 1.0) == 4 + 0 and kv_cost(b, 20, 0, 1.0) == 20  # the 16 shared are not load
    assert kv_cost(worker("a", used=30), 20, 16, 1.0) == 4 + 14
    assert [w.instance_id for w in rank_by_kv([b, a], 20, {"a": 16}, 1.0)] == ["a", "b"]  # the cache wins
    busy = worker("a", used=60)
    assert [w.instance_id for w in rank_by_kv([busy, b], 20, {"a": 16}, 1.0)] == ["b", "a"]  # the load wins
    assert [w.instance_id for w in rank_by_kv([busy, b], 20, {"a": 16}, overlap_weight=5.0)] == ["a", "b"]
    # By default a computed block weighs two in use: a stale heartbeat still showing the holder's last request
    # (as many blocks as the prompt) does not push a fully cached prompt to a cold worker.
    assert [w.instance_id for w in rank_by_kv([worker("a", used=20), b], 20, {"a": 19})] == ["a", "b"]
    # A conversation's next turn, right after the last one: the holder still shows (or the scheduler still
    # counts) that turn's blocks in use, and the turn before it too; it stays with the holder, which computes 3
    # blocks, rather than going to an idle worker, which would compute 28.
    assert [w.instance_id for w in rank_by_kv([worker("a", used=53), b], 28, {"a": 25})] == ["a", "b"]
    # A worker whose batch is full queues the request: each queued one counts as this prompt's blocks.
    full = worker("a", running=8)
    full.num_waiting = 2
    assert kv_cost(full, 20, 16, 1.0) == 4 + 2 * 20
    # No cache anywhere: least loaded, then by id.
    assert [w.instance_id for w in rank_by_kv([worker("c"), worker("b", running=2)], 20, {})] == ["c", "b"]


def test_the_kv_store_tier_counts_only_for_workers_that_use_it():
    overlaps = {"a": 2}
    assert cached_blocks(worker("a", uses_kv_store=True), overlaps, kvstore_blocks=5) == 5
    assert cached_blocks(worker("a"), overlaps, kvstore_blocks=5) == 2
    assert cached_blocks(worker("b", uses_kv_store=True), overlaps, kvstore_blocks=1) == 1


def test_a_prefill_job_is_aimed_only_at_a_worker_holding_more_of_the_prompt():
    a, b = worker("prefill-a"), worker("prefill-b")
    assert pick_prefill_worker([a, b], 20, {"prefill-b": 12}) == "prefill-b"
    assert pick_prefill_worker([a, b], 20, {}) == ""  # nobody holds it: the shared queue balances the load
    assert pick_prefill_worker([a, b], 20, {"prefill-a": 5, "prefill-b": 5}) == ""  # (e.g. both from the kv-store)
    assert pick_prefill_worker([worker("prefill-a", used=90), b], 20, {"prefill-a": 2}) == ""  # too busy for 2
    assert pick_prefill_worker([], 20, {"x": 3}) == ""
