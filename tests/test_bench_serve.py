"""`splitserve bench`: its metric arithmetic on synthetic timestamps, its workloads, its arrivals, and runs
against a real deployment (one for the module) writing the JSON they promise: a run, a rate sweep and the
shifting trace."""

import argparse
import json
import subprocess
import sys

import numpy as np
import pytest

from services.bench.metrics import RequestRecord, compute_metrics, summary_ms
from services.bench.serve import arrival_times
from services.bench.trace import SHIFTING, trace_arrivals
from services.bench.datasets import build_dataset
from support.deployment import start_deployment
from support.processes import ROOT


def test_metrics_follow_the_definitions():
    a = RequestRecord(sent=0.0, chunk_times=[0.5, 0.6, 0.8], end=0.8, prompt_tokens=10, output_tokens=3, cached_tokens=4)
    b = RequestRecord(sent=1.0, chunk_times=[1.2], end=1.2, prompt_tokens=20, output_tokens=1)
    c = RequestRecord(sent=1.5, error="HTTP 500: boom")
    m = compute_metrics([a, b, c], duration_s=2.0, slo_ttft_ms=300)
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (2, 1, 30, 4)
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 2.0 and m["total_token_throughput"] == 17.0
    assert m["ttft_ms"]["mean"] == pytest.approx(350.0) and m["ttft_ms"]["p50"] == pytest.approx(350.0)
    assert m["ttft_ms"]["p99"] == pytest.approx(200 + 0.99 * 300)  # linear interpolation between 200 and 500
    assert m["tpot_ms"]["mean"] == pytest.approx(150.0)  # (0.8 - 0.5) / 2; b has one token: no TPOT
    assert m["itl_ms"]["p50"] == pytest.approx(150.0) and m["itl_ms"]["mean"] == pytest.approx(150.0)  # 100, 200
    assert m["e2el_ms"]["mean"] == pytest.approx(500.0)  # 800 and 200
    assert m["goodput"] == 0.5  # only b got its first token within 300 ms
    assert m["cached_tokens"] == 4
    assert compute_metrics([a], 1.0)["goodput"] is None  # no SLO given
    empty = summary_ms([])
    assert set(empty) == {"mean", "p50", "p90", "p95", "p99"} and all(v is None for v in empty.values())
    values = [0.01 * i for i in range(1, 101)]
    ordered = summary_ms(values)
    assert ordered["p50"] <= ordered["p90"] <= ordered["p95"] <= ordered["p99"]
    assert ordered["p90"] == pytest.approx(np.percentile(values, 90) * 1000)


def test_arrivals_are_poisson_or_gamma_with_the_asked_rate():
    assert arrival_times(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    for burstiness in (1.0, 0.5, 4.0):
        times = arrival_times(20_000, 10.0, burstiness, seed=1)
        gaps = np.diff(times)
        assert times[0] == 0 and np.all(gaps >= 0)
        assert gaps.mean() == pytest.approx(0.1, rel=0.05)
        assert gaps.var() == pytest.approx(0.01 / burstiness, rel=0.1)  # gamma: mean^2 / shape
    assert arrival_times(5, 2.0, 1.0, seed=3) == arrival_times(5, 2.0, 1.0, seed=3)
    with pytest.raises(ValueError):
        arrival_times(3, 0.0, 1.0, 0)


def workload(**overrides) -> argparse.Namespace:
    base = dict(dataset="random", num_prompts=5, input_len=20, output_len=8, range_ratio=0.0, long_input_len=100,
                long_output_len=4, long_fraction=0.5, prefix_len=30, prefix_groups=2, conversations_per_group=2,
                turns=3, fixed_output_len=False, seed=0)
    return argparse.Namespace(**(base | overrides))


def test_datasets(default_model, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    random_set = build_dataset(workload(range_ratio=0.5), tokenizer)
    assert len(random_set) == 5 and all(len(c) == 1 for c in random_set)
    assert all(10 <= c[0].prompt_len <= 30 and len(c[0].token_ids) == c[0].prompt_len for c in random_set)
    assert build_dataset(workload(range_ratio=0.5), tokenizer)[0][0].token_ids == random_set[0][0].token_ids

    mixed = [c[0] for c in build_dataset(workload(dataset="mixed", num_prompts=200), None)]
    assert {r.prompt_len for r in mixed} == {20, 100} and 60 < sum(r.prompt_len == 100 for r in mixed) < 140
    assert all(r.token_ids is None and len(r.text.split()) == r.prompt_len for r in mixed)  # no tokenizer: words

    prefix = build_dataset(workload(dataset="prefix", num_prompts=0), tokenizer)
    assert len(prefix) == 4 and all(len(c) == 3 for c in prefix)
    first, _, again, _ = prefix
    assert first[0].token_ids[:30] == again[0].token_ids[:30] and first[0].token_ids != again[0].token_ids
    assert [t.prompt_len for t in first] == [50, 78, 106] and first[1].token_ids[:50] == first[0].token_ids

    share = tmp_path / "share.json"
    share.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "tell me a story about a cat " * 3},
                           {"from": "gpt", "value": "once upon a time there was a cat " * 2}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there friend"}]},
        {"conversations": [{"from": "human", "value": "only one turn"}]},
    ]))
    sharegpt = build_dataset(workload(dataset=f"sharegpt:{share}", num_prompts=0), tokenizer)
    assert len(sharegpt) == 1 and sharegpt[0][0].text.startswith("tell me")  # the too-short ones are skipped
    with pytest.raises(ValueError, match="unknown dataset"):
        build_dataset(workload(dataset="nope"), None)


@pytest.mark.timeout(600)  # a hang guard only
def test_bench_compare_runs_each_topology_in_turn(default_model, tmp_path, capsys):
    from services.cli.main import main

    # (The command in this process: its deployments then start off the tests' forkserver, as the suite's do.)
    out, plot = tmp_path / "compare.json", tmp_path / "compare.png"
    rc = main(["bench", "compare", "--configs", "colocated=--topology colocated --decode 1,disagg", "--model",
               default_model, "--dataset", "random", "--num-prompts", "6", "--input-len", "300", "--output-len", "5",
               "--ignore-eos", "--max-concurrency", "3", "--up-args", "--max-num-batched-tokens 256", "--run-dir-root",
               str(tmp_path / "runs"), "--no-progress", "--out", str(out), "--plot", str(plot)])
    printed = capsys.readouterr().out
    assert rc == 0, printed[-3000:]
    assert "| metric | colocated | disagg |" in printed and "| TTFT p50 ms |" in printed
    assert f"run directories (their logs) are in {tmp_path / 'runs'}" in printed  # kept where asked, and said
    report = json.loads(out.read_text())
    assert list(report["results"]) == ["colocated", "disagg"]
    assert report["configs"]["colocated"] == ["--topology", "colocated", "--decode", "1"]
    for result in report["results"].values():
        assert result["completed"] == 6 and result["total_input_tokens"] == 6 * 300
    prompts = [[r["prompt_tokens"] for r in result["requests"]] for result in report["results"].values()]
    assert prompts[0] == prompts[1]  # the same workload for both
    assert plot.stat().st_size > 10_000


@pytest.fixture(scope="module")
def deployment(nats_server, default_model, tmp_path_factory):
    """One deployment every run of `splitserve bench --url` in this module measures (two decode workers)."""
    started = start_deployment(nats_server.url, tmp_path_factory.mktemp("logs"), default_model, workers=2)
    yield started
    started.stop()


def bench(base_url: str, *options: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "services.cli.main", "bench", "--url", base_url, "--no-progress",
                           *options], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


@pytest.mark.timeout(300)
def test_bench_against_a_running_deployment(deployment, tmp_path):
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    done = bench(deployment.base_url, "--dataset", "random", "--num-prompts", "12", "--input-len", "40",
                 "--output-len", "6", "--request-rate", "20", "--max-concurrency", "4", "--ignore-eos",
                 "--slo-ttft-ms", "60000", "--out", str(out), "--plot", str(plot))
    assert "Successful requests:" in done.stdout and "Time to First Token" in done.stdout
    result = json.loads(out.read_text())
    assert {"ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "request_throughput", "output_throughput", "goodput",
            "completed", "failed", "requests"} <= set(result)
    assert result["completed"] == 12 and result["failed"] == 0 and len(result["requests"]) == 12
    assert result["total_output_tokens"] == 12 * 6 and result["total_input_tokens"] == 12 * 40
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        stats = result[key]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p95"] <= stats["p99"], key
    assert result["ttft_ms"]["p50"] <= result["e2el_ms"]["p50"]
    assert result["goodput"] == pytest.approx(result["request_throughput"])  # a 60 s SLO: every request met it
    # A gap per chunk with text: at most one per token after the first (a token inside a character has none).
    assert all(1 <= len(r["itl_ms"]) <= 5 for r in result["requests"])
    assert plot.stat().st_size > 10_000
    # The chat endpoint too, with the mixed dataset.
    bench(f"{deployment.base_url}/v1", "--endpoint", "chat", "--dataset", "mixed", "--num-prompts", "6",
          "--input-len", "20", "--output-len", "4", "--long-input-len", "200", "--out", str(out))
    assert json.loads(out.read_text())["completed"] == 6


@pytest.mark.timeout(240)
def test_a_sweep_and_the_shifting_trace_against_a_deployment(deployment, tmp_path):
    """`--sweep-rates` and `--dataset shifting`: the JSON they promise, with numbers that agree with each other."""
    out = tmp_path / "sweep.json"
    done = bench(deployment.base_url, "--ignore-eos", "--sweep-rates", "50,5", "--num-prompts", "6", "--input-len",
                 "20", "--output-len", "5", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--out", str(out))
    assert "| rate req/s | attainment |" in done.stdout
    assert "max rate at >= 90% SLO attainment: 50 req/s (a swept rate; interpolated 50.00 req/s)" in done.stdout
    result = json.loads(out.read_text())
    sweep = result["sweep"]
    assert [row["rate"] for row in sweep["rows"]] == [5, 50] and len(result["runs"]) == 2
    assert sweep["attainment_target"] == 0.9 and sweep["max_rate"] in (5, 50)
    assert (result["completed"], result["failed"]) == (12, 0)
    for row, run in zip(sweep["rows"], result["runs"]):
        assert run["settings"]["request_rate"] == row["rate"] and run["completed"] == 6
        assert 0 <= row["slo_attainment"] <= 1 and row["slo_attainment"] == 1  # a minute's SLOs: all met
        assert row["goodput"] == pytest.approx(row["request_throughput"])
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p90_ms"] and 0 < row["tpot_p50_ms"] <= row["tpot_p90_ms"]
    assert result["runs"][0]["settings"]["seed"] != result["runs"][1]["settings"]["seed"]  # new prompts

    # The shifting trace, a second per phase at four times its rates, under a TTFT no request can meet.
    done = bench(deployment.base_url, "--ignore-eos", "--dataset", "shifting", "--phase-seconds", "1",
                 "--trace-rate-scale", "4", "--seed", "2", "--long-input-len", "60", "--long-output-len", "2",
                 "--decode-heavy-input-len", "8", "--decode-heavy-output-len", "12", "--input-len", "20",
                 "--output-len", "5", "--slo-ttft-ms", "0.001", "--out", str(out))
    assert "| phase | completed |" in done.stdout
    result = json.loads(out.read_text())
    expected = {}
    for _, index in trace_arrivals(SHIFTING, 1.0, 4.0, seed=2):
        expected[SHIFTING[index].name] = expected.get(SHIFTING[index].name, 0) + 1
    assert {name: figures["completed"] for name, figures in result["phases"].items()} == expected
    assert list(result["phases"]) == [phase.name for phase in SHIFTING if phase.name in expected]
    assert result["completed"] == sum(expected.values()) and result["slo_attainment"] == 0
    assert all(figures["slo_attainment"] == 0 for figures in result["phases"].values())
    outputs = {(r["phase"], r["output_tokens"]) for r in result["requests"]}
    assert outputs <= {("prefill-heavy", 2), ("decode-heavy", 12), ("ramp-up", 5), ("ramp-down", 5)}
