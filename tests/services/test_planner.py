"""`up --planner slo` on a real deployment: with SLOs no deployment meets, the planner wants a worker more within
a few evaluations; as a dry run it says so (its log, its /metrics) and the deployment keeps its size."""

import os
import signal
import threading

import httpx
import pytest

from support.metrics import matching, samples
from support.up import MODEL, ps, start_up
from support.waiting import wait_until


def keep_asking(url: str, stop: threading.Event) -> None:
    """Long prompts, each new (nothing cached), until stopped: every one is prefilled by the prefill worker."""
    i = 0
    while not stop.is_set():
        prompt = [(1000 + 37 * i + t) % 2000 + 10 for t in range(400)]
        httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                                  "temperature": 0, "ignore_eos": True}, timeout=60)
        i += 1


@pytest.mark.timeout(240)
def test_a_dry_run_planner_wants_a_worker_more_and_changes_nothing(tmp_path, default_model):
    up = start_up(tmp_path / "run", "--topology", "disagg", "--max-local-prefill", "0", "--planner", "slo",
                  "--planner-dry-run", "--ttft-slo-ms", "1", "--itl-slo-ms", "1", "--planner-budget", "3",
                  "--planner-interval-s", "1")
    stop = threading.Event()
    asking = threading.Thread(target=keep_asking, args=(up.url, stop), daemon=True)
    try:
        planner = next(s for s in ps(up.run_dir)["services"] if s["name"] == "planner-0")
        assert planner["role"] == "planner" and planner["url"].endswith("/metrics")
        asking.start()

        def added() -> float:
            found = samples(planner["url"].removesuffix("/metrics"))
            return sum(matching(found, "splitserve_planner_decisions_total", action="add"))

        wait_until(added, 90, "the planner never wanted a worker more", poll_s=1)
        log = (up.run_dir / "logs" / "planner-0.log").read_text()
        assert "would add: prefill 1 -> " in log, log[-2000:]
        found = samples(planner["url"].removesuffix("/metrics"))
        assert sum(matching(found, "splitserve_planner_scales_total", outcome="dry_run")) >= 1
        assert not matching(found, "splitserve_planner_scales_total", outcome="ok")
        # a dry run: the deployment keeps its size
        pools = ps(up.run_dir)["pools"]
        assert pools["prefill"]["desired"] == 1 and pools["decode"]["desired"] == 1
        assert [s["name"] for s in ps(up.run_dir)["services"] if s["role"] in ("prefill", "decode")] == [
            "prefill-0", "decode-0"]
        stop.set()
        asking.join(60)
        assert up.stop() == 0
    finally:
        stop.set()
        if up.proc.poll() is None:
            os.killpg(up.proc.pid, signal.SIGKILL)
