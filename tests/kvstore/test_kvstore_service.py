"""The kv-store service over a real nats-server: lookups over NATS, blocks over the side channel, tiers bounded,
the disk tier found again after kill -9, and a store that is down or refuses costs a miss, never an error."""

import os
import signal
import time

import pytest
import pytest_asyncio
import torch

from contracts import KVStoreLookup, KVStoreReply
from services.kvstore.placement import group_by_instance, place
from support.kvstore import (BLOCK_BYTES, WORKER, Collect, blocks, hashes, kvstore_client, start_kvstore, stored,
                             wait_ready)
from support.processes import stop_process

pytestmark = pytest.mark.timeout(120)


@pytest_asyncio.fixture
async def client(nats_server):
    async with kvstore_client(nats_server.url) as connected:
        yield connected


@pytest.mark.asyncio
async def test_put_lookup_get_round_trip_and_bounded_tiers(nats_server, client, tmp_path):
    kv, nc, subjects = client
    proc = start_kvstore(nats_server.url, subjects.namespace, tmp_path)
    try:
        await wait_ready(nc, subjects, "kvstore-0")
        data = blocks(6, seed=1)
        assert await kv.put("kvstore-0", hashes(6, 1), data)
        await stored(nc, subjects, 6)
        assert await kv.lookup("kvstore-0", hashes(6, 1)) == 6
        assert await kv.lookup("kvstore-0", hashes(3, 1) + hashes(3, 9)) == 3  # the prefix held, no more
        collect = Collect(6)
        assert await kv.get("kvstore-0", hashes(6, 1), collect)
        assert torch.equal(collect.out, data)  # from RAM and disk alike, bit-exact
        kv.model_fingerprint = b"model-b"  # another model's worker is not served these blocks
        assert not await kv.get("kvstore-0", hashes(6, 1), Collect(6))
        assert kv.misses["get_refused"] == 1
        kv.model_fingerprint = b"model-a"

        # Past the RAM bound, blocks spill to disk; past the disk bound the oldest go.
        assert await kv.put("kvstore-0", hashes(10, 2), blocks(10, seed=2))
        info = await stored(nc, subjects, 16)
        store = info.details["store"]
        assert store["ram"]["bytes"] <= 4 * BLOCK_BYTES and store["disk"]["bytes"] <= 8 * (BLOCK_BYTES + 256)
        assert store["evictions"]["ram"] > 0 and store["evictions"]["disk"] > 0
        assert await kv.lookup("kvstore-0", hashes(6, 1)) == 0  # the oldest are gone
    finally:
        stop_process(proc)


@pytest.mark.asyncio
async def test_the_disk_tier_survives_kill_9(nats_server, client, tmp_path):
    kv, nc, subjects = client
    proc = start_kvstore(nats_server.url, subjects.namespace, tmp_path, ram_blocks=2, disk_blocks=20)
    try:
        await wait_ready(nc, subjects, "kvstore-0")
        data = blocks(8, seed=3)
        assert await kv.put("kvstore-0", hashes(8, 3), data)
        await stored(nc, subjects, 8)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        proc = start_kvstore(nats_server.url, subjects.namespace, tmp_path, ram_blocks=2, disk_blocks=20)
        await wait_ready(nc, subjects, "kvstore-0")
        held = await kv.lookup("kvstore-0", hashes(8, 3))
        assert held == 6  # the 6 that had spilled to disk; the last 2 were in RAM only
        collect = Collect(held)
        assert await kv.get("kvstore-0", hashes(held, 3), collect)
        assert torch.equal(collect.out, data[:held])
    finally:
        stop_process(proc)


@pytest.mark.asyncio
async def test_a_store_that_is_down_or_refuses_is_a_counted_miss(nats_server, client, tmp_path):
    kv, nc, subjects = client
    started = time.monotonic()
    assert await kv.lookup("kvstore-0", hashes(2, 4)) == 0  # nobody there
    assert not await kv.put("kvstore-0", hashes(2, 4), blocks(2, seed=4))
    assert not await kv.get("kvstore-0", hashes(2, 4), Collect(2))
    assert time.monotonic() - started < 10
    assert kv.misses["lookup_unreachable"] == kv.misses["put_unreachable"] == kv.misses["get_unreachable"] == 1

    proc = start_kvstore(nats_server.url, subjects.namespace, tmp_path)
    try:
        await wait_ready(nc, subjects, "kvstore-0")
        assert not await kv.get("kvstore-0", hashes(2, 5), Collect(2))  # not stored: refused, nothing sent
        assert kv.misses["get_refused"] == 1
        reply = await nc.request(WORKER.signs(subjects.kvstore("kvstore-0", "lookup")),
                                 KVStoreLookup(hashes=[b"short"], model_fingerprint=b"model-a").encode(), timeout=5)
        answer = KVStoreReply.decode(reply.data)
        assert not answer.ok and "16 bytes" in answer.error
        with pytest.raises(ValueError):
            await kv.put("kvstore-0", hashes(3, 5), blocks(2, seed=5))
    finally:
        stop_process(proc)


def test_placement_is_stable_and_moves_little_when_an_instance_leaves():
    keys = hashes(400, 7)
    three = ["kvstore-0", "kvstore-1", "kvstore-2"]
    groups = group_by_instance(keys, three)
    assert set(groups) == set(three) and all(len(v) > 60 for v in groups.values())
    two = ["kvstore-0", "kvstore-1"]
    moved = [k for k in keys if place(k, three) != "kvstore-2" and place(k, three) != place(k, two)]
    assert moved == []  # only kvstore-2's blocks move
    with pytest.raises(ValueError):
        place(keys[0], [])
