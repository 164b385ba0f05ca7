"""The gateway CPU benchmark runs end to end at tiny size (no timing assertions)."""

import json

import pytest


@pytest.mark.timeout(300)  # a hang guard only
def test_bench_gateway_cpu_tiny(default_model, tmp_path, capsys):
    from loadtest.bench_gateway_cpu import main

    out = tmp_path / "gateway_cpu.json"
    assert main(["--model", default_model, "--requests", "3", "--concurrency", "2", "--max-tokens", "4",
                 "--repeat", "1", "--out", str(out)]) == 0
    assert "gateway CPU per streamed event" in capsys.readouterr().out
    [run] = json.loads(out.read_text())["runs"]
    assert run["events"] >= 3 and run["gateway_cpu_s"] >= 0 and run["gateway_cpu_us_per_event"] >= 0
