"""Failure paths: deadlines, stalls, cancel, bad parts, on_part errors; nothing left in /dev/shm after any of them."""

import asyncio
import time

import msgspec
import pytest
import torch

from shared.transfer import KVReceiver, KVSender
from support.waiting import eventually
from transfer_helpers import RawClient, Sink, kv, segments_with_prefix

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

# Here the deadlines are the claims (a failure at its deadline, well before the transfer's own, or at once): how late
# past one a loaded machine may see it.
SLACK_S = 2.0


def elapsed_since(start: float) -> float:
    return asyncio.get_running_loop().time() - start


@pytest.mark.parametrize("backend", ["tcp", "shm"])
async def test_a_deadline_fails_both_sides_on_time_and_frees_segments(receiver, backend):
    src = kv(4, seed=1)
    sink = Sink(src)
    deadline_s = 0.6
    ticket = receiver.expect("late", on_part=sink, total_layers=(0, 4), deadline_s=deadline_s)
    sender = KVSender()
    in_flight_names = []

    async def one_layer_then_never():
        yield 0, 1, src[0:1]
        in_flight_names.extend(sender.shm_pool.names())
        await asyncio.sleep(3600)  # the prefill worker hangs
        yield 1, 4, src[1:4]

    start = asyncio.get_running_loop().time()
    try:
        sent, got = await asyncio.gather(sender.send(ticket, one_layer_then_never(), backend=backend),
                                         receiver.wait("late"))
        took = elapsed_since(start)
        assert not got.ok and got.reason == "deadline", got
        assert not sent.ok and sent.reason in ("deadline", "connection"), sent
        assert took < deadline_s + SLACK_S
        assert sink.calls == [(0, 1)]
        assert sender.shm_pool.in_use_bytes == 0
        # Unacked segments are unlinked at once; only acked ones stay, pooled for the next transfer.
        assert segments_with_prefix(sender.shm_pool.prefix) == sorted(sender.shm_pool.names())
        if backend == "shm":
            assert in_flight_names  # a segment existed while the transfer ran...
    finally:
        sender.close()
    assert segments_with_prefix(sender.shm_pool.prefix) == []  # ...and none is left


async def test_a_transfer_nobody_sends_ends_at_its_deadline(receiver):
    receiver.expect("nobody", on_part=lambda *a: None, total_layers=(0, 2), deadline_s=0.3)
    start = asyncio.get_running_loop().time()
    result = await receiver.wait("nobody")
    assert not result.ok and result.reason == "deadline" and result.backend == "none"
    assert 0.25 < elapsed_since(start) < 0.3 + SLACK_S
    assert receiver.stats.failed_by_reason["deadline"] == 1
    assert (await receiver.wait("nobody")) == result  # remembered


async def test_a_ticket_already_expired_fails_at_once(receiver, sender):
    ticket = receiver.expect("expired", on_part=lambda *a: None, total_layers=(0, 1), deadline_s=10)
    ticket = msgspec.structs.replace(ticket, deadline_unix_s=time.time() - 1)
    result = await sender.send(ticket, [(0, 1, kv(1))])
    assert not result.ok and result.reason == "deadline" and result.seconds < SLACK_S  # at once, not in 10 s


async def test_a_payload_that_stops_midway_fails_as_stalled_before_the_deadline():
    receiver = KVReceiver(io_timeout_s=0.3)
    await receiver.start()
    try:
        src = kv(2)
        ticket = receiver.expect("stall", on_part=Sink(src), total_layers=(0, 2), deadline_s=20)
        client = await RawClient.connect(ticket)
        await client.authenticate(ticket)
        assert (await client.recv())["status"] == "ready"
        payload = src.view(-1).view(torch.uint8).numpy().tobytes()
        client.send({"op": "part", "seq": 0, "layer_start": 0, "layer_end": 2, "dtype": "float32",
                     "shape": list(src.shape), "nbytes": len(payload), "alg": "fold64", "sum": 0},
                    payload[: len(payload) // 2])
        start = asyncio.get_running_loop().time()
        result = await receiver.wait("stall")
        assert not result.ok and result.reason == "stalled", result
        assert elapsed_since(start) < 0.3 + SLACK_S
        client.close()
    finally:
        await receiver.stop()


@pytest.mark.parametrize("backend", ["tcp", "shm"])
async def test_cancel_discards_late_parts_and_frees_everything(receiver, backend):
    src = kv(4, seed=2)
    sink = Sink(src)
    ticket = receiver.expect("cancel-me", on_part=sink, total_layers=(0, 4), deadline_s=10)
    sender = KVSender()
    go_on = asyncio.Event()

    async def parts():
        yield 0, 2, src[0:2]
        await go_on.wait()
        yield 2, 4, src[2:4]

    try:
        sending = asyncio.create_task(sender.send(ticket, parts(), backend=backend))
        await eventually(lambda: sink.calls, what="the first part applied")
        receiver.cancel("cancel-me")
        go_on.set()  # the late layers are produced after the cancel
        got = await receiver.wait("cancel-me")
        sent = await asyncio.wait_for(sending, 5)
        assert not got.ok and got.reason == "cancelled"
        assert not sent.ok and sent.reason in ("cancelled", "connection"), sent
        assert sink.calls == [(0, 2)]  # the late part was never applied
        assert receiver.stats.failed_by_reason["cancelled"] == 1
        assert sender.shm_pool.in_use_bytes == 0
        assert segments_with_prefix(sender.shm_pool.prefix) == sorted(sender.shm_pool.names())
    finally:
        sender.close()
    assert segments_with_prefix(sender.shm_pool.prefix) == []


async def test_a_sender_arriving_after_cancel_is_told_so(receiver, sender):
    ticket = receiver.expect("gone", on_part=lambda *a: None, total_layers=(0, 1), deadline_s=10)
    receiver.cancel("gone")
    result = await sender.send(ticket, [(0, 1, kv(1))], backend="tcp")
    assert not result.ok and result.reason == "cancelled", result
    assert receiver.stats.unauthenticated == 0


@pytest.mark.parametrize("backend", ["tcp", "shm"])
async def test_a_failing_producer_aborts_the_transfer_on_both_sides(receiver, sender, backend):
    ticket = receiver.expect("broken-model", on_part=lambda *a: None, total_layers=(0, 2), deadline_s=10)

    async def parts():
        yield 0, 1, kv(1)
        raise RuntimeError("CUDA out of memory (pretend)")

    sent, got = await asyncio.gather(sender.send(ticket, parts(), backend=backend), receiver.wait("broken-model"))
    assert not sent.ok and sent.reason == "sender-aborted" and "out of memory" in sent.error
    assert not got.ok and got.reason == "sender-aborted" and "out of memory" in got.error


async def test_bad_parts_are_refused(receiver, sender):
    cases = {
        "shape": ([(0, 2, kv(3))], "bad-input", "sender-aborted"),  # first dim is not the layer count
        "outside": ([(0, 3, kv(3))], "protocol", "protocol"),  # layer 2 is not expected
        "twice": ([(0, 1, kv(1)), (0, 1, kv(1))], "protocol", "protocol"),
        "missing": ([(0, 1, kv(1))], "incomplete", "incomplete"),
    }
    for name, (parts, sender_reason, receiver_reason) in cases.items():
        ticket = receiver.expect(name, on_part=lambda *a: None, total_layers=(0, 2), deadline_s=10)
        sent, got = await asyncio.gather(sender.send(ticket, parts, backend="tcp"), receiver.wait(name))
        assert (sent.reason, got.reason) == (sender_reason, receiver_reason), (name, sent, got)


async def test_an_on_part_error_fails_the_transfer(receiver, sender):
    def on_part(start, end, tensor):
        raise ValueError("no free blocks")

    ticket = receiver.expect("no-room", on_part=on_part, total_layers=(0, 1), deadline_s=10)
    sent, got = await asyncio.gather(sender.send(ticket, [(0, 1, kv(1))], backend="shm"), receiver.wait("no-room"))
    assert got.reason == "on-part-error" and "no free blocks" in got.error
    assert sent.reason == "on-part-error"


async def test_a_part_above_the_receivers_limit_is_refused():
    receiver = KVReceiver(max_part_bytes=4096, max_buffer_bytes=8192)
    await receiver.start()
    sender = KVSender()
    try:
        ticket = receiver.expect("huge", on_part=lambda *a: None, total_layers=(0, 4), deadline_s=10)
        sent, got = await asyncio.gather(sender.send(ticket, [(0, 4, kv(4))], backend="tcp"), receiver.wait("huge"))
        assert got.reason == "too-large" and sent.reason == "too-large"
    finally:
        sender.close()
        await receiver.stop()


async def test_stop_fails_pending_transfers():
    receiver = KVReceiver()
    await receiver.start()
    receiver.expect("pending", on_part=lambda *a: None, total_layers=(0, 1), deadline_s=10)
    waiting = asyncio.create_task(receiver.wait("pending"))
    await asyncio.sleep(0)
    await receiver.stop()
    result = await asyncio.wait_for(waiting, 1)
    assert not result.ok and result.reason == "stopped"
