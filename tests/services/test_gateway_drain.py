"""The gateway's own drain on SIGTERM, and its probes: /health (liveness) and /ready (can serve now)."""

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from reference import safe_prompts
from support.deployment import start_deployment
from support.kv_workload import wait_until
from support.processes import free_port, start_service, wait_for_http

MODEL = "splitserve-default-llama"


def sse_events(base_url: str, body: dict, on_chunk=lambda n: None) -> list[dict]:
    """Every SSE data object of a streamed completion (`on_chunk(count)` as each arrives), then "[DONE]"."""
    events = []
    with httpx.stream("POST", f"{base_url}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line == "data: [DONE]":
                events.append("[DONE]")
            elif line.startswith("data: {"):
                events.append(json.loads(line[len("data: "):]))
                on_chunk(len(events))
    return events


def text(events: list) -> str:
    return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices"))


@pytest.mark.timeout(180)
def test_sigterm_drains_the_gateway_open_streams_finish_and_the_rest_end_with_an_error(nats_server, default_model,
                                                                                       tmp_path):
    """Two gateways on one decode worker, each with a stream open when the worker freezes and both get SIGTERM:
    - gateway-0 (--drain-timeout 30): /ready 503 at once, /health still 200, a new request 503 with Retry-After;
      once the worker wakes its stream ends as it would have, and it exits 0;
    - gateway-1 (--drain-timeout 1): its stream, still stuck at the deadline, ends with a final `shutting_down`
      error event and [DONE]; it exits 0."""
    deployment = start_deployment(nats_server.url, tmp_path, default_model, gateway_args=("--drain-timeout", "30"))
    port = free_port()
    other_url = f"http://127.0.0.1:{port}"
    other = start_service("gateway", ["--nats", deployment.nats_url, "--namespace", deployment.namespace,
                                      "--instance-id", "gateway-1", "--model", default_model, "--served-model-name",
                                      MODEL, "--port", str(port), "--drain-timeout", "1"], tmp_path)
    decode = deployment.procs["decode-0"]
    (prompt, _), = safe_prompts(default_model, 2048, [20], 1, seed=5)
    try:
        wait_for_http(f"{other_url}/ready", 60, [other])
        assert httpx.get(f"{deployment.base_url}/ready", timeout=5).json()["status"] == "ready"
        long_body = {"model": MODEL, "prompt": prompt, "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
        short_body = {**long_body, "max_tokens": 24}
        reference = sse_events(deployment.base_url, short_body)
        checked = {}

        with ThreadPoolExecutor(1) as pool:
            started = []
            stuck = pool.submit(sse_events, other_url, long_body, lambda n: started.append(n))
            assert wait_until(lambda: len(started) >= 3, 30, "the long stream never started")

            def freeze_and_terminate(n: int) -> None:
                if n != 3:
                    return
                os.kill(decode.pid, signal.SIGSTOP)
                deployment.procs["gateway"].send_signal(signal.SIGTERM)
                other.send_signal(signal.SIGTERM)
                ready = wait_until(lambda: (r := httpx.get(f"{deployment.base_url}/ready", timeout=5)).status_code
                                   == 503 and r, 10, "/ready stayed 200 while draining")
                checked["ready"] = ready.json()
                health = httpx.get(f"{deployment.base_url}/health", timeout=5)
                checked["health"] = (health.status_code, health.json()["draining"])
                refused = httpx.post(f"{deployment.base_url}/v1/completions", json=short_body, timeout=10)
                checked["refused"] = (refused.status_code, refused.json()["error"]["code"],
                                      int(refused.headers["retry-after"]))
                # gateway-1's stream outlives its drain: it ends with an error event before the worker wakes.
                checked["stuck"] = stuck.result(timeout=20)
                checked["other_exit"] = other.wait(timeout=10)
                os.kill(decode.pid, signal.SIGCONT)

            drained = sse_events(deployment.base_url, short_body, freeze_and_terminate)
        assert text(drained) == text(reference) and drained[-1] == "[DONE]"  # finished during the drain, as it would
        assert not any("error" in e for e in drained[:-1])
        assert "shutting down" in checked["ready"]["reason"]
        assert checked["health"] == (200, True)
        assert checked["refused"][:2] == (503, "shutting_down") and checked["refused"][2] >= 1
        stuck_events = checked["stuck"]
        assert stuck_events[-1] == "[DONE]" and stuck_events[-2]["error"]["code"] == "shutting_down"
        assert not any("error" in e for e in stuck_events[:-2])
        assert checked["other_exit"] == 0
        assert deployment.procs["gateway"].wait(timeout=20) == 0
    finally:
        os.kill(decode.pid, signal.SIGCONT)
        if other.poll() is None:
            other.kill()
        deployment.stop()
