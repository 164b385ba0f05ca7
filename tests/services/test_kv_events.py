"""A KV-event publisher over a real NATS server: a snapshot first, deltas in order, long messages split, a
snapshot again on request and when its log overflowed."""

import asyncio
import os
import uuid

import nats
import pytest

from contracts import KVEvents, KVSnapshotRequest, Subjects, from_anyone
from services.common import kv_event_publisher
from services.common.kv_event_publisher import KVEventPublisher
from shared.engine.kv_event_log import KVEventLog

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


async def test_publisher_snapshots_deltas_and_splits(nats_server, monkeypatch):
    monkeypatch.setattr(kv_event_publisher, "MAX_HASHES_PER_MESSAGE", 4)
    subjects = Subjects("t" + uuid.uuid4().hex[:8])
    nc = await nats.connect(nats_server.url)
    received: asyncio.Queue = asyncio.Queue()

    async def on_event(msg):
        received.put_nowait(KVEvents.decode(msg.data))

    await nc.subscribe(from_anyone(subjects.kv_events), cb=on_event)
    held = [os.urandom(16) for _ in range(6)]
    log = KVEventLog(max_pending=8)

    async def held_hashes():
        log.restart()
        return list(held)

    publisher = KVEventPublisher(nc=nc, subjects=subjects, instance_id="decode-3", role="decode", boot_id="b",
                                 events=log, held_hashes=held_hashes, interval_s=0.05)
    tasks = await publisher.start()
    try:
        first, second = await asyncio.wait_for(received.get(), 5), await asyncio.wait_for(received.get(), 5)
        assert (first.seq, first.snapshot, first.stored) == (0, True, held[:4])  # a snapshot, split in two
        assert (second.seq, second.snapshot, second.stored) == (1, False, held[4:])

        new = os.urandom(16)
        log.stored(new)
        log.removed(held[0])
        delta = await asyncio.wait_for(received.get(), 5)
        assert (delta.seq, delta.snapshot, delta.stored, delta.removed) == (2, False, [new], [held[0]])

        await nc.publish(subjects.kv_snapshot("decode-3"), KVSnapshotRequest(reason="gap").encode())
        again = await asyncio.wait_for(received.get(), 5)
        assert again.seq == 3 and again.snapshot
        await asyncio.wait_for(received.get(), 5)  # its second part

        for _ in range(9):  # past the log's bound: what changed is lost, so a snapshot follows
            log.stored(os.urandom(16))
        overflowed = await asyncio.wait_for(received.get(), 5)
        assert overflowed.seq == 5 and overflowed.snapshot and overflowed.stored == held[:4]
        assert publisher.counts["snapshots"] == 3
    finally:
        for task in tasks:
            task.cancel()
        await nc.close()
