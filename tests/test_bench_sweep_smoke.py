"""`splitserve bench --sweep-rates` and `--dataset shifting` against a real deployment: the JSON they promise,
with numbers that agree with each other."""

import json
import subprocess
import sys

import pytest

from services.bench.trace import SHIFTING, trace_arrivals
from support.deployment import start_deployment
from support.processes import ROOT


def bench(base_url: str, *options: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "services.cli.main", "bench", "--url", base_url, "--ignore-eos",
                           "--no-progress", *options], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


@pytest.mark.timeout(240)
def test_a_sweep_and_the_shifting_trace_against_a_deployment(nats_server, default_model, tmp_path):
    deployment = start_deployment(nats_server.url, tmp_path, default_model, workers=1)
    try:
        out = tmp_path / "sweep.json"
        done = bench(deployment.base_url, "--sweep-rates", "50,5", "--num-prompts", "6", "--input-len", "20",
                     "--output-len", "5", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--out", str(out))
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
        done = bench(deployment.base_url, "--dataset", "shifting", "--phase-seconds", "1", "--trace-rate-scale", "4",
                     "--seed", "2", "--long-input-len", "60", "--long-output-len", "2", "--decode-heavy-input-len",
                     "8", "--decode-heavy-output-len", "12", "--input-len", "20", "--output-len", "5",
                     "--slo-ttft-ms", "0.001", "--out", str(out))
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
    finally:
        deployment.stop()
