"""Workers with a kv-store: prefixes shared across workers, a conversation's prefix survives its worker being
killed, a kv-store that is down, full or slow costs only a miss, and two kv-stores split the blocks."""

import os
import signal

import pytest
from transformers import AutoConfig, AutoTokenizer

from contracts import KVEvents, Subjects, from_anyone
from reference import safe_prompts
from services.kvstore.placement import place
from support.deployment import start_deployment
from support.kv_workload import complete, conversation, run_conversation, wait_until
from support.metrics import matching, samples, value
from support.token_tap import BusTap


@pytest.mark.timeout(300)
def test_the_next_turn_after_its_worker_is_killed_loads_the_prefix_from_the_kv_store(nats_server, default_model,
                                                                                      tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    (prompt, expected), (other, other_expected) = safe_prompts(default_model, 2048, [400, 300], 16, seed=5)
    deployment = start_deployment(nats_server.url, tmp_path, default_model, workers=2, decode_args=("--kv-store",),
                                  kvstore_args=("--kv-store-ram-bytes", str(256 << 20)))
    try:
        first = complete(deployment.base_url, prompt)
        assert deployment.token_ids(first) == expected
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
        assert deployment.token_ids(again) == expected
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == prefix_blocks * 16
        details = deployment.stats(other_worker).details
        assert details["kv_store"]["counts"]["loaded"] == 1
        # It computed only the prompt's suffix: the rest came from the kv-store.
        assert details["prefix_cache"]["hit_tokens"]["kvstore"] == prefix_blocks * 16
        assert details["prefix_cache"]["prompt_tokens_computed"] == len(prompt) - prefix_blocks * 16
        # The gateway's /metrics shows the hit by tier and what the kv-store holds.
        def shows_the_hit():
            found = samples(deployment.base_url)
            hit = matching(found, "splitserve_prefix_cache_hit_tokens_total", instance=other_worker, service="decode",
                           tier="kvstore")
            return found if hit == [float(prefix_blocks * 16)] else None

        found = wait_until(shows_the_hit, 10, "no kv-store hit on /metrics")
        ram_blocks = matching(found, "splitserve_kvstore_blocks", instance="kvstore-0", service="kvstore", tier="ram")
        assert ram_blocks and ram_blocks[0] >= prefix_blocks
        assert matching(found, "splitserve_prefix_cache_query_tokens_total", instance=other_worker)

        # A kv-store that is down: requests still complete, identically, and the miss is counted.
        os.kill(deployment.procs["kvstore-0"].pid, signal.SIGKILL)
        wait_until(lambda: "kvstore-0" not in deployment.registered(), 20, "the killed kv-store stayed registered")
        body = complete(deployment.base_url, other)
        assert deployment.token_ids(body) == other_expected
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
    (prompt, expected), = safe_prompts(default_model, 2048, [400], 16, seed=5)
    # Room for one block of this model's KV (4 layers x K,V x 16 tokens x 2 heads x 32 dims x 4 bytes = 32 KiB)
    # and no disk tier: what is written back beyond it is dropped.
    deployment = start_deployment(nats_server.url, tmp_path, default_model, workers=1, decode_args=("--kv-store",),
                                  kvstore_args=("--kv-store-ram-bytes", str(40_000)))
    try:
        for _ in range(2):
            body = complete(deployment.base_url, prompt)
            assert deployment.token_ids(body) == expected
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


@pytest.mark.timeout(300)
def test_two_kv_stores_split_the_blocks_a_slow_one_costs_a_miss_and_metrics_show_their_tiers(nats_server, model_zoo,
                                                                                              tmp_path):
    """On a second model shape (5 layers, 6 query heads to 1 KV head, tied embeddings): each block goes to the
    kv-store rendezvous hashing names; a worker with an empty cache loads its prefix from both, token for token;
    a kv-store that does not answer is a counted miss; /metrics shows each store's tiers as it holds them."""
    model = model_zoo["llama-1kv"]
    vocab = AutoConfig.from_pretrained(model).vocab_size
    (prompt, expected), (other, other_expected) = safe_prompts(model, vocab, [400, 200], 16, seed=7)
    block_bytes = 5 * 2 * 16 * 1 * 16 * 4  # layers x K,V x block size x KV heads x head dim x float32
    deployment = start_deployment(nats_server.url, tmp_path, model, workers=1,
                                  decode_args=("--kv-store", "--kv-store-timeout", "1"), kvstores=2,
                                  kvstore_args=("--kv-store-ram-bytes", str(6 * block_bytes),
                                                "--kv-store-disk-bytes", str(1 << 20)))
    stores = ["kvstore-0", "kvstore-1"]
    events = BusTap(deployment.nats_url, from_anyone(Subjects(deployment.namespace).kv_events), KVEvents)
    try:
        body = complete(deployment.base_url, prompt)
        assert deployment.token_ids(body) == expected

        def written_back():
            worker = deployment.stats("decode-0").details["kv_store"]
            puts = [deployment.stats(s).details["store"]["puts"] for s in stores]
            put = worker["counts"].get("blocks_put", 0)
            return puts if put and worker["puts_in_flight"] == 0 and sum(puts) == put else None
        puts = wait_until(written_back, 15, "the blocks were not written back")
        assert all(puts), puts  # both stores hold some
        # Each store announced exactly the blocks rendezvous hashing gives it.
        stored = wait_until(lambda: (lambda s: s if sum(map(len, s.values())) == sum(puts) else None)(
            {store: {h for e in events.messages() if e.instance_id == store for h in e.stored} for store in stores}),
            10, "the kv-stores' KV events do not show every block")
        for store, hashes in stored.items():
            assert {place(h, stores) for h in hashes} == {store}

        # /metrics: each store's bytes, blocks and evictions per tier, as the store itself counts them. RAM holds
        # 6 blocks: the rest spilled to disk.
        def metrics_match():
            found = samples(deployment.base_url)
            for store in stores:
                state = deployment.stats(store).details["store"]
                for tier in ("ram", "disk"):
                    labels = dict(service="kvstore", instance=store, tier=tier)
                    if (matching(found, "splitserve_kvstore_bytes", **labels) != [state[tier]["bytes"]]
                            or matching(found, "splitserve_kvstore_blocks", **labels) != [state[tier]["blocks"]]
                            or matching(found, "splitserve_kvstore_evictions_total", **labels)
                            != [state["evictions"][tier]]):
                        return None
            return found
        found = wait_until(metrics_match, 10, "/metrics does not show the kv-stores' tiers")
        for store in stores:
            assert value(found, "splitserve_kvstore_evictions_total", instance=store, tier="ram") > 0
            assert value(found, "splitserve_kvstore_bytes", instance=store, tier="disk") > 0
            assert value(found, "splitserve_kvstore_bytes", instance=store, tier="ram") <= 6 * block_bytes

        # A kv-store that is registered but does not answer (frozen): the lookup waits out its timeout, the miss
        # is counted and the prompt computed, exactly.
        os.kill(deployment.procs["kvstore-1"].pid, signal.SIGSTOP)
        try:
            misses = deployment.stats("decode-0").details["kv_store"]["misses"]
            body = complete(deployment.base_url, other)
            assert deployment.token_ids(body) == other_expected
            after = deployment.stats("decode-0").details["kv_store"]
            assert after["misses"].get("lookup_unreachable", 0) == misses.get("lookup_unreachable", 0) + 1
            assert after["counts"]["lookup_misses"] == 2 and "no_kvstore" not in after["counts"]
        finally:
            os.kill(deployment.procs["kvstore-1"].pid, signal.SIGCONT)

        # A fresh worker (its own cache empty) loads the first prompt's prefix from both stores.
        deployment.restart("decode-0")
        wait_until(lambda: all(deployment.registry_entries().get(s, None) for s in [*stores, "decode-0"])
                   and deployment.registry_entries()["decode-0"].state == "ready", 60, "decode-0 did not come back")
        deployment.wait_scheduler_sees("decode", 1)
        hits = [sum(deployment.stats(s).details["store"]["hits"].values()) for s in stores]
        body = complete(deployment.base_url, prompt)
        assert deployment.token_ids(body) == expected
        cached = (len(prompt) - 1) // 16 * 16
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
        assert deployment.stats("decode-0").details["prefix_cache"]["hit_tokens"]["kvstore"] == cached
        now = [sum(deployment.stats(s).details["store"]["hits"].values()) for s in stores]
        assert all(n > h for n, h in zip(now, hits)), (hits, now)
    finally:
        events.close()
        os.kill(deployment.procs["kvstore-1"].pid, signal.SIGCONT)
        deployment.stop()
