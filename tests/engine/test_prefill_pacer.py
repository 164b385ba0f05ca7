"""The stall-free pacer: prompt tokens a step carrying decodes may take, learnt from the steps it sees."""

import pytest

from shared.engine.config import EngineConfig
from shared.engine.prefill_pacer import START_TOKENS, PrefillPacer


def test_before_any_step_it_allows_the_start_chunk_then_the_target_over_a_tokens_cost():
    pacer = PrefillPacer(target_s=0.1)
    assert pacer.cap() == START_TOKENS
    pacer.observe(step_s=0.5, prompt_tokens=250)  # 2 ms a token
    assert pacer.cap() == 50


def test_fed_back_a_mixed_step_settles_near_the_target():
    """A step is decodes (40 ms) plus 2 ms a prompt token; the pacer sees only the total."""
    pacer = PrefillPacer(target_s=0.1)
    for _ in range(30):
        tokens = pacer.cap()
        pacer.observe(step_s=0.040 + 0.002 * tokens, prompt_tokens=tokens)
    assert abs(0.040 + 0.002 * pacer.cap() - 0.1) < 0.01


def test_steps_with_a_token_or_two_of_prompt_do_not_move_it_and_it_never_stops_progress():
    pacer = PrefillPacer(target_s=0.1, floor_tokens=16)
    pacer.observe(step_s=0.05, prompt_tokens=1)  # a decode step beside an imported request's last token
    assert pacer.seconds_per_token is None
    pacer.observe(step_s=10.0, prompt_tokens=20)  # a machine far too slow for the target
    assert pacer.cap() == 16


def test_the_target_is_checked():
    with pytest.raises(ValueError):
        PrefillPacer(target_s=0)
    with pytest.raises(ValueError, match="prefill_beside_decodes_ms"):
        EngineConfig(model="m", prefill_beside_decodes_ms=-5)
