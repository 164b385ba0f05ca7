"""Spreading requests over workers when prefixes do not decide, and the tally of what was just routed: pure."""

import msgspec

from contracts import ServiceInfo, WorkerLoad
from services.scheduler.handoffs_in_flight import RoutedTally
from services.scheduler.worker_choice import (
    blocks_to_take,
    describe_load,
    kv_cost,
    load_score,
    num_seqs,
    rank_by_kv,
    rank_by_load,
    with_load,
)


def worker(instance, used=0, running=0, waiting=0, active=0, taken=0, boot="b1", total=100, slots=8):
    return ServiceInfo(instance_id=instance, role="decode", state="ready", served_model_name="m", max_num_seqs=slots,
                       num_running=running, num_waiting=waiting, kv_blocks_total=total, kv_blocks_free=total - used,
                       boot_id=boot, active_requests=active, handoffs_taken=taken,
                       kv_block_size=16, kv_fingerprint=b"f" * 16)


def route(tally, workers, request_id, prompt_blocks=4, cached=None, router="kv", now_ms=1000):
    """What the scheduler does for one request: rank the workers as the tally shows them, count it on the first."""
    shown = tally.apply(workers)
    cached = cached or {}
    ranked = rank_by_kv(shown, prompt_blocks, cached) if router == "kv" else rank_by_load(shown)
    chosen = ranked[0]
    tally.offered(request_id, chosen, prompt_blocks - cached.get(chosen.instance_id, 0), now_ms)
    return chosen.instance_id


def test_requests_in_flight_spread_over_idle_workers_by_either_router():
    for router in ("kv", "load"):
        tally = RoutedTally()
        workers = [worker("decode-0"), worker("decode-1")]
        chosen = [route(tally, workers, f"r{i}", router=router) for i in range(8)]  # no heartbeat in between
        assert chosen.count("decode-0") == 4 and chosen.count("decode-1") == 4, router
        assert tally.counts() == {"decode-0": 4, "decode-1": 4}


def test_without_a_prefix_to_decide_sequences_count_even_those_holding_no_blocks():
    # decode-0 holds fewer blocks but more requests (waiting, or loading their prefix): the request goes to decode-1.
    busy, light = worker("decode-0", used=2, running=1, active=5), worker("decode-1", used=10, running=2)
    assert num_seqs(busy) == 5 and num_seqs(light) == 2
    assert [w.instance_id for w in rank_by_kv([busy, light], 4, {})] == ["decode-1", "decode-0"]
    assert [w.instance_id for w in rank_by_kv([busy, light], 4, {"decode-0": 1, "decode-1": 1})][0] == "decode-1"
    # Same sequences: the KV blocks in use decide, then the instance id.
    assert [w.instance_id for w in rank_by_load([worker("b", used=5, running=1), worker("a", used=9, running=1)])] \
        == ["b", "a"]
    assert [w.instance_id for w in rank_by_load([worker("b"), worker("a")])] == ["a", "b"]


def test_a_cached_prefix_still_draws_its_request_to_the_holder():
    # A conversation: the first turn (25 blocks), the next (28 blocks, 25 of them cached), a third sharing 20 of
    # its 24 blocks; what the scheduler sees of decode-0 is a heartbeat made while the first turn ran (26 blocks).
    tally = RoutedTally()
    assert route(tally, [worker("decode-0"), worker("decode-1")], "first", prompt_blocks=25) == "decode-0"
    tally.accepted("first", handoffs_taken=1, entries=[])
    stale = [worker("decode-0", used=26, running=1, taken=1), worker("decode-1", taken=0)]
    tally.settle(stale, now_ms=1100)
    assert route(tally, stale, "second", prompt_blocks=28, cached={"decode-0": 25}) == "decode-0"
    tally.accepted("second", handoffs_taken=2, entries=stale)
    # Both turns have finished, no heartbeat since: the second still counts here, but only with the blocks it
    # added to the cache, so the holder's stale blocks and it do not outweigh the 20 cached blocks.
    assert route(tally, stale, "third", prompt_blocks=24, cached={"decode-0": 20}) == "decode-0"
    # A worker loaded far beyond what the cache saves loses the request.
    assert route(tally, [worker("decode-0", used=80), worker("decode-1")], "fourth", prompt_blocks=24,
                 cached={"decode-0": 20}) == "decode-1"


def test_the_tally_counts_until_the_workers_entry_shows_the_request():
    tally = RoutedTally()
    tally.offered("r1", worker("decode-0"), 4, now_ms=1000)
    shown = tally.apply([worker("decode-0", used=10, running=2), worker("decode-1")])
    assert (shown[0].num_running, shown[0].num_waiting, shown[0].kv_blocks_free) == (2, 1, 86)
    assert shown[1] == worker("decode-1")
    tally.settle([worker("decode-0", taken=7)], now_ms=1100)
    assert tally.counts() == {"decode-0": 1}  # the handoff is still in flight: no entry can show it yet
    tally.accepted("r1", handoffs_taken=8, entries=[worker("decode-0", taken=7)])
    tally.settle([worker("decode-0", taken=7)], now_ms=1200)
    assert tally.counts() == {"decode-0": 1}  # that heartbeat was made before the worker took it
    tally.settle([worker("decode-0", taken=8)], now_ms=1300)
    assert tally.counts() == {} and len(tally) == 0  # this one shows it (or that it has finished)
    assert tally.apply([worker("decode-0")]) == [worker("decode-0")]


def test_a_load_report_that_overtook_the_handoffs_reply_ends_the_count_when_the_reply_comes():
    tally = RoutedTally()
    tally.offered("r1", worker("decode-0"), 4, now_ms=1000)
    shown = [worker("decode-0", running=1, active=1, taken=1), worker("decode-1")]
    tally.settle(shown, now_ms=1010)  # the report came first: which request it counts is not known yet
    assert tally.counts() == {"decode-0": 1}
    tally.accepted("r1", handoffs_taken=1, entries=shown)  # it is this one: counted once, by the worker
    assert tally.counts() == {}
    assert [num_seqs(w) for w in tally.apply(shown)] == [1, 0]
    # Shown by another process of the same name (it restarted meanwhile): that entry does not hold it.
    tally.offered("r2", worker("decode-1"), 4, now_ms=1020)
    tally.accepted("r2", handoffs_taken=1, entries=[worker("decode-1", taken=5, boot="b2")])
    assert tally.counts() == {"decode-1": 1}


def test_the_tally_adds_to_what_the_worker_reports_it_holds():
    tally = RoutedTally()
    tally.offered("r1", worker("decode-0"), 3, now_ms=0)
    shown, = tally.apply([worker("decode-0", running=1, waiting=1, active=4)])
    assert num_seqs(shown) == 5 and load_score(shown) == (5 / 8, 1 - 97 / 100)


def test_a_refused_or_failed_handoff_stops_counting_at_once():
    tally = RoutedTally()
    tally.offered("r1", worker("decode-0"), 4, now_ms=0)
    tally.offered("r2", worker("decode-0"), 4, now_ms=0)
    tally.discard("r1")
    tally.discard("r1")  # twice is harmless
    shown, = tally.apply([worker("decode-0")])
    assert (num_seqs(shown), shown.kv_blocks_free) == (1, 96)
    tally.offered("r2", worker("decode-1"), 2, now_ms=0)  # offered again elsewhere: counted there only
    assert tally.counts() == {"decode-1": 1}


def test_the_tally_is_bounded():
    tally = RoutedTally(max_age_ms=5000, max_requests=3)
    for i in range(5):
        tally.offered(f"r{i}", worker("decode-0"), 1, now_ms=i * 1000)
        tally.accepted(f"r{i}", handoffs_taken=0, entries=[worker("decode-0")])  # a worker not counting handoffs
    assert len(tally) == 3 and tally.counts() == {"decode-0": 3}  # the oldest went first
    tally.settle([worker("decode-0")], now_ms=8500)  # its entry never says: too old now
    assert tally.counts() == {"decode-0": 1}
    tally.offered("r8", worker("decode-1"), 1, now_ms=8500)
    tally.settle([worker("decode-0")], now_ms=8600)  # decode-1 left the registry: what went there is gone
    assert tally.counts() == {"decode-0": 1}
    tally.settle([worker("decode-0", boot="b2")], now_ms=8700)  # decode-0 restarted: its requests died with it
    assert tally.counts() == {}


def test_blocks_to_take_are_the_prompt_blocks_the_cache_does_not_hold():
    assert blocks_to_take(worker("a"), 33) == 3
    assert blocks_to_take(worker("a"), 33, num_cached_blocks=2) == 1
    assert blocks_to_take(worker("a"), 32, num_cached_blocks=5) == 0
    # Only requests beyond the batch's slots queue in kv_cost, counted by every request the worker holds.
    assert kv_cost(worker("a", running=2, active=10), 4, 0, 2.0) == 8 + 2 * 4


def test_a_load_report_newer_than_the_heartbeat_replaces_its_figures():
    entry = ServiceInfo(instance_id="d-0", role="decode", boot_id="b1", heartbeat_ms=1000, num_running=3,
                        num_waiting=1, kv_blocks_free=10, active_requests=4, handoffs_taken=9)
    report = WorkerLoad(instance_id="d-0", boot_id="b1", sent_ms=1040, num_running=0, num_waiting=0,
                        kv_blocks_free=50, active_requests=0, handoffs_taken=10)
    fresh = with_load(entry, report)
    assert (fresh.num_running, fresh.num_waiting, fresh.kv_blocks_free) == (0, 0, 50)
    assert (fresh.active_requests, fresh.handoffs_taken, fresh.max_model_len) == (0, 10, entry.max_model_len)
    assert entry.num_running == 3
    assert num_seqs(fresh) == 0 and num_seqs(entry) == 4
    # Older than the heartbeat, or from another process of the same name: the entry stands.
    assert with_load(entry, WorkerLoad(**{**msgspec.structs.asdict(report), "sent_ms": 990, "handoffs_taken": 9})) \
        is entry
    assert with_load(entry, WorkerLoad(**{**msgspec.structs.asdict(report), "sent_ms": 1000, "handoffs_taken": 9})) \
        is entry
    # Made in the heartbeat's millisecond, after a handoff the heartbeat does not count: the report is the newer.
    same_ms = with_load(entry, WorkerLoad(**{**msgspec.structs.asdict(report), "sent_ms": 1000}))
    assert (same_ms.handoffs_taken, same_ms.active_requests) == (10, 0)
    assert with_load(entry, WorkerLoad(**{**msgspec.structs.asdict(report), "boot_id": "b2"})) is entry
    assert with_load(entry, None) is entry
    # A prefill worker's entry takes its report's figures as well.
    prefill = ServiceInfo(instance_id="p-0", role="prefill", boot_id="b1", heartbeat_ms=1000, num_running=1)
    assert with_load(prefill, WorkerLoad(**{**msgspec.structs.asdict(report), "instance_id": "p-0"})).num_running == 0


def test_a_route_span_describes_each_candidate_as_the_scheduler_saw_it():
    busy = worker("decode-0", used=30, running=2, active=3)
    assert describe_load(busy) == "decode-0: 3/8 seqs, 30/100 blocks"
    assert describe_load(busy, cached_blocks=12) == "decode-0: 3/8 seqs, 30/100 blocks, 12 cached"
