"""Workers with a kv-store: prefixes shared across workers, a conversation's prefix survives its worker being
killed, and a kv-store that is down or full costs only a miss."""

import os
import signal

import httpx
import pytest
from transformers import AutoTokenizer

from reference import safe_prompts
from support.deployment import start_deployment
from support.kv_workload import complete, conversation, run_conversation, wait_until


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
        details = deployment.stats(other_worker).details
        assert details["kv_store"]["counts"]["loaded"] == 1
        # It computed only the prompt's suffix: the rest came from the kv-store.
        assert details["prefix_cache"]["hit_tokens"]["kvstore"] == prefix_blocks * 16
        assert details["prefix_cache"]["prompt_tokens_computed"] == len(prompt) - prefix_blocks * 16
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


@pytest.mark.timeout(300)
def test_disagg_prefill_workers_load_shared_prefixes_from_the_kv_store(nats_server, default_model, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    requests = conversation(default_model)
    # Every prompt is prefilled remotely, by whichever of two prefill workers takes the job.
    deployment = start_deployment(nats_server.url, tmp_path, default_model, workers=1, prefill=2,
                                  scheduler_args=("--max-local-prefill", "0"), decode_args=("--kv-store",),
                                  prefill_args=("--kv-store",), kvstore_args=())

    def written_back(i):
        # Turn 1's prompt blocks come from the prefill worker, its answer's from the decode worker.
        need = [0, 25, 25][i]
        wait_until(lambda: deployment.stats("kvstore-0").details["store"]["ram"]["blocks"] >= need, 15,
                   "the blocks were not written back")

    try:
        deployment.wait_scheduler_sees("prefill", 2)  # else the first prompt may be prefilled by the decode worker
        cached = run_conversation(deployment, requests, tokenizer, written_back)
        # The next turn starts from 400 cached tokens: the first turn's 392 and 8 of its answer, written back by
        # the decode worker as it filled the block. The third request shares 320 tokens.
        assert cached == [0, 400, 320]
        computed = sum(deployment.stats(p).details["prefix_cache"]["prompt_tokens_computed"]
                       for p in ("prefill-0", "prefill-1"))
        assert computed == sum(len(prompt) for prompt, _ in requests) - sum(cached)
        assert deployment.stats("decode-0").details["prefix_cache"]["prompt_tokens_computed"] == 0
    finally:
        deployment.stop()


@pytest.mark.timeout(300)
def test_a_full_kv_store_evicts_and_its_misses_are_counted(nats_server, default_model, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    (prompt, expected), = safe_prompts(default_model, 2048, [400], 16, seed=5)
    # Room for one block of this model's KV (4 layers x K,V x 16 tokens x 2 heads x 32 dims x 4 bytes = 32 KiB)
    # and no disk tier: what is written back beyond it is dropped.
    deployment = start_deployment(nats_server.url, tmp_path, default_model, workers=1, decode_args=("--kv-store",),
                                  kvstore_args=("--kv-store-ram-bytes", str(40_000)))
    try:
        for _ in range(2):
            body = complete(deployment.base_url, prompt)
            assert body["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
            wait_until(lambda: deployment.stats("decode-0").details["kv_store"]["puts_in_flight"] == 0
                       and deployment.stats("decode-0").details["kv_store"]["counts"].get("blocks_put"), 15,
                       "the blocks were not written back")
        store = deployment.stats("kvstore-0").details["store"]
        assert store["ram"]["bytes"] <= 40_000 and store["ram"]["blocks"] <= 1 and store["dropped"] >= 24
        worker = deployment.stats("decode-0").details
        assert worker["kv_store"]["counts"]["lookup_misses"] == 2  # the store never held the whole prefix
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 384  # the worker's own cache still hit
        assert worker["prefix_cache"]["hit_tokens"] == {"local": 384, "kvstore": 0}
    finally:
        deployment.stop()
