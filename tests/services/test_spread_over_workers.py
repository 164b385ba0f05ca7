"""Requests that no cached prefix draws anywhere spread over the decode workers by their running work.

On a fresh deployment the workers' heartbeats show both idle while 8 requests arrive at once: only what
the scheduler counts of its own routing (before each handoff) tells them apart. Each request streams until
all 8 have their first tokens (then hangs up), so all 8 run when the last is routed and the split is exact.
Then the load only the heartbeats show: one worker busy with a request routed long before, every request
sent meanwhile goes to the other.
"""

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from services.common.identity import now_ms
from support.deployment import start_deployment
from support.kv_workload import wait_until

MODEL = "splitserve-default-llama"
PROMPT_TOKENS = 40


def stream_until(base_url: str, prompt, stop: threading.Event) -> None:
    """A long streamed request, read until `stop` is set (then the connection closes: the request is cancelled)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for _ in response.iter_lines():
            if stop.is_set():
                return


def computed_tokens(deployment, worker: str) -> int:
    return deployment.stats(worker).details["prefix_cache"]["prompt_tokens_computed"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("router", ["kv", "load"])
def test_concurrent_requests_on_a_fresh_deployment_land_on_both_workers(nats_server, default_model, tmp_path, router):
    generator = torch.Generator().manual_seed(5)
    # Distinct first tokens: no two prompts share a block, so no worker's cache draws any of them.
    prompts = [[100 + i, *torch.randint(0, 2048, (PROMPT_TOKENS - 1,), generator=generator).tolist()] for i in range(8)]
    deployment = start_deployment(nats_server.url, tmp_path, default_model, workers=2,
                                  scheduler_args=("--router", router))
    try:
        # The gateway's readiness is its own registry read; the scheduler reads the registry every half second.
        wait_until(lambda: deployment.stats("scheduler-0").details["workers_seen"].get("decode") == 2, 10,
                   "the scheduler never saw both decode workers")
        start, started = threading.Barrier(len(prompts)), threading.Barrier(len(prompts), timeout=120)

        def start_and_hold(prompt) -> dict:
            """Stream until every request has its first tokens, then hang up (the request is cancelled)."""
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 3000, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            start.wait()
            with httpx.stream("POST", f"{deployment.base_url}/v1/completions", json=body, timeout=120) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[len("data: "):])
                        started.wait()
                        return chunk

        with ThreadPoolExecutor(len(prompts)) as pool:
            firsts = list(pool.map(start_and_hold, prompts))
        # What makes the split exact: every request was routed while all the others were running (none had ended).
        assert all(first["choices"][0]["finish_reason"] is None for first in firsts)
        # Their cancellations reach the workers, and heartbeats sent after that are what the registry shows (one
        # taken while a cancelled request still ran would make the next part pick the wrong worker as busy).
        wait_until(lambda: all(deployment.stats(w).num_running + deployment.stats(w).num_waiting == 0
                               for w in ("decode-0", "decode-1")), 30, "the hung-up requests still run")
        settled_ms = now_ms()
        wait_until(lambda: all(e.heartbeat_ms > settled_ms for e in deployment.registry_entries().values()
                               if e.role == "decode"), 30, "no heartbeat since the requests ended")

        # Every prompt is computed in full by the worker that ran it (nothing cached): tokens computed count them.
        computed = [deployment.stats(w).details["prefix_cache"]["prompt_tokens_computed"] for w in ("decode-0", "decode-1")]
        assert computed == [4 * PROMPT_TOKENS, 4 * PROMPT_TOKENS]
        scheduler = deployment.stats("scheduler-0").details
        assert scheduler["router"] == router and scheduler["routed"] == {"assigned": len(prompts)}

        # One long request; once its worker's heartbeat shows it running (8 blocks and more in use) and the
        # scheduler counts nothing of its own for it, short requests one after another all go to the other worker
        # (taking turns, or always the same worker, would put some on the busy one).
        fresh = [[200 + i, *torch.randint(0, 2048, (PROMPT_TOKENS - 1,), generator=generator).tolist()] for i in range(4)]
        stop = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            long_one = pool.submit(stream_until, deployment.base_url, fresh[0], stop)
            busy = wait_until(lambda: next((w for w, e in deployment.registry_entries().items() if e.role == "decode"
                                            and e.num_running == 1 and e.kv_blocks_total - e.kv_blocks_free >= 8),
                                           None), 60, "no worker shows the long request running")
            wait_until(lambda: not deployment.stats("scheduler-0").details["routed_unconfirmed"], 10,
                       "the scheduler still counts the long request itself")
            idle = "decode-1" if busy == "decode-0" else "decode-0"
            before = {w: computed_tokens(deployment, w) for w in (busy, idle)}
            try:
                for prompt in fresh[1:]:
                    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
                    assert httpx.post(f"{deployment.base_url}/v1/completions", json=body, timeout=60).status_code == 200
                assert not long_one.done(), "the long request ended: nothing was busy"
            finally:
                stop.set()
            long_one.result(timeout=60)
        assert computed_tokens(deployment, idle) == before[idle] + 3 * PROMPT_TOKENS
        assert computed_tokens(deployment, busy) == before[busy]
    finally:
        deployment.stop()
