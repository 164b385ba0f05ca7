"""Issue 35, item 3: a kv-store that isolates. What a worker's NATS key or an API key no longer gets: a put
that replaces the blocks another prompt reads, a put the store must hold without bound, a block file slipped
into the disk tier, another tenant's prompt told by `cached_tokens`."""

import shutil
import time

import httpx
import pytest
import pytest_asyncio
import torch

from contracts import KVEvents, KVStorePut, KVStoreReply, ServiceInfo
from services.gateway.cache_salt import cache_salt
from services.kvstore.block import StoredBlock
from services.kvstore.disk_tier import KEY_FILE, DiskTier
from services.scheduler.prefix_index import PrefixIndex
from services.scheduler.worker_choice import cached_prefixes
from shared.engine.block_hash import cacheable_block_hashes
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from support.deployment import start_deployment
from support.kvstore import (BLOCK_BYTES, BLOCK_SHAPE, WORKER, Collect, blocks, hashes, kvstore_client, start_kvstore,
                             stored, wait_ready)
from support.processes import stop_process

pytestmark = pytest.mark.timeout(120)

PUT_BLOCKS, IN_FLIGHT_BLOCKS = 16, 24  # the store's budgets, in blocks
PROMPT = list(range(100, 141))  # 40 tokens: 2 full blocks of 16 may come from a cache


@pytest_asyncio.fixture
async def kvstore(nats_server, tmp_path):
    async with kvstore_client(nats_server.url) as (kv, nc, subjects):
        proc = start_kvstore(nats_server.url, subjects.namespace, tmp_path,
                             SPLITSERVE_KV_STORE_MAX_PUT_BYTES=str(PUT_BLOCKS * BLOCK_BYTES),
                             SPLITSERVE_KV_STORE_MAX_PUT_BYTES_IN_FLIGHT=str(IN_FLIGHT_BLOCKS * BLOCK_BYTES))
        try:
            await wait_ready(nc, subjects, "kvstore-0")
            yield kv, nc, subjects
        finally:
            stop_process(proc)


@pytest.mark.asyncio
async def test_a_put_never_replaces_a_block_the_store_holds_in_either_tier(kvstore):
    kv, nc, subjects = kvstore
    victim, secret = blocks(4, seed=1), blocks(4, seed=2)
    assert await kv.put("kvstore-0", hashes(4, 1), victim)
    assert await kv.put("kvstore-0", hashes(2, 2), blocks(2, seed=3))  # RAM holds 4: two of the victim's spill
    info = await stored(nc, subjects, 6)
    assert info.details["store"]["disk"]["blocks"] == 2
    assert await kv.put("kvstore-0", hashes(4, 1), secret)  # the transfer is taken, the blocks are not
    info = await stored(nc, subjects, 6, kept=4)
    collect = Collect(4)
    assert await kv.get("kvstore-0", hashes(4, 1), collect)
    assert torch.equal(collect.out, victim)
    assert info.details["store"]["kept_first"] == 4


@pytest.mark.asyncio
async def test_puts_over_the_byte_budgets_are_refused_up_front_with_the_reason(kvstore):
    kv, nc, subjects = kvstore

    async def ask_put(n: int, prefix: int) -> KVStoreReply:
        put = KVStorePut(transfer_id=f"put-{prefix}", hashes=hashes(n, prefix), dtype="float32",
                         block_shape=list(BLOCK_SHAPE), deadline_ms=int((time.time() + 2) * 1000),
                         model_fingerprint=b"model-a")
        reply = await nc.request(WORKER.signs(subjects.kvstore("kvstore-0", "put")), put.encode(), timeout=5)
        return KVStoreReply.decode(reply.data)

    too_big = await ask_put(PUT_BLOCKS + 1, 5)
    assert not too_big.ok and too_big.ticket is None
    assert f"at most {PUT_BLOCKS * BLOCK_BYTES} per put" in too_big.error
    held_open = await ask_put(PUT_BLOCKS, 6)  # taken; its blocks never come
    assert held_open.ok and held_open.ticket is not None
    crowded = await ask_put(PUT_BLOCKS, 7)
    assert not crowded.ok and "in flight" in crowded.error
    assert await kv.put("kvstore-0", hashes(2, 8), blocks(2, seed=8))  # a small one still fits beside it
    assert (await wait_ready(nc, subjects, "kvstore-0")).details["requests"]["put_over_budget"] == 2


def test_a_block_file_the_store_did_not_write_is_refused(tmp_path):
    held, planted = hashes(2, 9)
    ours = DiskTier(tmp_path / "ours", 1 << 20)
    ours.put(held, StoredBlock.from_tensor(blocks(1, seed=9)[0]))
    # Well-formed files, written by another store (or by anyone with the format but not this store's secret).
    elsewhere = DiskTier(tmp_path / "elsewhere", 1 << 20)
    for key in (held, planted):
        elsewhere.put(key, StoredBlock.from_tensor(blocks(1, seed=10)[0]))
        shutil.copyfile(elsewhere._path(key), ours._path(key))
    restarted = DiskTier(tmp_path / "ours", 1 << 20)
    assert planted in restarted and restarted.get(planted) is None and restarted.get(held) is None
    assert restarted.dropped_forged == 2 and len(restarted) == 0
    assert (tmp_path / "ours" / KEY_FILE).stat().st_mode & 0o777 == 0o600


def test_two_tenants_prompts_hash_apart_everywhere_and_one_tenants_still_match():
    fp, a, b = b"fingerprint", cache_salt("key-a", None), cache_salt("key-b", None)
    assert "key-a" not in a and a == cache_salt("key-a", None) and a != b
    tenant_a, tenant_b = (cacheable_block_hashes(PROMPT, 16, fp, salt) for salt in (a, b))
    assert len(tenant_a) == 2 and not set(tenant_a) & set(tenant_b)
    assert cacheable_block_hashes(PROMPT, 16, fp, cache_salt(None, None)) == cacheable_block_hashes(PROMPT, 16, fp)
    # A client's own salt narrows its reuse; it never lands in another tenant's (or the keyless) cache.
    assert len({cache_salt("key-a", "x"), cache_salt("key-b", "x"), cache_salt(None, "x"), a, b, ""}) == 6
    # The scheduler's index: tenant a's prefix, cached on d0, draws tenant a's request there, not tenant b's.
    index = PrefixIndex()
    index.apply(KVEvents(instance_id="d0", role="decode", boot_id="b", seq=0, snapshot=True, stored=tenant_a))
    worker = ServiceInfo(instance_id="d0", role="decode", kv_block_size=16, kv_fingerprint=fp)
    assert cached_prefixes([worker], PROMPT, index.overlaps, a).blocks == {"d0": 2}
    assert cached_prefixes([worker], PROMPT, index.overlaps, b).blocks == {"d0": 0}


def test_a_workers_prefix_cache_serves_a_tenant_only_its_own_prompts(default_model):
    engine = LLMEngine(EngineConfig(model=default_model, dtype="float32", num_kv_blocks=64), load_tokenizer=False)

    def run(key: str):
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, cache_salt=cache_salt(key, None))
        return engine.generate([PROMPT], params)[0]

    first, other, again = run("key-a"), run("key-b"), run("key-a")
    assert (first.num_cached_tokens, other.num_cached_tokens, again.num_cached_tokens) == (0, 0, 32)
    assert first.token_ids == other.token_ids  # the salt changes what is reused, never what is computed


def test_cached_tokens_tell_an_api_key_nothing_of_anothers_prompts(nats_server, default_model, tmp_path):
    deployment = start_deployment(nats_server.url, tmp_path, default_model,
                                  gateway_env={"SPLITSERVE_API_KEY": "key-a-5d1e,key-b-90c4"})
    try:
        def cached(key: str, **extra) -> int:
            response = httpx.post(f"{deployment.api}/completions", headers={"Authorization": f"Bearer {key}"},
                                  timeout=60, json={"model": "splitserve-default-llama", "prompt": PROMPT,
                                                    "max_tokens": 1, **extra})
            assert response.status_code == 200, response.text
            return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert [cached("key-a-5d1e"), cached("key-b-90c4"), cached("key-a-5d1e")] == [0, 0, 32]
        assert cached("key-a-5d1e", cache_salt="mine") == 0  # a client's own salt narrows its reuse further
    finally:
        deployment.stop()
