"""The rate sweep's pure parts (attainment, the max rate at it, its interpolation, the rates parsed) and the
shifting trace's (a piecewise-linear-rate Poisson process: counts, order, rates, lengths, phases)."""

import argparse
import random

import numpy as np
import pytest

from services.bench.datasets import build_dataset
from services.bench.goodput import headline, interpolated_max_rate, max_rate_at_attainment, parse_rates, sweep_row
from services.bench.metrics import RequestRecord, compute_metrics, meets_slo, metrics_by_phase
from services.bench.sweep import format_compare_table, format_sweep, sweep_problem
from services.bench.trace import (SHIFTING, Phase, expected_arrivals, phase_arrivals, time_at_intensity,
                                  trace_arrivals)


def record(sent: float, first: float, end: float, tokens: int) -> RequestRecord:
    return RequestRecord(sent=sent, chunk_times=[first, end] if tokens > 1 else [first], end=end, output_tokens=tokens)


@pytest.mark.parametrize("rec, ttft, tpot, met", [
    (record(0, 0.1, 0.5, 5), 100, 100, True),  # TTFT 100 ms, TPOT 100 ms: on both limits
    (record(0, 0.1, 0.5, 5), 99, 100, False),
    (record(0, 0.1, 0.5, 5), 100, 99, False),
    (record(0, 0.1, 0.5, 5), None, 99, False),
    (record(0, 0.1, 0.5, 5), 100, None, True),
    (record(0, 0.1, 0.1, 1), 100, 1, True),  # one token: no TPOT to miss
    (RequestRecord(sent=0, error="HTTP 500"), None, None, False),  # a failure meets nothing
])
def test_a_request_meets_the_slos(rec, ttft, tpot, met):
    assert meets_slo(rec, ttft, tpot) is met


def test_attainment_counts_failed_requests_as_misses():
    good, slow = record(0, 0.1, 0.5, 5), record(0, 2.0, 2.4, 5)
    failed = RequestRecord(sent=0, error="boom")
    figures = compute_metrics([good, slow, failed, good], 2.0, slo_ttft_ms=500)
    assert figures["slo_attainment"] == 0.5 and figures["goodput"] == 1.0
    assert compute_metrics([good], 1.0)["slo_attainment"] is None  # no SLO, nothing to attain
    assert compute_metrics([], 1.0, slo_ttft_ms=1)["slo_attainment"] is None


def test_each_phase_is_measured_over_its_own_span():
    records = [record(0, 0.1, 0.5, 5), record(1, 1.1, 1.5, 5), record(10, 12, 13, 5), record(11, 11.1, 14, 5)]
    phases = metrics_by_phase(["a", "a", "b", "b"], records, slo_ttft_ms=500)
    assert list(phases) == ["a", "b"]
    assert phases["a"]["duration_s"] == pytest.approx(1.5) and phases["a"]["slo_attainment"] == 1.0
    assert phases["b"]["duration_s"] == pytest.approx(4.0) and phases["b"]["slo_attainment"] == 0.5


@pytest.mark.parametrize("points, target, measured, interpolated", [
    ([(1, 1.0), (2, 0.95), (4, 0.5)], 0.9, 2, 2 + 2 * (0.95 - 0.9) / (0.95 - 0.5)),
    ([(4, 0.5), (1, 1.0), (2, 0.95)], 0.9, 2, 2 + 2 * (0.95 - 0.9) / (0.95 - 0.5)),  # any order
    ([(1, 1.0), (2, 0.9)], 0.9, 2, 2),  # every rate met it: the last, not extrapolated
    ([(1, 0.8), (2, 1.0)], 0.9, None, None),  # the lowest missed: a later pass is noise, not capacity
    ([(1, 1.0), (2, 0.5), (4, 0.95)], 0.9, 1, 1 + 1 * 0.1 / 0.5),  # ... and so is a pass above a failure
    ([(1, 1.0), (2, None)], 0.9, 1, 1),  # a rate with no requests at all attains nothing
    ([(0.5, 1.0), (1, 0.0)], 0.5, 0.5, 0.75),
    ([], 0.9, None, None),
])
def test_the_max_rate_at_attainment(points, target, measured, interpolated):
    assert max_rate_at_attainment(points, target) == measured
    assert interpolated_max_rate(points, target) == (None if interpolated is None else pytest.approx(interpolated))
    if measured is not None:
        upper = min((rate for rate, _ in points if rate > measured), default=measured)
        assert measured <= interpolated_max_rate(points, target) <= upper


@pytest.mark.parametrize("text, rates", [("0.5,1,2,4", [0.5, 1, 2, 4]), ("4, 1,1", [1, 4]), ("3", [3])])
def test_rates_parse_ascending_and_distinct(text, rates):
    assert parse_rates(text) == rates


@pytest.mark.parametrize("text", ["", "1,x", "0,1", "-1", "inf", "nan"])
def test_bad_rates_are_refused(text):
    with pytest.raises(ValueError, match="--sweep-rates"):
        parse_rates(text)


def figures(attainment: float | None, completed: int = 10) -> dict:
    stats = {"p50": 10.0, "p90": 20.0}
    return {"slo_attainment": attainment, "goodput": attainment, "request_throughput": 1.0, "output_throughput": 9.0,
            "completed": completed, "failed": 10 - completed, "ttft_ms": stats, "tpot_ms": stats}


def test_a_sweep_reads_as_a_table_with_its_headline():
    rows = [sweep_row(rate, figures(a)) for rate, a in ((1, 1.0), (2, 0.8), (4, None))]
    assert rows[0]["ttft_p90_ms"] == 20.0 and rows[1]["slo_attainment"] == 0.8 and rows[2]["failed"] == 0
    sweep = {**headline(rows, 0.9), "rows": rows}
    assert sweep["max_rate"] == 1 and sweep["max_rate_interpolated"] == pytest.approx(1.5)
    text = format_sweep({"sweep": sweep})
    assert "| 2 | 80% |" in text and "| 4 | - |" in text
    assert text.endswith("max rate at >= 90% SLO attainment: 1 req/s (a swept rate; interpolated 1.50 req/s)")
    missed = {**headline(rows[1:], 0.9), "rows": rows[1:]}
    assert format_sweep({"sweep": missed}).endswith("none (the lowest rate swept missed it)")
    table = format_compare_table({"colocated": {"sweep": sweep}, "disagg": {"sweep": missed}})
    assert "| attainment @ 1 req/s | 100% | - |" in table and "| attainment @ 2 req/s | 80% | 80% |" in table
    assert "| max rate @ 90% | 1 | - |" in table


def sweep_args(**overrides) -> argparse.Namespace:
    return argparse.Namespace(**({"slo_ttft_ms": 500.0, "slo_tpot_ms": None, "dataset": "random", "attainment": 0.9}
                                 | overrides))


@pytest.mark.parametrize("overrides, problem", [
    ({}, None), ({"slo_ttft_ms": None, "slo_tpot_ms": 50.0}, None), ({"slo_ttft_ms": None}, "needs an SLO"),
    ({"dataset": "shifting"}, "own rates"), ({"attainment": 0.0}, "share"), ({"attainment": 1.5}, "share"),
])
def test_what_cannot_be_swept(overrides, problem):
    found = sweep_problem(sweep_args(**overrides))
    assert found is None if problem is None else problem in found


@pytest.mark.parametrize("rate_from, rate_to", [(2.0, 2.0), (0.5, 3.0), (3.0, 0.5), (0.0, 4.0)])
def test_intensity_inverts_to_the_time(rate_from, rate_to):
    seconds = 10.0
    for t in (0.0, 1.0, 5.0, 9.5, 10.0):
        mass = rate_from * t + (rate_to - rate_from) * t * t / (2 * seconds)
        assert time_at_intensity(rate_from, rate_to, seconds, mass) == pytest.approx(t, abs=1e-9)


@pytest.mark.parametrize("rate_from, rate_to", [(2.0, 2.0), (0.5, 3.0), (3.0, 0.5)])
def test_a_phase_has_poisson_counts_at_its_rate(rate_from, rate_to):
    seconds, rng = 400.0, random.Random(7)
    times = phase_arrivals(rate_from, rate_to, seconds, rng)
    assert times == sorted(times) and 0 <= times[0] and times[-1] <= seconds
    # Each quarter holds the integral of the rate over it, within 4 standard deviations of a Poisson count.
    for quarter in range(4):
        low, high = quarter * seconds / 4, (quarter + 1) * seconds / 4
        rate_low = rate_from + (rate_to - rate_from) * low / seconds
        rate_high = rate_from + (rate_to - rate_from) * high / seconds
        expected = (high - low) * (rate_low + rate_high) / 2
        count = sum(low <= t < high for t in times)
        assert abs(count - expected) < 4 * np.sqrt(expected), (quarter, count, expected)


def test_phase_counts_average_to_their_integral():
    counts = [len(phase_arrivals(0.5, 3.0, 10.0, random.Random(seed))) for seed in range(400)]
    assert expected_arrivals(0.5, 3.0, 10.0) == 17.5
    assert np.mean(counts) == pytest.approx(17.5, abs=4 * np.sqrt(17.5 / 400))
    assert np.var(counts) == pytest.approx(17.5, rel=0.25)  # Poisson: the variance is the mean
    assert phase_arrivals(0.0, 0.0, 10.0, random.Random(0)) == []
    with pytest.raises(ValueError):
        phase_arrivals(-1.0, 1.0, 10.0, random.Random(0))


def test_the_trace_follows_its_phases_in_order():
    arrivals = trace_arrivals(SHIFTING, 200.0, 1.0, seed=3)
    assert arrivals == trace_arrivals(SHIFTING, 200.0, 1.0, seed=3) != trace_arrivals(SHIFTING, 200.0, 1.0, seed=4)
    times, phases = [t for t, _ in arrivals], [p for _, p in arrivals]
    assert times == sorted(times) and phases == sorted(phases)
    for index, phase in enumerate(SHIFTING):
        inside = [t for t, p in arrivals if p == index]
        assert all(index * 200 <= t <= (index + 1) * 200 for t in inside)
        expected = expected_arrivals(phase.rate_from, phase.rate_to, 200.0)
        assert abs(len(inside) - expected) < 4 * np.sqrt(expected), phase.name
    doubled = trace_arrivals((Phase("x", "base", 1.0, 1.0),), 200.0, 2.0, seed=3)
    assert abs(len(doubled) - 400) < 4 * np.sqrt(400)  # --trace-rate-scale multiplies the rates


def test_the_shifting_dataset_labels_phases_with_their_lengths():
    args = argparse.Namespace(dataset="shifting", seed=1, phase_seconds=20.0, trace_rate_scale=1.0, range_ratio=0.0,
                              input_len=50, output_len=40, long_input_len=300, long_output_len=4,
                              decode_heavy_input_len=8, decode_heavy_output_len=200)
    requests = [conversation[0] for conversation in build_dataset(args, None)]
    lengths = {phase.name: {(r.prompt_len, r.output_len) for r in requests if r.phase == phase.name}
               for phase in SHIFTING}
    assert lengths == {"prefill-heavy": {(300, 4)}, "decode-heavy": {(8, 200)}, "ramp-up": {(50, 40)},
                       "ramp-down": {(50, 40)}}
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals) and [r.conversation for r in requests] == list(range(len(requests)))
    assert [(r.arrival_s, r.phase) for r in requests] == [
        (t, SHIFTING[p].name) for t, p in trace_arrivals(SHIFTING, 20.0, 1.0, seed=1)]


def test_compare_shows_each_phase_attainment_side_by_side():
    from services.bench.compare import format_table

    latencies = {key: {"mean": 1.0, "p50": 1.0, "p90": 1.0, "p99": 1.0} for key in ("ttft_ms", "tpot_ms", "itl_ms",
                                                                                     "e2el_ms")}
    run = {"completed": 4, "failed": 0, "request_throughput": 1.0, "output_throughput": 5.0, "goodput": 0.5,
           "slo_attainment": 0.5, **latencies}
    table = format_table({"colocated": {**run, "phases": {"prefill-heavy": {"slo_attainment": 1.0},
                                                          "ramp-up": {"slo_attainment": 0.25}}},
                          "disagg": {**run, "phases": {"ramp-up": {"slo_attainment": 0.75}}}})
    assert "| SLO attainment | 50% | 50% |" in table
    assert table.endswith("| SLO attainment, prefill-heavy | 100% | - |\n| SLO attainment, ramp-up | 25% | 75% |")


def test_a_trace_brings_its_own_start_times_and_a_sweep_its_cdfs():
    from services.bench.datasets import BenchRequest
    from services.bench.serve import arrival_times, cdf_series, start_times

    args = argparse.Namespace(request_rate=2.0, burstiness=1.0, seed=5)
    plain = [[BenchRequest(None, "a", 1, 1, conversation=i)] for i in range(3)]
    assert start_times(plain, args) == arrival_times(3, 2.0, 1.0, 5)
    traced = [[BenchRequest(None, "a", 1, 1, conversation=i, arrival_s=t, phase="x")] for i, t in enumerate((0, 7, 9))]
    assert start_times(traced, args) == [0, 7, 9]
    run = {"requests": []}
    sweep = {"sweep": {"rows": [{"rate": 0.5}, {"rate": 2.0}]}, "runs": [run, run]}
    assert list(cdf_series("disagg", sweep)) == ["disagg @ 0.5 req/s", "disagg @ 2 req/s"]
    assert cdf_series("disagg", run) == {"disagg": run}
