"""Requests that no cached prefix draws anywhere spread over the decode workers by their running work.

On a fresh deployment the workers' heartbeats show both idle while 8 requests arrive at once: only what
the scheduler counts of its own routing (before each handoff) tells them apart. Each request runs long
enough (many output tokens) that all 8 are still running when the last is routed, so the split is exact.
"""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from support.deployment import start_deployment

MODEL = "splitserve-default-llama"
PROMPT_TOKENS = 40
MAX_TOKENS = 800  # long enough that the last request starts well before the first ends, even on a loaded machine


@pytest.mark.timeout(300)
@pytest.mark.parametrize("router", ["kv", "load"])
def test_concurrent_requests_on_a_fresh_deployment_land_on_both_workers(nats_server, default_model, tmp_path, router):
    generator = torch.Generator().manual_seed(5)
    # Distinct first tokens: no two prompts share a block, so no worker's cache draws any of them.
    prompts = [[100 + i, *torch.randint(0, 2048, (PROMPT_TOKENS - 1,), generator=generator).tolist()] for i in range(8)]
    deployment = start_deployment(nats_server.url, tmp_path, default_model, workers=2,
                                  scheduler_args=("--router", router))
    try:
        deployment.wait_scheduler_sees("decode", 2)
        start = threading.Barrier(len(prompts))

        def complete(prompt) -> tuple[float, float, dict]:
            """When the first tokens came, when the last did, and the final chunk."""
            body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            start.wait()
            chunks = []
            with httpx.stream("POST", f"{deployment.base_url}/v1/completions", json=body, timeout=120) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append((time.monotonic(), json.loads(line[len("data: "):])))
            return chunks[0][0], chunks[-1][0], chunks[-1][1]

        with ThreadPoolExecutor(len(prompts)) as pool:
            streams = list(pool.map(complete, prompts))
        assert all(last["usage"]["completion_tokens"] == MAX_TOKENS for _, _, last in streams)
        # What makes the split exact: every request was routed while all the others were still running.
        assert max(first for first, _, _ in streams) < min(end for _, end, _ in streams)

        # Every prompt is computed in full by the worker that ran it (nothing cached): tokens computed count them.
        computed = [deployment.stats(w).details["prefix_cache"]["prompt_tokens_computed"] for w in ("decode-0", "decode-1")]
        assert computed == [4 * PROMPT_TOKENS, 4 * PROMPT_TOKENS]
        scheduler = deployment.stats("scheduler-0").details
        assert scheduler["router"] == router and scheduler["routed"] == {"assigned": len(prompts)}
    finally:
        deployment.stop()
