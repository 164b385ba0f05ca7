"""The interference benchmark runs end to end at tiny size, both topologies (no timing assertions)."""

import json
import subprocess
import sys

import pytest

from support.processes import ROOT

# The smallest load that still has short requests (with gaps to measure) and a long one in each topology.
TINY = ["--preset", "tiny", "--duration", "2", "--short-rate", "2", "--short-max-tokens", "8", "--long-every", "2",
        "--long-prompt-tokens", "300"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_bench_interference_help():
    out = subprocess.run([sys.executable, "-m", "loadtest.bench_interference", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in ("--preset", "--duration", "--short-rate", "--short-max-tokens", "--long-every",
                 "--long-prompt-tokens", "--max-concurrency", "--seed", "--output"):
        assert flag in out.stdout


@pytest.mark.timeout(300)  # a hang guard only; the run takes well under 90 s on 2 cores
def test_bench_interference_tiny(default_model, tmp_path, capsys):
    from loadtest.bench_interference import LONG_KEYS, RESULT_KEYS, SHORT_KEYS, TOPOLOGY_KEYS, main

    output = tmp_path / "interference.json"
    rc = main([*TINY, "--run-dir-root", str(tmp_path / "runs"), "--output", str(output)])
    printed = capsys.readouterr().out
    assert rc == 0, printed[-3000:]
    assert "ITL p95 [ms]" in printed and "output tokens/s" in printed

    results = json.loads(output.read_text())
    assert set(RESULT_KEYS) <= set(results)
    assert {"cpu_count", "torch_version"} <= set(results["machine"])
    config = results["config"]
    assert config["preset"] == "tiny" and config["duration"] == 2 and config["long_prompt_tokens"] == 300
    assert config["short_max_tokens"] == 8
    assert config["topologies"] == ["colocated", "disagg"]
    assert results["model"]["max_position_embeddings"] >= 300

    tops = results["topologies"]
    assert set(tops) == {"colocated", "disagg"}
    for name, expected_roles in (("colocated", ["decode", "decode"]), ("disagg", ["prefill", "decode"])):
        top = tops[name]
        assert set(TOPOLOGY_KEYS) <= set(top), name
        assert top["ok"] and top["error"] is None, top["error"]
        assert set(SHORT_KEYS) <= set(top["short"]) and set(LONG_KEYS) <= set(top["long"])
        assert top["short"]["completed"] > 0, name
        for key in ("itl_ms", "ttft_ms"):
            assert {"p50", "p95", "p99"} <= set(top["short"][key])
            assert top["short"][key]["p95"] is not None
        assert top["output_tokens"] > 0 and top["output_tokens_per_s"] > 0
        # Each worker pinned to a single core; the other services left alone.
        assert [w["role"] for w in top["workers"]] == expected_roles
        for worker in top["workers"]:
            assert worker["affinity_after"] == [worker["core"]]
        assert "gateway-0" in top["unpinned"] and "scheduler-0" in top["unpinned"]
        # Torn down: nothing of the deployment is left running.
        assert top["teardown"]["exit_code"] is not None
        for worker in top["workers"]:
            assert not _alive(worker["pid"]), f"{name}: {worker['name']} still running"

    comparison = results["comparison"]
    assert comparison["available"]
    assert {"p95_itl_ratio_disagg_over_colocated", "throughput_ratio_disagg_over_colocated"} <= set(comparison)
