"""The batch's places between tenants as pure functions (`shared.engine.batch_share`), then in the scheduler: a
tenant holding the batch gives a place to another's waiting request, by fewest places held and by priority."""

import pytest

from shared.engine.batch_share import Claim, goes_ahead, next_waiting, places_to_give, shortage_victim, victim
from shared.engine.sampling_params import SamplingParams
from shared.engine.sequence import SequenceStatus
from test_scheduler import apply, make_scheduler, make_seq, plan

Q, N, LOW, HIGH = Claim("quiet"), Claim("noisy"), Claim("batch", -1), Claim("urgent", 1)


@pytest.mark.parametrize("waiting, held, expected", [
    ([N, N, Q], {"noisy": 5}, 2),  # the tenant holding fewer places first
    ([N, Q, N], {"noisy": 0, "quiet": 3}, 0),
    ([N, Q], {}, 0),  # equal: arrival order
    ([Q, N, HIGH], {"urgent": 9}, 2),  # priority before places held
    ([LOW, N], {}, 1),
    ([N, N, N], {"noisy": 4}, 0),  # one tenant: first come first served
])
def test_next_waiting(waiting, held, expected):
    assert next_waiting(waiting, held) == expected


@pytest.mark.parametrize("claimant, running, held, expected", [
    (Q, [N, N, N], {"noisy": 3}, 2),  # the newest of the tenant holding the most
    (Q, [N, N, Q], {"noisy": 2, "quiet": 1}, None),  # two against one: a swap would only turn it round
    (Q, [N, N, N, Q], {"noisy": 3, "quiet": 1}, 2),
    (N, [N, N], {"noisy": 2}, None),  # its own tenant's places are not taken
    (Q, [Q, Q], {"quiet": 2}, None),
    (Q, [LOW, N, LOW, N], {"batch": 2, "noisy": 2}, 2),  # a lower priority gives first, however few it holds
    (LOW, [N, N, N], {"noisy": 3}, None),  # a lower priority takes from no one
    (HIGH, [N, Q, N], {"noisy": 2, "quiet": 1}, 2),  # the lowest priority's newest
    (Q, [Claim("a"), Claim("b"), Claim("b"), Claim("a")], {"a": 2, "b": 2}, 3),  # ties: by name, newest
    (Q, [], {}, None),
])
def test_victim(claimant, running, held, expected):
    assert victim(claimant, running, held) == expected


@pytest.mark.parametrize("running, held, expected", [
    ([N, N, N], {"noisy": 3}, 2),  # one tenant: the newest, as first come first served
    ([N, N, Q], {"noisy": 2, "quiet": 1}, 1),  # the newest of the tenant holding the most
    ([N, Q], {"noisy": 1, "quiet": 1}, 1),  # equal: the newest
    ([HIGH, N, N, LOW, Q], {"urgent": 1, "noisy": 2, "batch": 1, "quiet": 1}, 3),  # the lowest priority first
    ([LOW, N, LOW], {"batch": 2, "noisy": 1}, 2),
    ([HIGH, N, N, Q], {"urgent": 1, "noisy": 2, "quiet": 1}, 2),  # never the higher priority while others run
])
def test_shortage_victim(running, held, expected):
    assert shortage_victim(running, held) == expected


@pytest.mark.parametrize("claimant, running, held, expected", [
    (Q, [N, N, Q], {"noisy": 2, "quiet": 1}, False),  # one place fewer is not "under its share"
    (Q, [N, N, N, Q], {"noisy": 3, "quiet": 1}, True),
    (Q, [N, N], {"noisy": 2}, True),
    (N, [N, N, Q], {"noisy": 2, "quiet": 1}, False),  # the tenant holding more waits its turn
    (N, [N, N], {"noisy": 2}, False),  # one tenant: first come first served
    (HIGH, [N], {"noisy": 1}, True),  # above a running priority, however many it holds
    (HIGH, [HIGH, HIGH, HIGH], {"urgent": 3}, False),
    (LOW, [N, N, N], {"noisy": 3}, False),  # a lower priority goes ahead of no one
    (Q, [LOW, LOW, LOW], {"batch": 3}, True),
    (Q, [], {}, False),  # nothing running: nothing to go ahead of
])
def test_goes_ahead(claimant, running, held, expected):
    assert goes_ahead(claimant, running, held) == expected


def test_places_to_give_share_a_full_batch_until_the_counts_are_within_one():
    running = [N] * 6
    waiting = [N, Q, Q, Q, Q, Q]
    given = places_to_give(waiting, running, {"noisy": 6}, 0)
    assert given == [5, 4, 3]  # 3 and 3 then: the next quiet one waits, as does the waiting noisy one
    assert places_to_give(waiting, running, {"noisy": 6}, 2) == [5, 4]  # two free places first: 4 and 4
    assert places_to_give([N, N], running, {"noisy": 6}, 0) == []


def seq_of(rid: str, tenant: str, num_tokens: int = 4, priority: int = 0, arrival: int = 0):
    seq = make_seq(num_tokens, rid, arrival, base=100 * arrival)
    seq.params = SamplingParams(tenant=tenant, priority=priority)
    return seq


def run_until_all_sampled(sched, bm, seqs):
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()
    apply(out, bm)
    return out


def test_a_full_batch_of_one_tenant_gives_a_place_to_another_tenants_request_at_once():
    sched, bm = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=3)
    noisy = [seq_of(f"n{i}", "noisy", arrival=i) for i in range(5)]
    run_until_all_sampled(sched, bm, noisy)
    assert [s.request_id for s in sched.running] == ["n0", "n1", "n2"]
    quiet = seq_of("q", "quiet", arrival=9)
    sched.add(quiet)
    out = sched.schedule()
    assert quiet.status is SequenceStatus.RUNNING and quiet in [s.seq for s in out.scheduled]
    # the newest running noisy request gave its place; it waits first in line among its tenant's
    assert noisy[2].status is SequenceStatus.WAITING and noisy[2].num_computed_tokens == 0
    assert [s.request_id for s in sched.waiting] == ["n2", "n3", "n4"]
    assert sched.num_preemptions == 1 and not out.preempted  # a shortage of blocks is not what preempted it
    apply(out, bm)
    # one place more for the quiet tenant (2 against 1) would turn it round: a second quiet request waits
    sched.add(seq_of("q2", "quiet", arrival=10))
    out = sched.schedule()
    assert [s.request_id for s in sched.running] == ["n0", "n1", "q"] and sched.num_preemptions == 1


def test_one_tenant_and_one_priority_stay_first_come_first_served_without_preemption():
    sched, bm = make_scheduler(max_num_seqs=2)
    seqs = [seq_of(f"a{i}", "a", arrival=i) for i in range(4)]
    run_until_all_sampled(sched, bm, seqs)
    sched.add(seq_of("a9", "a", arrival=9))
    sched.schedule()
    assert [s.request_id for s in sched.running] == ["a0", "a1"] and sched.num_preemptions == 0
    assert [s.request_id for s in sched.waiting] == ["a2", "a3", "a9"]


def test_a_freed_place_goes_to_the_tenant_holding_fewer_and_priority_goes_first():
    sched, bm = make_scheduler(max_num_seqs=2)
    first = [seq_of("n0", "noisy", arrival=0), seq_of("q0", "quiet", arrival=1)]
    run_until_all_sampled(sched, bm, first)
    for seq in (seq_of("n1", "noisy", arrival=2), seq_of("n2", "noisy", arrival=3),
                seq_of("q1", "quiet", arrival=4)):
        sched.add(seq)
    sched.schedule()
    assert sched.num_preemptions == 0  # one place each: nothing to take
    sched.finish(first[0])  # quiet holds 1, noisy 0: noisy's next goes
    sched.schedule()
    assert {s.request_id for s in sched.running} == {"q0", "n1"}
    sched.finish(first[1])  # quiet 0, noisy 1: quiet's next, ahead of the earlier noisy one
    sched.schedule()
    assert {s.request_id for s in sched.running} == {"n1", "q1"}
    urgent = seq_of("u", "urgent", priority=1, arrival=5)
    sched.add(urgent)
    sched.schedule()  # a higher priority takes the newest place of the lowest
    assert {s.request_id for s in sched.running} == {"n1", "u"} and sched.num_preemptions == 1


def test_first_come_first_served_takes_no_place_from_anyone():
    sched, bm = make_scheduler(max_num_seqs=2)
    sched.config.policy = "fcfs"
    run_until_all_sampled(sched, bm, [seq_of(f"n{i}", "noisy", arrival=i) for i in range(3)])
    sched.add(seq_of("u", "urgent", priority=1, arrival=9))
    sched.schedule()
    assert [s.request_id for s in sched.running] == ["n0", "n1"] and sched.num_preemptions == 0
    assert [s.request_id for s in sched.waiting] == ["n2", "u"]


def test_a_place_given_up_is_not_taken_back_in_the_same_step_while_its_taker_awaits_an_offer():
    from shared.engine.block_manager import BlockManager
    from shared.engine.kv_connector import KVConnector, KVConnectors
    from shared.engine.scheduler import Scheduler, SchedulerConfig
    from test_scheduler import FP

    class NotYet(KVConnector):  # the kv-store's answer for "q" has not come back yet
        answered = False

        def external_prefix(self, request_id, token_ids, num_local_tokens):
            return 0 if request_id != "q" or self.answered else None

    connectors, pending = KVConnectors(), NotYet()
    connectors.connect(pending)
    bm = BlockManager(64, 4, FP, True)
    sched = Scheduler(SchedulerConfig(2, 2048), bm, connectors)
    run_until_all_sampled(sched, bm, [seq_of(f"n{i}", "noisy", arrival=i) for i in range(2)])
    sched.add(seq_of("q", "quiet", arrival=5))
    out = sched.schedule()
    assert [s.request_id for s in sched.running] == ["n0"]  # n1 gave its place up and does not take it back
    assert [s.request_id for s in sched.waiting] == ["q", "n1"] and "n1" not in [s.seq.request_id for s in out.scheduled]
    apply(out, bm)
    pending.answered = True
    sched.schedule()  # the place still free: q takes it, with nothing more preempted
    assert [s.request_id for s in sched.running] == ["n0", "q"] and sched.num_preemptions == 1


def blocks_short_for(tokens_by_request: list[tuple[str, str, int]], num_blocks: int):
    """A scheduler with `num_blocks` blocks of 4 tokens whose requests (id, tenant, prompt tokens) ran one step,
    admitted in this order."""
    sched, bm = make_scheduler(num_blocks=num_blocks, block_size=4, prefix_caching=False)
    sched.config.policy = "fcfs"
    seqs = [seq_of(rid, tenant, num_tokens, arrival=i) for i, (rid, tenant, num_tokens) in enumerate(tokens_by_request)]
    run_until_all_sampled(sched, bm, seqs)
    assert [s.request_id for s in sched.running] == [rid for rid, _, _ in tokens_by_request]
    sched.config.policy = "fair"
    return sched, bm


def test_a_block_shortage_preempts_the_tenant_holding_the_most_not_the_newest_request():
    # each holds one block and now needs a second; one is free
    sched, _ = blocks_short_for([("n0", "noisy", 4), ("n1", "noisy", 4), ("q", "quiet", 4)], num_blocks=4)
    out = sched.schedule()
    assert [s.request_id for s in out.preempted] == ["n1"]  # first come first served would have preempted q
    assert plan(out) == [("n0", 1), ("q", 1)]
    assert [s.request_id for s in sched.running] == ["n0", "q"] and [s.request_id for s in sched.waiting] == ["n1"]


def test_a_block_shortage_unschedules_an_older_request_of_the_tenant_holding_the_most():
    # n0 and n1 still fit their first block; q, the newest, needs a second and none is free
    sched, bm = blocks_short_for([("n0", "noisy", 3), ("n1", "noisy", 3), ("q", "quiet", 4)], num_blocks=3)
    n1_block = sched.running[1].block_table[0]
    out = sched.schedule()
    assert [s.request_id for s in out.preempted] == ["n1"] and plan(out) == [("n0", 1), ("q", 1)]
    assert n1_block in sched.running[1].block_table and bm.num_free_blocks == 0
    apply(out, bm)
    assert [s.num_computed_tokens for s in sched.running] == [4, 5]


def test_a_block_shortage_may_preempt_an_older_request_the_step_passed_over():
    # n1 has tokens to compute again but no prompt tokens are left this step (passed over); q needs a block
    sched, bm = blocks_short_for([("n0", "noisy", 3), ("n1", "noisy", 3), ("q", "quiet", 4)], num_blocks=3)
    sched.running[1].token_ids += [7, 8]
    sched.prefill_cap = 0
    out = sched.schedule()
    assert [s.request_id for s in out.preempted] == ["n1"] and plan(out) == [("n0", 1), ("q", 1)]


def decoding(sched, bm, seqs):
    """`seqs` admitted and past their prompts: each decodes from the next step on."""
    for seq in seqs:
        sched.add(seq)
    while any(s.num_uncomputed_tokens > 1 for s in seqs):
        apply(sched.schedule(), bm)


def test_a_tenant_under_its_share_has_its_prompt_computed_in_a_step_before_the_others_decodes():
    sched, bm = make_scheduler(num_blocks=256, max_num_seqs=8)
    noisy = [seq_of(f"n{i}", "noisy", arrival=i) for i in range(4)]
    decoding(sched, bm, noisy)
    quiet, quiet2 = seq_of("q", "quiet", num_tokens=12, arrival=9), seq_of("q2", "quiet", arrival=10)
    sched.add(quiet)
    out = sched.schedule()
    assert plan(out) == [("q", 12)]  # alone: the noisy decodes wait one short step
    apply(out, bm)
    sched.add(quiet2)
    out = sched.schedule()  # never two such steps in a row: the decodes now, and the waiting prompt beside them
    assert plan(out) == [("n0", 1), ("n1", 1), ("n2", 1), ("n3", 1), ("q", 1), ("q2", 4)]
    apply(out, bm)
    sched.add(seq_of("q3", "quiet", arrival=11))
    assert [r for r, _ in plan(sched.schedule())] == ["q3"]  # quiet holds 2 against 4: it still goes ahead


def test_a_prompt_longer_than_the_cap_beside_decodes_is_chunked_beside_them_not_run_ahead():
    sched, bm = make_scheduler(num_blocks=256, max_num_seqs=8)
    decoding(sched, bm, [seq_of(f"n{i}", "noisy", arrival=i) for i in range(3)])
    sched.prefill_cap = 8
    sched.add(seq_of("q", "quiet", num_tokens=20, arrival=9))
    assert plan(sched.schedule()) == [("n0", 1), ("n1", 1), ("n2", 1), ("q", 8)]


def test_one_tenant_and_first_come_first_served_never_run_a_prompt_ahead():
    sched, bm = make_scheduler(num_blocks=256, max_num_seqs=8)
    decoding(sched, bm, [seq_of(f"a{i}", "a", arrival=i) for i in range(3)])
    sched.add(seq_of("a9", "a", arrival=9))
    assert plan(sched.schedule()) == [("a0", 1), ("a1", 1), ("a2", 1), ("a9", 4)]
    sched, bm = make_scheduler(num_blocks=256, max_num_seqs=8)
    sched.config.policy = "fcfs"
    decoding(sched, bm, [seq_of(f"n{i}", "noisy", arrival=i) for i in range(3)])
    sched.add(seq_of("q", "quiet", arrival=9))
    assert plan(sched.schedule()) == [("n0", 1), ("n1", 1), ("n2", 1), ("q", 4)]


def test_a_prompt_that_cannot_start_ahead_leaves_the_step_to_the_decodes():
    sched, bm = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=8)  # 16 token slots in all
    decoding(sched, bm, [seq_of(f"n{i}", "noisy", num_tokens=3, arrival=i) for i in range(3)])
    sched.add(seq_of("q", "quiet", num_tokens=8, arrival=9))  # two blocks: one is free
    out = sched.schedule()
    assert plan(out) == [("n0", 1), ("n1", 1), ("n2", 1)] and not sched.went_ahead
