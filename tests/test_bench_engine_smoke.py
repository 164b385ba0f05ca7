"""The engine-vs-transformers benchmark runs end to end at tiny size, and both sides agree (no timing assertions)."""

import json
import subprocess
import sys

from support.processes import ROOT


def test_bench_engine_help():
    out = subprocess.run(
        [sys.executable, "-m", "loadtest.bench_engine", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    for flag in ("--model", "--preset", "--device", "--dtype", "--threads", "--requests", "--seed", "--output"):
        assert flag in out.stdout


def test_bench_engine_tiny(cache_dir, tmp_path, capsys):
    import torch

    from loadtest.bench_engine import RESULT_KEYS, main

    threads_before = torch.get_num_threads()
    output = tmp_path / "bench.json"
    rc = main([
        "--preset", "tiny", "--requests", "2", "--repeats", "1", "--threads", "1",
        "--decode-prompt-len", "8", "--decode-tokens", "4",
        "--prompt-lens", "4", "12", "--output-lens", "2", "5", "--batch-size", "2",
        "--output", str(output),
    ])
    assert rc == 0
    assert torch.get_num_threads() == threads_before  # the thread setting is restored
    printed = capsys.readouterr()
    assert "output tokens/s" in printed.out and "disagree" not in printed.err

    results = json.loads(output.read_text())
    assert set(RESULT_KEYS) <= set(results)
    assert {"torch_version", "torch_threads", "cpu_count", "device", "device_name"} <= set(results["machine"])
    assert results["machine"]["torch_threads"] == 1
    assert results["model"]["num_parameters"] > 0

    decode = results["decode_batch1"]
    assert decode["new_tokens"] == 4
    for side in ("engine", "transformers"):
        assert {"t1_s", "tn_s", "ms_per_token"} <= set(decode[side])
    assert "ratio_engine_over_transformers" in decode

    throughput = results["throughput"]
    assert throughput["requests"] == 2
    for side in ("engine", "transformers"):
        assert {"wall_s", "tokens_per_s", "output_tokens"} <= set(throughput[side])
        assert throughput[side]["output_tokens"] == throughput["useful_output_tokens"] == sum(throughput["output_lens"])
    assert "ratio_engine_over_transformers" in throughput

    correctness = results["correctness"]
    assert correctness["batch1_tokens_identical"] is True, correctness.get("batch1_mismatch_detail")
    assert correctness["batch1_first_mismatch"] is None
    assert correctness["batch1_engine_deterministic"] and correctness["batch1_transformers_deterministic"]
    assert correctness["batch1_num_tokens"] == {"engine": 4, "transformers": 4}
    assert correctness["throughput_requests"] == 2
