"""The SLO planner's policy, as tables: what it predicts, what it wants, and when it changes the pools."""

import math

import pytest

from services.planner.policy import (
    DecodePool,
    Observation,
    PlannerState,
    Policy,
    PrefillPool,
    Slo,
    decide,
    correction,
    desired,
    predicted_itl_ms,
    predicted_ttft_ms,
)

SLO = Slo(ttft_ms=1000, itl_ms=50)


def prefill(workers=1, tokens_per_s=500.0, capacity=2000.0, prompt=256.0, queued=0) -> PrefillPool:
    return PrefillPool(workers, tokens_per_s, capacity, prompt, queued)


def decode(workers=1, running=8, fixed=20.0, per_seq=2.0) -> DecodePool:
    return DecodePool(workers, running, fixed, per_seq)


def observe(p=None, d=None, at_s=100.0, ttft=None, itl=None) -> Observation:
    return Observation(at_s, p or prefill(), d or decode(), ttft, itl)


@pytest.mark.parametrize("pool, workers, expected", [
    (prefill(tokens_per_s=0, capacity=1000, prompt=500), 1, 500.0),  # idle: just the prompt's own time
    (prefill(tokens_per_s=500, capacity=1000, prompt=500), 1, 1000.0),  # half busy: stretched by 1 / (1 - 0.5)
    (prefill(tokens_per_s=500, capacity=1000, prompt=500), 2, 500 / 0.75),
    (prefill(tokens_per_s=0, capacity=1000, prompt=0, queued=2000), 2, 1000.0),  # a backlog drains over both
    (prefill(tokens_per_s=1000, capacity=1000), 1, math.inf),  # saturated
    (prefill(capacity=0), 3, math.inf),  # not measured
    (prefill(), 0, math.inf),
])
def test_predicted_ttft(pool, workers, expected):
    assert predicted_ttft_ms(pool, workers) == pytest.approx(expected)


@pytest.mark.parametrize("pool, workers, expected", [
    (decode(running=8, fixed=20, per_seq=2), 1, 36.0),
    (decode(running=8, fixed=20, per_seq=2), 2, 28.0),
    (decode(running=0, fixed=20, per_seq=2), 4, 20.0),
    (decode(fixed=0), 2, math.inf),
])
def test_predicted_itl(pool, workers, expected):
    assert predicted_itl_ms(pool, workers) == pytest.approx(expected)


@pytest.mark.parametrize("obs, policy, expected", [
    # Light load: one prefill worker meets its SLO by a wide margin (170 ms); one decode worker would be 36 ms,
    # within 0.8 * 50 but not within the 0.5 * 50 a pool shrinks to: decode keeps two.
    (observe(prefill(workers=2), decode(workers=2)), Policy(budget=4), (1, 2)),
    # ... and with a shrink headroom as wide as the growth's, both shrink.
    (observe(prefill(workers=2), decode(workers=2)), Policy(budget=4, shrink_headroom=0.8), (1, 1)),
    # Long prompts arriving fast: prefill needs 3 (800 ms at headroom 0.8 of 1000 ms).
    (observe(prefill(tokens_per_s=3000, capacity=2000, prompt=512)), Policy(budget=8), (3, 1)),
    # Many streams: decode needs 3 for 20 + 2 * 24 / n <= 40.
    (observe(d=decode(running=24)), Policy(budget=8), (1, 3)),
    # Both want more than 4 cores hold: shared so the worse ratio is smallest.
    (observe(prefill(tokens_per_s=3000, capacity=2000, prompt=512), decode(running=48)), Policy(budget=4), (2, 2)),
    # Colocated: no prefill pool, the budget is decode's.
    (observe(prefill(workers=0, capacity=0), decode(running=24)), Policy(budget=4, min_prefill=0), (0, 3)),
])
def test_desired(obs, policy, expected):
    assert desired(obs, SLO, policy)[:2] == expected


def test_a_measured_miss_adds_a_worker_where_the_model_says_enough():
    obs = observe(d=decode(workers=2, running=2), itl=80.0)  # the fit says 22 ms; the workers say 80
    want_p, want_d, why = desired(obs, SLO, Policy(budget=4))
    assert (want_p, want_d) == (1, 3)
    assert "itl p90 80 ms over its slo" in why


def test_a_pool_near_its_slo_does_not_shrink_on_the_models_word():
    obs = observe(d=decode(workers=3, running=2), itl=45.0)  # past 0.8 * 50, under 50
    assert desired(obs, SLO, Policy(budget=4))[1] == 3


@pytest.mark.parametrize("workers, running, expected", [
    (4, 0, 1),  # idle: 20 ms with one, within 0.5 * 50
    (4, 4, 2),  # 20 + 2 * 4 / n: 28 ms with one is past 25, 24 ms with two within it
    (4, 8, 4),  # 36, 28, 25.3 ms with 1, 2, 3: none within 25, so all four stay (growth would allow one at 36)
    (2, 8, 2),  # 36 ms with one: within the 40 growth would allow, not within 25: no removal
])
def test_a_pool_shrinks_only_to_what_is_predicted_within_the_shrink_headroom(workers, running, expected):
    obs = observe(prefill(workers=1, tokens_per_s=0), decode(workers=workers, running=running))
    assert desired(obs, SLO, Policy(budget=8))[1] == expected


def test_a_shrink_headroom_over_the_headroom_is_refused():
    with pytest.raises(ValueError, match="shrink_headroom"):
        Policy(budget=4, headroom=0.6, shrink_headroom=0.7)


def test_unmeasured_pools_stay_as_they_are():
    obs = observe(prefill(workers=2, capacity=0), decode(workers=2, fixed=0))
    want_p, want_d, why = desired(obs, SLO, Policy(budget=4))
    assert (want_p, want_d) == (2, 2)
    assert "not measured" in why


def run(observations, policy, state=PlannerState()):
    decisions = []
    for obs in observations:
        decision, state = decide(obs, SLO, policy, state)
        decisions.append(decision)
    return decisions, state


def test_a_change_waits_for_patience_then_moves_one_worker():
    busy = [observe(d=decode(running=48), at_s=t) for t in (100, 105, 110)]
    decisions, _ = run(busy, Policy(budget=8, patience=3, cooldown_s=0))
    assert [d.action for d in decisions] == ["hold", "hold", "add"]
    assert "waiting (1/3)" in decisions[0].reason
    assert (decisions[-1].prefill, decisions[-1].decode) == (1, 2)  # one step of the two it wants


def test_a_streak_breaks_when_the_want_goes_away():
    busy, calm = observe(d=decode(running=48)), observe()
    decisions, state = run([busy, busy, calm, busy, busy], Policy(budget=8, patience=3, cooldown_s=0))
    assert [d.action for d in decisions] == ["hold"] * 5
    assert state.streak == 2


def test_cooldown_holds_the_next_change():
    policy = Policy(budget=8, patience=1, cooldown_s=30)
    obs = [observe(d=decode(workers=w, running=48), at_s=t) for w, t in ((1, 100), (2, 110), (2, 131))]
    decisions, _ = run(obs, policy)
    assert [d.action for d in decisions] == ["add", "hold", "add"]
    assert decisions[1].reason.startswith("cooling down")


def test_a_full_budget_switches_a_worker_between_roles():
    obs = observe(prefill(workers=1, tokens_per_s=3000, capacity=2000, prompt=512), decode(workers=3, running=4))
    decision, _ = decide(obs, SLO, Policy(budget=4, patience=1, cooldown_s=0), PlannerState())
    assert (decision.action, decision.prefill, decision.decode) == ("switch", 2, 2)


def test_idle_pools_shrink_to_their_minimum():
    obs = observe(prefill(workers=3, tokens_per_s=0), decode(workers=3, running=0))
    decision, _ = decide(obs, SLO, Policy(budget=6, patience=1, cooldown_s=0, shrink_after_s=0), PlannerState())
    assert (decision.action, decision.prefill, decision.decode) == ("remove", 2, 2)


def test_a_pool_shrinks_only_after_wanting_fewer_for_the_whole_window():
    policy = Policy(budget=6, patience=1, cooldown_s=0, shrink_after_s=60)
    idle = [observe(prefill(workers=1), decode(workers=3, running=0), at_s=t) for t in (100, 130, 159, 160)]
    decisions, _ = run(idle, policy)
    assert [d.action for d in decisions] == ["hold", "hold", "hold", "remove"]
    assert "fewer wanted for 30 s of 60" in decisions[1].reason
    assert (decisions[-1].prefill, decisions[-1].decode) == (1, 2)


def test_a_busy_evaluation_restarts_the_shrink_window():
    policy = Policy(budget=6, patience=1, cooldown_s=0, shrink_after_s=60)
    idle = lambda t: observe(prefill(workers=1), decode(workers=3, running=0), at_s=t)  # noqa: E731
    busy = observe(prefill(workers=1), decode(workers=3, running=24), at_s=140)  # wants all 3
    decisions, state = run([idle(100), idle(130), busy, idle(150), idle(200), idle(210)], policy)
    assert [d.action for d in decisions] == ["hold"] * 5 + ["remove"]  # 60 s from 150, not from 100
    assert state.fewer_since == (None, None)  # a change restarts every window


def test_a_growing_pool_takes_a_worker_the_other_does_not_want_before_a_new_one():
    # room in the budget for a new prefill worker, but the decode pool has one it does not need
    obs = observe(prefill(workers=1, tokens_per_s=3000, capacity=2000, prompt=512), decode(workers=3, running=0))
    decision, _ = decide(obs, SLO, Policy(budget=8, patience=1, cooldown_s=0), PlannerState())
    assert (decision.action, decision.prefill, decision.decode) == ("switch", 2, 2)
    at_minimum = observe(prefill(workers=1, tokens_per_s=3000, capacity=2000, prompt=512),
                         decode(workers=1, running=0))
    decision, _ = decide(at_minimum, SLO, Policy(budget=8, patience=1, cooldown_s=0), PlannerState())
    assert (decision.action, decision.prefill, decision.decode) == ("add", 2, 1)


def test_a_shrink_window_below_zero_is_refused():
    with pytest.raises(ValueError, match="shrink_after_s"):
        Policy(budget=4, shrink_after_s=-1)


def test_over_the_budget_gives_back_prefill_first():
    obs = observe(prefill(workers=2), decode(workers=3))
    decision, _ = decide(obs, SLO, Policy(budget=4, patience=1, cooldown_s=0), PlannerState())
    assert (decision.prefill, decision.decode) == (1, 3)
    assert "over the budget" in decision.reason


def test_a_minimum_pool_never_gives_a_worker_away():
    obs = observe(prefill(workers=1, tokens_per_s=0), decode(workers=1, running=48))
    decision, _ = decide(obs, SLO, Policy(budget=2, patience=1, cooldown_s=0), PlannerState())
    assert (decision.prefill, decision.decode) == (1, 1)


@pytest.mark.parametrize("kwargs", [dict(budget=1), dict(budget=4, headroom=0), dict(budget=4, patience=0),
                                    dict(budget=4, min_decode=0)])
def test_a_policy_that_cannot_hold_is_refused(kwargs):
    with pytest.raises(ValueError):
        Policy(**kwargs)


@pytest.mark.parametrize("measured, predicted, factor", [
    (None, 100.0, 1.0), (50.0, 100.0, 0.5), (300.0, 100.0, 3.0),
    (1000.0, 100.0, 4.0), (1.0, 100.0, 0.25),  # within the limit either way
    (50.0, math.inf, 1.0), (50.0, 0.0, 1.0), (0.0, 100.0, 1.0),
])
def test_the_correction_is_measured_over_predicted_within_limits(measured, predicted, factor):
    assert correction(measured, predicted) == pytest.approx(factor)


def test_a_model_that_overestimates_is_corrected_by_the_measurement():
    # The queueing model says 1000 ms with one prefill worker (over 0.8 * 1000): alone it wants a second one;
    # the workers measure 400 ms, so every prediction is scaled by 0.4 and one worker is enough.
    busy = prefill(tokens_per_s=500, capacity=1000, prompt=500)
    assert desired(observe(busy), SLO, Policy(budget=4))[0] == 2
    assert desired(observe(busy, ttft=400.0), SLO, Policy(budget=4))[0] == 1


def test_a_model_that_underestimates_is_corrected_before_the_miss():
    # The fit says 36 ms with one decode worker (within 0.8 * 50); the workers measure 45 ms: corrected, one
    # worker is predicted past the headroom and two are wanted before the SLO is missed.
    assert desired(observe(d=decode(running=8)), SLO, Policy(budget=4))[1] == 1
    want = desired(observe(d=decode(running=8), itl=45.0), SLO, Policy(budget=4))
    assert want[1] == 2 and "itl predicted 45 ms with 1" in want[2]
