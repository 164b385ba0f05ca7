"""Workers with a kv-store: a conversation's prefix survives its worker being killed, and a kv-store that is down
costs only a miss."""

import os
import signal
import time

import httpx
import pytest
from transformers import AutoTokenizer

from reference import safe_prompts
from support.deployment import start_deployment

MODEL = "splitserve-default-llama"


def complete(base_url: str, prompt, max_tokens: int = 16) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()






def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, what
        time.sleep(0.3)


@pytest.mark.timeout(300)
def test_the_next_turn_after_its_worker_is_killed_loads_the_prefix_from_the_kv_store(nats_server, default_model,
                                                                                      tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    (prompt, expected), (other, other_expected) = safe_prompts(default_model, 2048, [400, 300], 16, seed=5)
    deployment = start_deployment(nats_server.url, tmp_path, default_model, workers=2, decode_args=("--kv-store",),
                                  kvstore_args=("--kv-store-ram-bytes", str(256 << 20)))
    try:
        first = complete(deployment.base_url, prompt)
        assert first["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        prefix_blocks = (len(prompt) - 1) // 16
        # The worker that served it wrote the prompt's full blocks back to the store.
        served = wait_until(lambda: next((w for w in ("decode-0", "decode-1")
                                          if deployment.stats(w).details["kv_store"]["counts"].get("blocks_put")), None),
                            15, "no worker wrote blocks back")
        wait_until(lambda: deployment.stats("kvstore-0").details["store"]["ram"]["blocks"] >= prefix_blocks, 15,
                   "the kv-store did not get the blocks")
        other_worker = "decode-1" if served == "decode-0" else "decode-0"

        os.kill(deployment.procs[served].pid, signal.SIGKILL)
        wait_until(lambda: served not in deployment.registered(), 20, "the killed worker stayed registered")
        again = complete(deployment.base_url, prompt)  # the next turn: only the other worker is left
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == prefix_blocks * 16
        details = deployment.stats(other_worker).details["kv_store"]
        assert details["hit_tokens"].get("kvstore") == prefix_blocks * 16 and details["counts"]["loaded"] == 1
        # The gateway's /metrics shows the hit by tier and what the kv-store holds.
        hit_line = (f'splitserve_prefix_cache_hit_tokens_total{{instance="{other_worker}",service="decode",'
                    f'tier="kvstore"}} {float(prefix_blocks * 16)}')
        text = wait_until(lambda: (lambda t: t if hit_line in t else None)(
            httpx.get(f"{deployment.base_url}/metrics", timeout=10).text), 10, "no kv-store hit on /metrics")
        ram_blocks = [line for line in text.splitlines()
                      if line.startswith('splitserve_kvstore_blocks{instance="kvstore-0",service="kvstore",tier="ram"}')]
        assert ram_blocks and float(ram_blocks[0].split()[-1]) >= prefix_blocks
        assert 'splitserve_prefix_cache_query_tokens_total{instance="' + other_worker in text

        # A kv-store that is down: requests still complete, identically, and the miss is counted.
        os.kill(deployment.procs["kvstore-0"].pid, signal.SIGKILL)
        wait_until(lambda: "kvstore-0" not in deployment.registered(), 20, "the killed kv-store stayed registered")
        body = complete(deployment.base_url, other)
        assert body["choices"][0]["text"] == tokenizer.decode(other_expected, skip_special_tokens=True)
        assert deployment.stats(other_worker).details["kv_store"]["counts"].get("no_kvstore", 0) >= 1
    finally:
        deployment.stop()
