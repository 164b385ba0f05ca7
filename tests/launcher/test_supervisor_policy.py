"""The restart policy's pure functions."""

import pytest

from services.launcher.supervisor import (
    RestartPolicy,
    backoff_delay,
    consecutive_failures,
    recent_restarts,
    should_give_up,
)


def test_backoff_doubles_from_the_base_and_is_capped():
    policy = RestartPolicy(base_delay_s=0.5, factor=2.0, max_delay_s=5.0)
    assert [backoff_delay(n, policy) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]


def test_backoff_survives_huge_failure_counts_and_nonsense_ones():
    policy = RestartPolicy(base_delay_s=1.0, factor=3.0, max_delay_s=30.0)
    assert backoff_delay(10_000, policy) == 30.0
    assert backoff_delay(0, policy) == backoff_delay(-4, policy) == 1.0


def test_a_stable_run_resets_the_failure_count():
    policy = RestartPolicy(stable_after_s=30.0)
    assert consecutive_failures(0, 0.1, policy) == 1
    assert consecutive_failures(3, 2.0, policy) == 4
    assert consecutive_failures(3, 30.0, policy) == 1
    assert consecutive_failures(7, 3600.0, policy) == 1


def test_only_restarts_inside_the_window_count():
    policy = RestartPolicy(window_s=60.0)
    assert recent_restarts([0.0, 10.0, 50.0, 100.0], now=100.0, policy=policy) == [50.0, 100.0]


def test_give_up_after_max_restarts_within_the_window():
    policy = RestartPolicy(max_restarts=3, window_s=60.0)
    assert not should_give_up([], now=0.0, policy=policy)
    assert not should_give_up([1.0, 2.0], now=3.0, policy=policy)
    assert should_give_up([1.0, 2.0, 3.0], now=4.0, policy=policy)
    # The same restarts spread over more than the window are fine.
    assert not should_give_up([1.0, 2.0, 70.0], now=75.0, policy=policy)


def test_zero_restarts_allowed_gives_up_at_the_first_death():
    assert should_give_up([], now=0.0, policy=RestartPolicy(max_restarts=0))


@pytest.mark.parametrize("bad", [dict(factor=0.5), dict(base_delay_s=-1), dict(max_restarts=-1), dict(window_s=0)])
def test_nonsense_policies_are_refused(bad):
    with pytest.raises(ValueError):
        RestartPolicy(**bad)
