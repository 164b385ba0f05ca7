"""The service start benchmark runs end to end at tiny size, `up --no-fork-services` included (no timing
assertions)."""

import json

import pytest


@pytest.mark.timeout(400)  # a hang guard only
def test_bench_service_start_tiny(default_model, tmp_path, capsys):
    from loadtest.bench_service_start import main

    out = tmp_path / "service_start.json"
    assert main(["--model", default_model, "--up-args", "--topology colocated", "--repeat", "1",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "fork: ready_s" in printed and "exec: ready_s" in printed
    runs = json.loads(out.read_text())["runs"]
    assert [r["mode"] for r in runs] == ["fork", "exec"]
    assert all(r["ready_s"] > 0 and r["cpu_s_at_ready"] > 0 and r["restart_s"] > 0 for r in runs)
