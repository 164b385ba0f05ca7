"""The stall-free pacer: prompt tokens a step carrying decodes may take, learnt from the steps it sees."""

import pytest

from shared.engine.config import EngineConfig
from shared.engine.prefill_pacer import START_TOKENS, PrefillPacer


def test_before_any_step_it_allows_the_start_chunk_then_the_target_over_a_tokens_cost():
    pacer = PrefillPacer(target_s=0.1)
    assert pacer.cap() == START_TOKENS
    pacer.observe(step_s=0.5, prompt_tokens=250, decodes=0)  # 2 ms a token, nothing beside it
    assert pacer.cap() == 50


def step_s(tokens: int, threads: int = 1) -> float:
    """A made-up core: decodes take 40 ms a step, a prompt token 2 ms; two threads halve both."""
    return (0.040 + 0.002 * tokens) / threads


def test_a_step_beside_decodes_takes_what_fits_beside_them():
    pacer = PrefillPacer(target_s=0.1)
    pacer.observe(step_s(0), prompt_tokens=0, decodes=6)
    pacer.observe(step_s(64), prompt_tokens=64, decodes=6)
    assert pacer.cap() == 30  # (100 - 40) ms over 2 ms a token
    assert step_s(pacer.cap()) == pytest.approx(0.1)


def test_a_prompt_alone_teaches_the_token_cost_without_overshooting_the_next_mixed_step():
    """Learnt from a step with no decodes (a prompt arriving at an idle worker), the cost is the token's alone:
    the next step beside decodes still leaves room for them."""
    pacer = PrefillPacer(target_s=0.1)
    pacer.observe(step_s(0), prompt_tokens=0, decodes=3)
    pacer.observe(0.002 * 128, prompt_tokens=128, decodes=0)
    assert step_s(pacer.cap()) == pytest.approx(0.1)


def test_fed_back_without_any_decode_only_step_a_mixed_step_settles_near_the_target():
    """Before any step of decodes alone, the whole step counts as the prompt's: it errs small, then settles."""
    pacer = PrefillPacer(target_s=0.1)
    pacer.observe(step_s(START_TOKENS), prompt_tokens=START_TOKENS, decodes=6)
    for _ in range(30):
        tokens = pacer.cap()
        pacer.observe(step_s(tokens), prompt_tokens=tokens, decodes=6)
    assert abs(step_s(pacer.cap()) - 0.1) < 0.01


def test_each_team_size_learns_its_own_costs():
    """Costs learnt on two threads (a borrowed CPU) never size a step on one, which would take twice the target."""
    pacer = PrefillPacer(target_s=0.1)
    for threads in (2, 1):
        pacer.observe(step_s(0, threads), prompt_tokens=0, decodes=6, threads=threads)
        pacer.observe(step_s(64, threads), prompt_tokens=64, decodes=6, threads=threads)
    assert step_s(pacer.cap(1), 1) == pytest.approx(0.1)
    assert step_s(pacer.cap(2), 2) == pytest.approx(0.1)
    assert pacer.cap(2) > pacer.cap(1)
    assert pacer.cap(4) == START_TOKENS  # never seen: the start chunk


def test_steps_with_a_token_or_two_of_prompt_do_not_move_it_and_it_never_stops_progress():
    pacer = PrefillPacer(target_s=0.1, floor_tokens=16)
    pacer.observe(step_s=0.05, prompt_tokens=1, decodes=3)  # a decode step beside an imported request's last token
    assert pacer.costs[1].token_s is None
    pacer.observe(step_s=10.0, prompt_tokens=20, decodes=3)  # a machine far too slow for the target
    assert pacer.cap() == 16
    pacer.observe(step_s=0.5, prompt_tokens=0, decodes=64)  # decodes alone take longer than the target
    assert pacer.cap() == 16


def test_the_target_is_checked():
    with pytest.raises(ValueError):
        PrefillPacer(target_s=0)
    with pytest.raises(ValueError, match="prefill_beside_decodes_ms"):
        EngineConfig(model="m", prefill_beside_decodes_ms=-5)
