import asyncio
import time

import msgpack
import pytest

from contracts import ServiceInfo
from shared.bus.registry import Heartbeat, Readings, Registry

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


def info(instance_id: str, **fields) -> ServiceInfo:
    return ServiceInfo(**({"instance_id": instance_id, "role": "decode", "state": "ready"} | fields))


async def wait_until(predicate, timeout_s: float, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(interval_s)


async def beats_more(registry, instance_id: str, beats: int, interval_s: float = 0.3) -> None:
    """Until the entry's heartbeat is `beats` beats of `interval_s` newer than now."""
    then = (await registry.get("decode", instance_id)).heartbeat_ms

    async def beaten():
        entry = await registry.get("decode", instance_id)
        return entry is not None and entry.heartbeat_ms >= then + beats * interval_s * 1000

    await wait_until(beaten, timeout_s=beats * interval_s + 2.0, interval_s=0.05)


async def test_put_list_get_remove(js, unique):
    registry = await Registry.open(js, unique("reg"))
    assert await registry.list() == []
    assert await registry.get("decode", "nobody") is None

    await registry.put(info("decode-1", num_running=3))
    await registry.put(info("decode-2"))
    await registry.put(info("decode-1", num_running=4))  # a newer entry replaces the old one

    listed = await registry.list()
    assert [i.instance_id for i in listed] == ["decode-1", "decode-2"]
    assert (await registry.get("decode", "decode-1")).num_running == 4

    await registry.remove("decode", "decode-1")
    assert [i.instance_id for i in await registry.list()] == ["decode-2"]
    assert await registry.get("decode", "decode-1") is None
    assert registry.num_malformed == 0


async def test_open_is_idempotent_and_binds_to_the_existing_bucket(js, unique):
    bucket = unique("reg")
    first, second = await asyncio.gather(Registry.open(js, bucket), Registry.open(js, bucket))
    await first.put(info("gw-1", role="gateway"))
    assert [i.instance_id for i in await second.list()] == ["gw-1"]

    third = await Registry.open(js, bucket, ttl_s=3.0)  # a new TTL is applied to the existing bucket
    assert (await third.kv.status()).ttl == 3.0
    assert [i.instance_id for i in await third.list()] == ["gw-1"]


async def test_an_entry_expires_when_heartbeats_stop(js, unique):
    registry = await Registry.open(js, unique("reg"), ttl_s=1.5)
    await registry.put(info("decode-1"))
    put_at = time.monotonic()
    assert await registry.get("decode", "decode-1") is not None

    await wait_until(lambda: _is_empty(registry), timeout_s=4.0)
    assert 1.0 < time.monotonic() - put_at < 3.5
    assert await registry.get("decode", "decode-1") is None


async def _is_empty(registry):
    return await registry.list() == []


async def test_malformed_entries_are_skipped_and_counted(js, unique):
    registry = await Registry.open(js, unique("reg"))
    await registry.put(info("good-1"))
    await registry.kv.put("garbage", b"\xc1 not msgpack")
    future = {"type": "service_info", "v": 99, "instance_id": "wrong-version", "role": "x"}
    await registry.kv.put("x.wrong-version", msgpack.packb(future))
    await registry.kv.put("decode.wrong-type", msgpack.packb({"type": "token_chunk", "v": 1}))
    await registry.kv.put("decode.mismatch", info("someone-else").encode())
    await registry.kv.put("prefill.good-1", info("good-1").encode())  # a decode entry under prefill's keys
    await registry.kv.put("empty", b"")

    assert [i.instance_id for i in await registry.list()] == ["good-1"]
    assert registry.num_malformed == 6
    assert await registry.get("decode", "mismatch") is None
    assert registry.num_malformed == 7


async def test_heartbeat_keeps_the_entry_alive_and_stop_removes_it(js, unique):
    registry = await Registry.open(js, unique("reg"), ttl_s=1.5)
    beats = 0

    def make_info():
        nonlocal beats
        beats += 1
        if beats == 2:
            raise RuntimeError("a bad tick")  # logged; the next tick puts again
        return info("decode-1", num_running=beats)

    heartbeat = Heartbeat(registry, make_info, interval_s=0.3)
    task = heartbeat.start()
    first = await wait_until(lambda: registry.get("decode", "decode-1"), timeout_s=1.0, interval_s=0.02)
    assert first.heartbeat_ms > 0

    for _ in range(7):  # 2.8 s: almost twice the TTL (the time going by is what is tested)
        await asyncio.sleep(0.4)
        assert await registry.get("decode", "decode-1") is not None
    assert not task.done()
    assert heartbeat.num_failed == 1
    latest = await registry.get("decode", "decode-1")
    assert latest.num_running > 5 and latest.heartbeat_ms > first.heartbeat_ms

    await heartbeat.stop(remove=True)
    assert task.done()
    assert await registry.get("decode", "decode-1") is None


async def test_heartbeat_stop_without_remove_lets_the_entry_expire(js, unique):
    registry = await Registry.open(js, unique("reg"), ttl_s=1.5)
    heartbeat = Heartbeat(registry, lambda: info("decode-1"), interval_s=0.3)
    heartbeat.start()
    await wait_until(lambda: registry.get("decode", "decode-1"), timeout_s=1.0, interval_s=0.02)
    await heartbeat.stop(remove=False)
    assert await registry.get("decode", "decode-1") is not None
    await wait_until(lambda: _is_empty(registry), timeout_s=4.0)


async def test_a_heartbeat_back_from_a_stall_longer_than_the_ttl_says_so_once_before_it_puts_again(js, unique):
    """A frozen process (SIGSTOP, here a blocked event loop) finds its entry expired when it wakes: its peers took
    it for gone. It is told, once, before the entry is back."""
    registry = await Registry.open(js, unique("reg"), ttl_s=1.5)
    lapses = []

    async def on_lapse(gap_s: float) -> None:
        lapses.append((gap_s, await registry.get("decode", "decode-1")))

    heartbeat = Heartbeat(registry, lambda: info("decode-1"), interval_s=0.3, on_lapse=on_lapse)
    heartbeat.start()
    await wait_until(lambda: registry.get("decode", "decode-1"), timeout_s=1.0, interval_s=0.02)
    await beats_more(registry, "decode-1", 3)
    assert lapses == []  # beating inside the TTL: no lapse
    time.sleep(2.5)  # the whole loop frozen past the TTL
    async def back_after_the_lapse():
        return lapses and await registry.get("decode", "decode-1")

    await wait_until(back_after_the_lapse, timeout_s=2.0, interval_s=0.02)
    (gap_s, entry_then), = lapses
    assert gap_s > 1.5 and entry_then is None  # told while the entry was gone
    await beats_more(registry, "decode-1", 3)
    assert len(lapses) == 1 and heartbeat.num_lapses == 1
    await heartbeat.stop(remove=True)


async def test_a_registry_that_answered_nobody_is_no_lapse_of_the_services_beating_into_it(js, unique):
    """While the registry's stream answers nobody with the client connected (on a cluster: its leader lost and a new
    one being elected; here: the stream gone), every service's puts fail alike and no reader learns anything. Once
    it is back the entry is put again, and no lapse is reported: no peer could have taken it for gone."""
    bucket = unique("reg")
    registry = await Registry.open(js, bucket, ttl_s=1.5)
    lapses = []

    async def on_lapse(gap_s: float) -> None:
        lapses.append(gap_s)

    heartbeat = Heartbeat(registry, lambda: info("decode-1"), interval_s=0.3, on_lapse=on_lapse)
    heartbeat.start()
    await wait_until(lambda: registry.get("decode", "decode-1"), timeout_s=1.0, interval_s=0.02)
    await js.delete_key_value(bucket)
    await asyncio.sleep(2.5)  # past the TTL, the beats failing on schedule
    await Registry.open(js, bucket, ttl_s=1.5)
    await wait_until(lambda: registry.get("decode", "decode-1"), timeout_s=3.0, interval_s=0.05)
    assert heartbeat.num_failed >= 3
    assert (lapses, heartbeat.num_lapses, heartbeat.num_outages) == ([], 0, 1)
    await heartbeat.stop(remove=True)


async def test_absences_count_once_the_registry_has_been_readable_for_a_ttl():
    readings = Readings(ttl_s=6.0)
    assert readings.absences_count(100.0)  # none failed: every read counts
    readings.failed()  # the registry unreadable (its stream electing a leader)
    assert not readings.absences_count(101.0)  # the first good read after: entries may still be coming back
    assert not readings.absences_count(107.0)
    assert readings.absences_count(107.5)  # readable for a TTL: what is missing has stopped beating
    readings.failed()
    assert not readings.absences_count(108.0)


async def test_heartbeat_interval_must_be_inside_the_ttl(js, unique):
    registry = await Registry.open(js, unique("reg"), ttl_s=1.5)
    with pytest.raises(ValueError, match="TTL"):
        Heartbeat(registry, lambda: info("x"), interval_s=2.0)


async def test_heartbeat_survives_a_nats_restart(private_nats_server):
    from shared.bus.connection import connect, drain

    nc = await connect(private_nats_server.url, name="test", reconnect_wait_s=0.1)
    try:
        registry = await Registry.open(nc.jetstream(timeout=1.0), "reg", ttl_s=1.5)
        heartbeat = Heartbeat(registry, lambda: info("decode-1"), interval_s=0.3)
        task = heartbeat.start()
        await wait_until(lambda: registry.get("decode", "decode-1"), timeout_s=1.0, interval_s=0.02)

        private_nats_server.stop()  # puts fail or wait meanwhile; the task must carry on
        await asyncio.sleep(1.0)  # the outage: a second without a server
        private_nats_server.start()
        restarted_ms = int(time.time() * 1000)

        async def beat_after_restart():
            entry = await registry.get("decode", "decode-1")
            return entry is not None and entry.heartbeat_ms > restarted_ms

        await wait_until(beat_after_restart, timeout_s=5.0)
        assert not task.done()
        await heartbeat.stop()
    finally:
        await drain(nc, timeout_s=2)
