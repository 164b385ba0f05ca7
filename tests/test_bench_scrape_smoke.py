"""The scrape benchmark runs end to end at tiny size (no timing assertions)."""

import json

import pytest


@pytest.mark.timeout(300)  # a hang guard only
def test_bench_scrape_tiny(default_model, tmp_path, capsys):
    from loadtest.bench_scrape import main

    out = tmp_path / "scrape.json"
    assert main(["--model", default_model, "--scrapes", "3", "--scrapers", "3", "--streams", "2", "--max-tokens",
                 "8", "--interval-s", "0.2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "3 scrapers at once" in printed
    result = json.loads(out.read_text())
    idle = result["idle"]
    # disagg with a kv-store: the scheduler, prefill, decode and kv-store answer the gateway's scrape
    assert idle["services_up"] == 4 and idle["services_down"] == 0 and idle["series"] > 0
    assert result["crowded"]["latency_ms"]["n"] == 9
    load = result["under_load"]
    assert load["texts_identical"] == 2 and load["itl_ms_scraped"]["lost"] == 0
    assert load["scrape_latency_ms"]["n"] >= 1
