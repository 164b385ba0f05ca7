"""`up --planner slo --role-switch` on a real deployment, not a dry run: with a TTFT SLO no deployment meets and an
ITL SLO every one does, within a budget of 3 the planner moves a decode worker to the prefill pool by a role switch
in place, while streams run; every stream of a prompt ends with the same greedy text, through the switch."""

import os
import signal
import threading
from collections import defaultdict

import pytest

from support.metrics import matching, samples
from support.sse import stream, streamed_text
from support.up import MODEL, ps, start_up
from support.waiting import wait_until
from test_planner import keep_asking

PROMPTS = [[(11 * p + 3 * t) % 500 + 20 for t in range(24)] for p in range(3)]


def streams_on_and_off(url: str, stop: threading.Event, texts: dict, errors: list) -> None:
    """Rounds of up to three concurrent greedy streams, then a pause: the decode workers step 0 to 2 sequences at
    a time, so the planner's step-time fit has points to fit. Every text is kept per prompt."""
    round_no = 0
    while not stop.is_set():
        width = 1 + round_no % 3
        threads = [threading.Thread(target=one_stream, args=(url, p, texts, errors)) for p in range(width)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        stop.wait(0.5)
        round_no += 1


def one_stream(url: str, p: int, texts: dict, errors: list) -> None:
    try:
        events = stream(url, {"model": MODEL, "prompt": PROMPTS[p], "max_tokens": 40, "temperature": 0,
                              "ignore_eos": True})
        texts[p].append(streamed_text(events))
    except Exception as exc:  # said by the test's last assertion
        errors.append(repr(exc))


@pytest.mark.timeout(300)
def test_the_planner_switches_a_decode_worker_to_prefill_in_place(tmp_path, default_model):
    up = start_up(tmp_path / "run", "--topology", "disagg", "--prefill", "1", "--decode", "2", "--role-switch",
                  "--max-local-prefill", "0", "--planner", "slo", "--ttft-slo-ms", "1", "--itl-slo-ms", "100000",
                  "--planner-budget", "3", "--planner-interval-s", "1")
    stop = threading.Event()
    texts: dict[int, list[str]] = defaultdict(list)
    errors: list[str] = []
    load = [threading.Thread(target=keep_asking, args=(up.url, stop), daemon=True),
            threading.Thread(target=streams_on_and_off, args=(up.url, stop, texts, errors), daemon=True)]
    try:
        planner = next(s for s in ps(up.run_dir)["services"] if s["name"] == "planner-0")
        for t in load:
            t.start()

        def switched() -> bool:
            return sum(matching(samples(planner["url"].removesuffix("/metrics")), "splitserve_planner_scales_total",
                                outcome="ok")) >= 1

        wait_until(switched, 150, "the planner never changed the pools", poll_s=1)
        log = (up.run_dir / "logs" / "planner-0.log").read_text()
        assert "switch: prefill 1 -> 2, decode 2 -> 1" in log, log[-3000:]
        roles = {s["name"]: s["role"] for s in ps(up.run_dir)["services"]}
        # the newest decode worker now serves as a prefill worker, the same process (no new worker started)
        assert roles["decode-1"] == "prefill" and roles["decode-0"] == "decode", roles
        assert sorted(n for n, role in roles.items() if role in ("prefill", "decode")) == [
            "decode-0", "decode-1", "prefill-0"], roles
        stop.set()
        for t in load:
            t.join(120)
        assert not errors, errors
        for p, got in texts.items():  # greedy: every stream of a prompt, before, during or after the switch, alike
            assert got and all(text == got[0] for text in got), (p, got)
        assert up.stop() == 0
    finally:
        stop.set()
        if up.proc.poll() is None:
            os.killpg(up.proc.pid, signal.SIGKILL)
