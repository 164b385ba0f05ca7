"""The pipeline benchmark runs end to end at tiny size (no timing assertions)."""

import json

import pytest

from loadtest.bench_pipeline import RESULT_KEYS, RUN_KEYS, bubble_estimate, main, per_stage


def test_bubble_estimate_and_metric_deltas():
    assert bubble_estimate(1, 1) == 0 and bubble_estimate(2, 1) == 0.5 and bubble_estimate(4, 4) == 3 / 7
    before = {'splitserve_pipeline_stage_busy_seconds_total{instance="stage-1",service="stage"}': 1.0}
    after = {'splitserve_pipeline_stage_busy_seconds_total{instance="stage-1",service="stage"}': 3.5,
             'splitserve_pipeline_stage_idle_seconds_total{instance="stage-1",service="stage"}': 0.5,
             'splitserve_pipeline_activation_bytes_total{instance="stage-1",path="inline",service="stage"}': 100.0}
    assert per_stage(before, after) == {"stage-1": {"busy_s": 2.5, "idle_s": 0.5, "activation_bytes": 100.0}}


@pytest.mark.timeout(600)  # a hang guard only
def test_bench_pipeline_tiny(default_model, tmp_path, capsys):
    output = tmp_path / "pipeline.json"
    rc = main(["--preset", "tiny", "--stages", "1,2", "--microbatches", "2", "--requests", "4", "--concurrency", "2",
               "--max-tokens", "8", "--prompt-tokens", "40", "--run-dir-root", str(tmp_path / "runs"),
               "--output", str(output)])
    printed = capsys.readouterr().out
    assert rc == 0, printed[-3000:]
    results = json.loads(output.read_text())
    assert set(RESULT_KEYS) <= set(results)
    assert [(r["stages"], r["microbatches"]) for r in results["runs"]] == [(1, 1), (2, 2)]
    for run in results["runs"]:
        assert set(RUN_KEYS) <= set(run) and run["ok"] and run["output_tokens_per_s"] > 0
        assert run["teardown"]["clean"], run["teardown"]
    pipeline = results["runs"][1]
    assert 0 <= pipeline["bubble_measured"] < 1 and pipeline["activation_bytes_per_token"] > 0
    assert set(pipeline["stage_metrics"]) == {"stage-0", "stage-1"}


@pytest.mark.timeout(120)
def test_bench_activation_hop_tiny(tmp_path, capsys):
    from loadtest.bench_activation_hop import RESULT_KEYS as HOP_KEYS
    from loadtest.bench_activation_hop import main as hop_main

    output = tmp_path / "hop.json"
    assert hop_main(["--sizes", "4K,2M", "--repeats", "2", "--output", str(output)]) == 0
    results = json.loads(output.read_text())
    assert set(HOP_KEYS) <= set(results)
    small, big = results["results"]
    assert small["inline"]["median_ms"] > 0 and small["side_channel"]["median_ms"] > 0
    assert big["inline"] is None and big["side_channel"]["median_ms"] > 0  # 2 MiB is over NATS's max payload
