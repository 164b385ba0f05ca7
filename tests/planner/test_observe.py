"""What the planner reads from two scrapes of the gateway's /metrics, as tables over exposition text built here."""

import math

import pytest

from services.planner.observe import (
    FIT_POINTS,
    History,
    Pools,
    fit_step_time,
    histogram_quantile,
    increase,
    mean_prompt_tokens,
    observe,
    parse,
    prefill_capacity,
    step_points,
    window_quantile,
)
from support.exposition import counter, gauge, histogram, steps

@pytest.mark.parametrize("buckets, q, expected", [
    ([], 0.9, None),
    ([(0.1, 0), (1.0, 0), (math.inf, 0)], 0.9, None),  # no sample
    ([(0.1, 10), (math.inf, 10)], 0.5, 0.05),  # the first bucket from 0
    ([(0.1, 0), (0.2, 10), (math.inf, 10)], 0.9, 0.19),  # linear within its bucket
    ([(0.1, 5), (0.2, 10), (math.inf, 10)], 0.9, 0.18),
    ([(0.1, 5), (0.2, 5), (math.inf, 10)], 0.9, 0.2),  # in +Inf: the highest finite bound
    ([(math.inf, 3), (0.5, 3)], 0.9, 0.45),  # in any order
])
def test_histogram_quantile_as_prometheus_does(buckets, q, expected):
    found = histogram_quantile(q, buckets)
    assert found == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize("before, after, expected_ms", [
    ({"0.01": 0, "0.1": 0, "+Inf": 0}, {"0.01": 0, "0.1": 10, "+Inf": 10}, 91.0),
    # only what the window added: the 100 fast ones before do not count
    ({"0.01": 100, "0.1": 100, "+Inf": 100}, {"0.01": 100, "0.1": 110, "+Inf": 110}, 91.0),
    ({"0.01": 5, "0.1": 5, "+Inf": 5}, {"0.01": 5, "0.1": 5, "+Inf": 5}, None),  # nothing in the window
    # the gateway restarted: its counts start again from 0
    ({"0.01": 50, "0.1": 50, "+Inf": 50}, {"0.01": 10, "0.1": 10, "+Inf": 10}, 9.0),
])
def test_window_p90_from_bucket_increases(before, after, expected_ms):
    name = "vllm:time_to_first_token_seconds"
    found = window_quantile(parse(histogram(name, before)), parse(histogram(name, after)), name, service="gateway")
    assert (None if found is None else found * 1000) == (None if expected_ms is None else pytest.approx(expected_ms))


def test_window_quantile_sums_every_matching_series():
    name = "vllm:inter_token_latency_seconds"
    two = (histogram(name, {"0.01": 0, "+Inf": 0}, 'service="gateway",instance="g0"')
           + histogram(name, {"0.01": 0, "+Inf": 0}, 'service="gateway",instance="g1"'))
    later = (histogram(name, {"0.01": 10, "+Inf": 10}, 'service="gateway",instance="g0"')
             + histogram(name, {"0.01": 0, "+Inf": 10}, 'service="gateway",instance="g1"'))
    assert window_quantile(parse(two), parse(later), name) == pytest.approx(0.01)  # half in +Inf: p90 there


def test_with_a_model_name_only_that_models_series_and_those_of_no_model_count():
    name = "vllm:inter_token_latency_seconds"
    before = (histogram(name, {"0.01": 0, "+Inf": 0}, 'model_name="a",service="gateway"')
              + histogram(name, {"0.01": 0, "+Inf": 0}, 'model_name="b",service="gateway"'))
    after = (histogram(name, {"0.01": 10, "+Inf": 10}, 'model_name="a",service="gateway"')
             + histogram(name, {"0.01": 0, "+Inf": 30}, 'model_name="b",service="gateway"'))
    assert window_quantile(parse(before, "a"), parse(after, "a"), name) == pytest.approx(0.009)  # a's alone
    assert window_quantile(parse(before), parse(after), name) == pytest.approx(0.01)  # b's slow ones counted
    plain = counter("splitserve_queue_depth", {'instance="s"': 3})
    assert parse(plain, "a") == parse(plain)  # a series of no model is everyone's


@pytest.mark.parametrize("before, after, expected", [
    ({'instance="a"': 10}, {'instance="a"': 25}, 15),
    ({'instance="a"': 10}, {'instance="a"': 4}, 4),  # restarted
    ({}, {'instance="a"': 7}, 7),  # new
    ({'instance="a"': 10, 'instance="b"': 1}, {'instance="a"': 12, 'instance="b"': 2}, 3),
])
def test_counter_increase(before, after, expected):
    name = "splitserve_prompt_tokens_computed"
    assert increase(parse(counter(name, before)), parse(counter(name, after)), f"{name}_total") == expected


@pytest.mark.parametrize("before, after, expected", [
    # 10 decode steps of 4 sequences, 0.2 s: a point at (4, 20 ms)
    (steps("decode-0"), steps("decode-0", decode=(10, 0.2, 40)), [(4.0, 20.0)]),
    (steps("decode-0", decode=(10, 0.2, 40)), steps("decode-0", decode=(12, 0.24, 44)), []),  # too few steps
    # prompt steps do not count; prefill workers are not decode workers
    (steps("decode-0"), steps("decode-0", prompt=(50, 5.0, 50), prompt_tokens=9000), []),
    (steps("prefill-0", "prefill"), steps("prefill-0", "prefill", decode=(10, 0.2, 10)), []),
    (steps("decode-0") + steps("decode-1"), steps("decode-0", decode=(5, 0.1, 5)), [(1.0, 20.0)]),  # one gone
])
def test_step_points_per_decode_worker(before, after, expected):
    found = step_points(parse(before), parse(after))
    assert [pytest.approx(point) for point in expected] == found


def test_two_decode_workers_give_a_point_each():
    def both(a, b):
        return parse(steps("decode-0", decode=a) + steps("decode-1", decode=b))

    points = step_points(both((0, 0, 0), (0, 0, 0)), both((4, 0.1, 8), (10, 0.5, 80)))
    assert points == [pytest.approx((2.0, 25.0)), pytest.approx((8.0, 50.0))]


@pytest.mark.parametrize("points, expected", [
    ([], (0.0, 0.0)),
    ([(4.0, 20.0)], (0.0, 0.0)),  # one point: no line
    ([(4.0, 20.0), (4.2, 22.0)], (0.0, 0.0)),  # too close together for a slope
    ([(1.0, 12.0), (3.0, 16.0), (5.0, 20.0)], (10.0, 2.0)),  # exact
    ([(1.0, 11.0), (1.0, 13.0), (5.0, 19.0), (5.0, 21.0)], (10.0, 2.0)),  # noise around it
    ([(1.0, 20.0), (5.0, 10.0)], (15.0, 0.0)),  # a falling line: flat at the mean
])
def test_step_time_fit(points, expected):
    assert fit_step_time(points) == pytest.approx(expected)


@pytest.mark.parametrize("before, after, expected", [
    (steps("prefill-0", "prefill"), steps("prefill-0", "prefill", prompt=(4, 2.0, 4), prompt_tokens=4000), 2000.0),
    (steps("prefill-0", "prefill"), steps("prefill-0", "prefill", prompt=(1, 0.01, 1), prompt_tokens=40), None),
    # a decode worker's prompt steps are not the prefill pool's
    (steps("decode-0"), steps("decode-0", prompt=(4, 2.0, 4), prompt_tokens=4000), None),
])
def test_prefill_capacity_per_busy_second(before, after, expected):
    assert prefill_capacity(parse(before), parse(after)) == expected


def test_mean_prompt_is_the_prefill_pools_tokens_per_remote_prefill():
    def scrape(remote, computed):
        return parse(counter("splitserve_disagg_decisions",
                             {'service="scheduler",instance="s",decision="remote"': remote,
                              'service="scheduler",instance="s",decision="local"': 99})
                     + counter("splitserve_prompt_tokens_computed",
                               {'service="prefill",instance="p"': computed, 'service="decode",instance="d"': 7}))

    assert mean_prompt_tokens(scrape(2, 100), scrape(6, 2100), prefill_workers=1) == 500
    assert mean_prompt_tokens(scrape(2, 100), scrape(2, 100), prefill_workers=1) is None


def deployment_text(running=6, waiting=0, queued=0, ttft=None, itl=None, remote=0, computed=0, worker_steps=()):
    ttft = ttft or {"0.1": 0, "1": 0, "+Inf": 0}
    itl = itl or {"0.01": 0, "0.1": 0, "+Inf": 0}
    text = (histogram("vllm:time_to_first_token_seconds", ttft) + histogram("vllm:inter_token_latency_seconds", itl)
            + gauge("vllm:num_requests_running", {'service="decode",instance="decode-0"': running,
                                                  'service="prefill",instance="prefill-0"': 1})
            + gauge("vllm:num_requests_waiting", {'service="prefill",instance="prefill-0"': waiting})
            + gauge("splitserve_queue_depth", {'service="scheduler",instance="s",queue="prefill"': queued,
                                               'service="scheduler",instance="s",queue="requests"': 50})
            + counter("splitserve_disagg_decisions", {'service="scheduler",instance="s",decision="remote"': remote})
            + counter("splitserve_prompt_tokens_computed", {'service="prefill",instance="prefill-0"': computed}))
    return parse(text + "".join(worker_steps))


def test_an_observation_of_a_window():
    before = deployment_text()
    after = deployment_text(
        running=6, waiting=2, queued=1, remote=4, computed=2000,
        ttft={"0.1": 0, "1": 10, "+Inf": 10}, itl={"0.01": 0, "0.1": 100, "+Inf": 100},
        worker_steps=[steps("prefill-0", "prefill", prompt=(8, 1.0, 4), prompt_tokens=2000)])
    history = History(points=((1.0, 12.0), (5.0, 20.0)), capacity_per_worker=100.0, mean_prompt_tokens=10.0)
    obs, kept = observe(before, after, window_s=10.0, at_s=50.0, pools=Pools(prefill=1, decode=2), history=history)
    assert obs.at_s == 50.0
    assert obs.ttft_p90_ms == pytest.approx(910.0) and obs.itl_p90_ms == pytest.approx(91.0)
    p = obs.prefill
    assert (p.workers, p.capacity_per_worker, p.mean_prompt_tokens) == (1, 2000.0, 500.0)
    assert p.queued_tokens == 3 * 500  # 2 on the worker, 1 in the queue
    assert p.tokens_per_s == pytest.approx((2000 + 3 * 500) / 10)  # computed, and what the queue grew by
    d = obs.decode
    assert (d.workers, d.running) == (2, 6)
    assert (d.step_ms_fixed, d.step_ms_per_seq) == pytest.approx((10.0, 2.0))  # from the history's points
    assert kept == History(history.points, 2000.0, 500.0)


def test_a_quiet_window_keeps_what_was_measured_and_says_no_latency():
    quiet = deployment_text()
    history = History(points=((1.0, 12.0), (5.0, 20.0)), capacity_per_worker=1500.0, mean_prompt_tokens=300.0)
    obs, kept = observe(quiet, quiet, 10.0, 1.0, Pools(1, 1), history)
    assert obs.ttft_p90_ms is None and obs.itl_p90_ms is None
    assert (obs.prefill.capacity_per_worker, obs.prefill.mean_prompt_tokens, obs.prefill.tokens_per_s) == (1500.0, 300.0, 0)
    assert kept == history


def test_the_fit_keeps_the_last_points_only():
    history = History(points=tuple((float(i), 10.0 + i) for i in range(FIT_POINTS)))
    before = deployment_text(worker_steps=[steps("decode-0")])
    after = deployment_text(worker_steps=[steps("decode-0", decode=(10, 1.0, 990))])  # (99 seqs, 100 ms)
    _, kept = observe(before, after, 10.0, 1.0, Pools(1, 1), history)
    assert len(kept.points) == FIT_POINTS and kept.points[-1] == pytest.approx((99.0, 100.0))
    assert kept.points[0] == (1.0, 11.0)
