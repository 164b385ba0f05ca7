"""The shared-prefix benchmark runs end to end at tiny size (no timing assertions)."""

import argparse
import json

import pytest

from loadtest.bench_prefix import main, make_conversations, summarize


def test_the_workload_is_documents_read_in_growing_conversations():
    args = argparse.Namespace(seed=1, groups=2, conversations=2, turns=3, prefix_tokens=50, question_tokens=4,
                              max_tokens=3)
    conversations = make_conversations(args, vocab_size=100)
    assert [(c["group"], c["index"]) for c in conversations] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    first, _, again, _ = conversations
    assert first["turns"][0][:50] == again["turns"][0][:50]  # the same document...
    assert first["turns"][0][50:] != again["turns"][0][50:]  # ...other questions
    turns = first["turns"]
    assert [len(t) for t in turns] == [54, 61, 68] and turns[1][:54] == turns[0] and turns[2][:61] == turns[1]
    assert make_conversations(args, vocab_size=100) == conversations  # from the seed alone


def test_summary_splits_cold_and_warm():
    def record(cold, ttft_s, cached):
        return {"error": None, "chunks": [ttft_s], "sent": 0.0, "cold": cold, "prompt_tokens": 100,
                "cached_tokens": cached}

    summary = summarize([record(True, 2.0, 0), record(False, 0.5, 80), record(False, 0.3, 96)])
    assert summary["ttft_cold_ms"]["p50"] == 2000 and summary["ttft_warm_ms"]["n"] == 2
    assert summary["warm_over_cold_p50"] == summary["ttft_warm_ms"]["p50"] / 2000
    assert summary["hit_rate"] == pytest.approx(176 / 300) and summary["completed"] == 3


@pytest.mark.timeout(600)  # a hang guard only
def test_bench_prefix_tiny(default_model, tmp_path, capsys):
    output = tmp_path / "prefix.json"
    rc = main(["--preset", "tiny", "--configs", "load,kv+store", "--groups", "1",
               "--conversations", "2", "--turns", "2", "--prefix-tokens", "200", "--max-tokens", "4",
               "--stagger", "0.5", "--run-dir-root", str(tmp_path / "runs"), "--output", str(output)])
    printed = capsys.readouterr().out
    assert rc == 0, printed[-3000:]
    runs = json.loads(output.read_text())["runs"]
    assert [r["config"] for r in runs] == ["load", "kv+store"]
    for run in runs:
        assert run["ok"] and run["teardown"]["clean"], run
        assert run["ttft_cold_ms"]["n"] == 1 and run["ttft_warm_ms"]["n"] == 3
        cold = [r for r in run["records"] if r["cold"]]
        assert len(cold) == 1 and cold[0]["cached_tokens"] == 0  # the first request finds nothing
        assert 0 < run["hit_rate"] < 1 and run["prompt_tokens_computed"] > 0
