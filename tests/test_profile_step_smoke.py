"""The step profiler runs end to end on the random model and accounts for the whole decode step, and for a
whole burst's prefill against its compute floor."""

import json

import torch


def test_profile_step_splits_a_step(default_model, tmp_path):
    from loadtest.profile_step import main

    threads_before = torch.get_num_threads()
    output = tmp_path / "profile.json"
    assert main(["--model", default_model, "--batch", "1,3", "--steps", "3", "--prompt-len", "20",
                 "--threads", "1", "--output", str(output)]) == 0
    torch.set_num_threads(threads_before)
    results = json.loads(output.read_text())
    assert [run["batch"] for run in results["runs"]] == [1, 3]
    for run in results["runs"]:
        parts = run["breakdown_ms"]
        assert set(parts) == {"matmul", "attention", "kv write", "layer ops", "python"}
        assert parts["matmul"] > 0 and parts["attention"] > 0
        assert abs(sum(parts.values()) - run["profiled_step_ms"]) < 0.05 * run["profiled_step_ms"] + 0.5
        assert run["weight_bytes"] > 0 and run["weights_floor_ms"] > 0
    assert results["memory_bandwidth_gbs"] > 0


def test_a_bursts_prefill_is_split_and_set_against_its_compute_floor(default_model, tmp_path):
    from loadtest.profile_step import main, prefill_flops
    from shared.engine import read_config

    threads_before = torch.get_num_threads()
    output = tmp_path / "burst.json"
    assert main(["--model", default_model, "--burst", "3", "--prompt-len", "24", "--threads", "1",
                 "--output", str(output)]) == 0
    torch.set_num_threads(threads_before)
    run = json.loads(output.read_text())
    parts = run["breakdown_ms"]
    assert parts["matmul"] > 0 and parts["attention"] > 0 and parts["kv write"] > 0
    assert abs(sum(parts.values()) - run["profiled_ms"]) < 0.05 * run["profiled_ms"] + 0.5
    assert run["steps"] >= 1 and run["matmul_peak_gflops"] > 0
    assert run["flops"] == prefill_flops(read_config(default_model), 3, 24) > 3 * prefill_flops(read_config(default_model), 1, 8)
    assert run["compute_floor_ms"] == run["flops"] / run["matmul_peak_gflops"] / 1e6
