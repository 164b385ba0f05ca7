"""Scheduler with fake sequences: budgets, chunking, ordering, preemption, finish, imported KV.

Steps are simulated as the engine does them: after `schedule()`, every
scheduled sequence gets `num_computed_tokens += num_new_tokens` (and its full
blocks cached), and a sequence whose tokens are then all computed gets one
new token appended.
"""

import pytest

from shared.engine.block_manager import BlockManager
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from shared.engine.sequence import Sequence, SequenceStatus

FP = bytes(16)


def make_seq(num_tokens: int, rid: str, arrival: int = 0, base: int = 0) -> Sequence:
    tokens = [base + i for i in range(num_tokens)]
    return Sequence(
        request_id=rid,
        token_ids=tokens,
        num_prompt_tokens=num_tokens,
        params=SamplingParams(),
        seed=0,
        max_total_tokens=10**6,
        arrival_index=arrival,
    )


def make_scheduler(
    num_blocks=64, block_size=4, max_num_seqs=64, budget=2048, chunked=True, prefix_caching=True
) -> tuple[Scheduler, BlockManager]:
    bm = BlockManager(num_blocks, block_size, FP, prefix_caching)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, chunked), bm), bm


def apply(out: SchedulerOutput, bm: BlockManager, next_token: int = 1) -> list[Sequence]:
    """What the engine does with a step's result; returns the sequences that sampled."""
    sampled = []
    for item in out.scheduled:
        seq = item.seq
        assert 0 < item.num_new_tokens <= seq.num_uncomputed_tokens
        assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens + item.num_new_tokens
        seq.num_computed_tokens += item.num_new_tokens
        bm.cache_full_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(next_token)
            sampled.append(seq)
    return sampled


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(item.seq.request_id, item.num_new_tokens) for item in out.scheduled]


def test_config_validation():
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_batched_tokens=0)


def test_token_budget_is_respected_until_all_finish():
    sched, bm = make_scheduler(budget=10)
    seqs = [make_seq(n, f"s{i}", i, base=100 * i) for i, n in enumerate([6, 13, 3, 25, 1])]
    for s in seqs:
        sched.add(s)
    outputs = {s.request_id: 0 for s in seqs}
    for _ in range(200):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        assert out.scheduled, "no progress"
        assert 0 < out.num_batched_tokens <= 10
        assert len({item.seq.request_id for item in out.scheduled}) == len(out.scheduled)
        for seq in apply(out, bm):
            outputs[seq.request_id] += 1
            if outputs[seq.request_id] == 3:
                sched.finish(seq)
    assert not sched.has_unfinished()
    assert all(n == 3 for n in outputs.values())
    assert bm.num_used_blocks == 0


def test_long_prompt_is_chunked_over_several_steps():
    sched, bm = make_scheduler(budget=8)
    seq = make_seq(20, "long")
    sched.add(seq)
    chunks = []
    for _ in range(3):
        out = sched.schedule()
        chunks.append(plan(out))
        assert apply(out, bm) == ([seq] if len(chunks) == 3 else [])
    assert chunks == [[("long", 8)], [("long", 8)], [("long", 4)]]
    assert seq.num_tokens == 21 and seq.num_computed_tokens == 20
    assert plan(sched.schedule()) == [("long", 1)]  # then decodes one token at a time
    assert seq.num_cached_tokens == 0


def test_running_sequences_go_before_waiting_ones():
    sched, bm = make_scheduler(budget=8)
    a = make_seq(5, "a", 0)
    sched.add(a)
    apply(sched.schedule(), bm)  # a is now decoding
    b = make_seq(30, "b", 1, base=500)
    sched.add(b)
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("b", 7)]
    apply(out, bm)
    # A running prompt still being prefilled also goes before a newer arrival.
    c = make_seq(4, "c", 2, base=900)
    sched.add(c)
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("b", 7)]
    assert list(sched.waiting) == [c]


def test_waiting_sequences_are_admitted_in_arrival_order():
    sched, bm = make_scheduler(budget=6)
    seqs = [make_seq(4, f"s{i}", i, base=10 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert plan(out) == [("s0", 4), ("s1", 2)]  # s1 chunked to fill the budget
    assert sched.running == seqs[:2] and list(sched.waiting) == [seqs[2]]
    assert all(s.status is SequenceStatus.RUNNING for s in seqs[:2])
    assert seqs[2].status is SequenceStatus.WAITING


def test_max_num_seqs_is_respected():
    sched, bm = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(3, f"s{i}", i, base=10 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert plan(out) == [("s0", 3), ("s1", 3)]
    apply(out, bm)
    assert plan(sched.schedule()) == [("s0", 1), ("s1", 1)]  # still only two
    sched.finish(seqs[0])
    out = sched.schedule()
    assert plan(out) == [("s1", 1), ("s2", 3)]
    assert len(sched.running) == 2


def test_preemption_of_newest_running_sequence():
    sched, bm = make_scheduler(num_blocks=3, block_size=4, prefix_caching=False)
    a, b, c = make_seq(4, "a", 0, 0), make_seq(3, "b", 1, 100), make_seq(3, "c", 2, 200)
    for s in (a, b, c):
        sched.add(s)
    apply(sched.schedule(), bm)
    assert bm.num_free_blocks == 0
    # a now needs a second block: c (newest) is preempted, b keeps running.
    c_block = c.block_table[0]
    out = sched.schedule()
    assert out.preempted == [c]
    assert plan(out) == [("a", 1), ("b", 1)]
    assert c_block in a.block_table
    assert sched.running == [a, b]
    assert list(sched.waiting) == [c]
    assert c.status is SequenceStatus.WAITING
    assert c.num_computed_tokens == 0 and c.block_table == [] and c.num_hashed_blocks == 0
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert c.num_tokens == 4  # its sampled token is kept and will be recomputed
    assert c.num_cached_tokens == 0  # first-scheduling value is kept


def test_preemption_puts_victims_at_the_front_and_blocks_new_admissions():
    sched, bm = make_scheduler(num_blocks=3, block_size=4, prefix_caching=False)
    a, b, c = (make_seq(4, n, i, 100 * i) for i, n in enumerate("abc"))
    for s in (a, b, c):
        sched.add(s)
    apply(sched.schedule(), bm)  # each has 4 computed tokens in 1 block, then a 5th token
    d = make_seq(2, "d", 3, 900)
    sched.add(d)
    out = sched.schedule()
    # a takes c's block; b then needs one, and is itself the newest left: preempted too.
    assert out.preempted == [c, b]
    assert plan(out) == [("a", 1)]
    assert sched.running == [a]
    assert list(sched.waiting) == [b, c, d]  # victims in front, in arrival order
    assert sched.num_preemptions == 2
    # b's block is free and the budget is there, yet d is not admitted in this step.
    assert bm.num_free_blocks == 1
    assert d.status is SequenceStatus.WAITING and d.block_table == []
    apply(out, bm)
    # Next step: admissions resume, front first (b needs 5 tokens = 2 blocks: does not fit).
    out = sched.schedule()
    assert out.preempted == []
    assert plan(out) == [("a", 1)]
    assert list(sched.waiting) == [b, c, d]


def test_preempted_sequence_recomputes_from_prefix_cache():
    sched, bm = make_scheduler(num_blocks=3, block_size=4, prefix_caching=True)
    a, b = make_seq(4, "a", 0, 0), make_seq(7, "b", 1, 100)
    sched.add(a)
    sched.add(b)
    apply(sched.schedule(), bm)  # a: 1 block; b: 2 blocks (1 full, hashed)
    out = sched.schedule()  # a needs a 2nd block: b preempted
    assert out.preempted == [b]
    apply(out, bm)
    sched.finish(a)
    out = sched.schedule()
    # b's full block survived in the prefix cache: only the rest is recomputed.
    assert plan(out) == [("b", 4)]
    assert b.num_computed_tokens == 4 and b.num_cached_tokens == 0


def test_finish_frees_blocks_at_once():
    sched, bm = make_scheduler(num_blocks=8, block_size=4, budget=6)
    a, b = make_seq(5, "a", 0), make_seq(9, "b", 1, 100)
    sched.add(a)
    sched.add(b)
    apply(sched.schedule(), bm)  # a all 5, b 1 token (chunked)
    assert bm.num_used_blocks == 2 + 1
    sched.finish(a)
    assert a.status is SequenceStatus.FINISHED and a.block_table == []
    assert a not in sched.running and bm.num_used_blocks == 1
    sched.finish(b)  # running, mid-prefill
    assert bm.num_used_blocks == 0 and sched.running == []
    # A waiting sequence holding imported blocks.
    c = make_seq(9, "c", 2, 200)
    c.block_table.extend(bm.allocate_blocks(2))
    c.num_computed_tokens = 8
    sched.add(c)
    assert bm.num_used_blocks == 2
    sched.finish(c)
    assert c.status is SequenceStatus.FINISHED and not sched.waiting
    assert bm.num_used_blocks == 0 and not sched.has_unfinished()
    # A waiting sequence with no blocks.
    d = make_seq(3, "d", 3)
    sched.add(d)
    sched.finish(d)
    assert not sched.has_unfinished()


@pytest.mark.parametrize("num_computed", [8, 6])
def test_sequence_with_imported_blocks_computes_only_the_rest(num_computed):
    sched, bm = make_scheduler(num_blocks=16, block_size=4)
    # The same prompt is in the prefix cache; an imported sequence must not use it.
    cached = make_seq(10, "cached")
    sched.add(cached)
    apply(sched.schedule(), bm)
    seq = make_seq(10, "imported", 1)
    imported = bm.allocate_blocks(bm.blocks_needed(num_computed))
    seq.block_table.extend(imported)
    seq.num_computed_tokens = num_computed
    seq.num_cached_tokens = 3
    sched.add(seq)
    out = sched.schedule()
    assert plan(out) == [("cached", 1), ("imported", 10 - num_computed)]
    assert seq.block_table[: len(imported)] == imported
    assert len(seq.block_table) == 3
    assert seq.num_computed_tokens == num_computed
    assert seq.num_cached_tokens == 3  # set by the import, not overwritten
    assert [bm.ref_counts[x] for x in imported] == [1] * len(imported)
    apply(out, bm)
    assert seq.num_tokens == 11  # sampled right after the tail was computed


def test_chunked_prefill_disabled_does_not_split_prompts():
    sched, bm = make_scheduler(budget=8, chunked=False)
    a, b, c = make_seq(6, "a", 0), make_seq(5, "b", 1, 100), make_seq(2, "c", 2, 200)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    # b does not fit the 2 tokens left and is not split; c waits behind it.
    assert plan(out) == [("a", 6)]
    assert list(sched.waiting) == [b, c]
    apply(out, bm)
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("b", 5), ("c", 2)]
    # A prompt exactly the size of the budget fits whole.
    sched2, _ = make_scheduler(budget=8, chunked=False)
    sched2.add(make_seq(8, "x"))
    assert plan(sched2.schedule()) == [("x", 8)]


def test_chunked_prefill_disabled_preempted_sequence_longer_than_budget_is_rescheduled():
    sched, bm = make_scheduler(num_blocks=4, block_size=4, budget=8, chunked=False, prefix_caching=False)
    b, a = make_seq(2, "b", 0, 100), make_seq(6, "a", 1, 0)
    sched.add(b)
    sched.add(a)
    for _ in range(4):
        apply(sched.schedule(), bm)
    # a grew to 9 tokens and needed a third block; b took the last free one: a (newest) is preempted.
    assert a.num_preemptions == 1 and a.num_tokens == 9 and list(sched.waiting) == [a]
    sched.finish(b)
    assert bm.num_free_blocks == 4 and sched.has_unfinished()
    scheduled = [plan(sched.schedule()) for _ in range(3)]
    assert any(scheduled), "a is never scheduled again although the engine is otherwise idle"


def test_a_step_carrying_decodes_takes_at_most_the_prefill_cap_of_prompt_tokens():
    sched, bm = make_scheduler(budget=64)
    sched.prefill_cap = 8
    decoding = make_seq(4, "decoding", 0)
    sched.add(decoding)
    apply(sched.schedule(), bm)  # nothing decodes yet: the whole prompt at once, whatever the cap
    assert decoding.num_computed_tokens == 4
    long, short = make_seq(20, "long", 1, base=100), make_seq(6, "short", 2, base=200)
    sched.add(long)
    sched.add(short)
    steps = []
    while long.num_computed_tokens < 20 or short.num_computed_tokens < 6:
        out = sched.schedule()
        steps.append(plan(out))
        prompt_tokens = sum(n for rid, n in plan(out) if rid != "decoding")
        assert prompt_tokens <= 8 and ("decoding", 1) in plan(out)  # the decode is never left out
        apply(out, bm)
    assert steps[0] == [("decoding", 1), ("long", 8)]  # in arrival order: the long prompt's chunk first
    assert steps[1] == [("decoding", 1), ("long", 8)]
    assert steps[2] == [("decoding", 1), ("long", 4), ("short", 4)]
    assert steps[3] == [("decoding", 1), ("long", 1), ("short", 2)]  # the long prompt decodes now too


def test_without_decodes_the_prefill_cap_does_not_apply_and_an_imported_prompt_decodes_at_once():
    sched, bm = make_scheduler(budget=64)
    sched.prefill_cap = 8
    alone = make_seq(30, "alone")
    sched.add(alone)
    assert plan(sched.schedule()) == [("alone", 30)]  # nobody waits for it: the whole budget

    sched, bm = make_scheduler(budget=64)
    decoding = make_seq(4, "decoding")
    sched.add(decoding)
    apply(sched.schedule(), bm)
    sched.prefill_cap = 0  # no chunk at all beside decodes
    # Two loads end (see `load_finished`), each holding its blocks.
    imported = make_seq(8, "imported", 1, base=50)  # a prefill worker computed its prompt and first token
    imported.token_ids.append(7)
    partly = make_seq(12, "partly", 2, base=80)  # 8 tokens of its prompt loaded from the kv-store
    for seq, loaded in ((imported, 8), (partly, 8)):
        assert bm.allocate(seq, seq.num_tokens)
        sched.loading[seq.request_id] = (seq, loaded)
        assert sched.load_finished(seq.request_id, True) == 8
    assert imported in sched.running and list(sched.waiting) == [partly]
    fresh = make_seq(5, "fresh", 3, base=120)
    sched.add(fresh)
    assert plan(sched.schedule()) == [("decoding", 1), ("imported", 1)]  # the two chunks wait


def test_a_preempted_sequence_recomputing_past_its_prompt_is_a_chunk_and_capped_beside_decodes():
    sched, bm = make_scheduler(budget=64)
    decoding = make_seq(4, "decoding")
    sched.add(decoding)
    apply(sched.schedule(), bm)
    again = make_seq(6, "again", 1, base=50)
    again.token_ids += list(range(1, 13))  # twelve output tokens, all to compute again after a preemption
    sched.add(again)
    sched.prefill_cap = 4
    for _ in range(3):  # past its prompt (6 tokens) it is still a chunk, not a decode
        out = sched.schedule()
        assert plan(out) == [("decoding", 1), ("again", 4)]
        apply(out, bm)
