import asyncio

import msgpack
import pytest

from contracts import CancelRequest, GenerateRequest, RequestFailed, StatsRequest
from shared.bus import subscribe
from shared.bus.provision import ensure_pull_consumer, ensure_stream
from shared.bus.waits import cancel_and_wait
from shared.bus.subscribe import fetch_loop, subscribe_typed
from shared.engine.sampling_params import SamplingParams
from support.waiting import eventually

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


def generate_request(request_id: str) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, model="m", prompt_token_ids=[1, 2], sampling=SamplingParams(),
                           reply_subject="r", deadline_ms=0, created_ms=0)


async def work_queue(js, stream: str, ack_wait_s: float) -> str:
    """A work-queue stream `stream` with a durable pull consumer "workers" on it."""
    await ensure_stream(js, name=stream, subjects=[f"{stream}.>"], retention="workqueue", storage="memory",
                        max_msgs=100, max_bytes=1 << 20, max_age_s=60)
    await ensure_pull_consumer(js, stream=stream, durable="workers", filter_subject=f"{stream}.>",
                               ack_wait_s=ack_wait_s, max_deliver=5, max_ack_pending=100)
    return stream


async def test_subscribe_typed_rejects_bad_input_and_keeps_going(nc, unique):
    subject = unique("gen")
    received = []
    counted = []

    async def handler(message, msg):
        received.append(message)
        if msg.reply:
            await msg.respond(b"ok")

    await subscribe_typed(nc, subject, GenerateRequest, handler, counter=lambda s, r: counted.append((s, r)))
    before = subscribe.REJECTED.copy()

    async def ask(payload: bytes) -> RequestFailed:
        reply = await nc.request(subject, payload, timeout=2)
        return RequestFailed.decode(reply.data)

    not_msgpack = await ask(b"\xc1\xc1 definitely not msgpack")
    assert (not_msgpack.code, not_msgpack.request_id) == ("invalid_request", "")
    assert "msgpack" in not_msgpack.message

    future = msgpack.packb({**msgpack.unpackb(generate_request("req-1").encode()), "v": 2})
    wrong_version = await ask(future)
    assert (wrong_version.code, wrong_version.request_id) == ("invalid_request", "req-1")
    assert "version" in wrong_version.message

    wrong_type = await ask(CancelRequest(request_id="req-2").encode())
    assert (wrong_type.code, wrong_type.request_id) == ("invalid_request", "req-2")

    missing_field = await ask(msgpack.packb({"type": "generate_request", "v": 1, "request_id": "req-3"}))
    assert missing_field.request_id == "req-3" and "missing required field `model`" in missing_field.message

    await nc.publish(subject, b"\x00 no reply subject: dropped")  # nobody to tell
    assert (await nc.request(subject, generate_request("req-4").encode(), timeout=2)).data == b"ok"
    await nc.publish(subject, generate_request("req-5").encode())
    await eventually(lambda: len(received) == 2, what="req-5 handled")

    assert [m.request_id for m in received] == ["req-4", "req-5"]
    rejected = subscribe.REJECTED - before
    assert rejected == {"malformed": 3, "unknown_version": 1, "wrong_type": 1}
    assert sorted(counted) == sorted([(subject, "malformed")] * 3 + [(subject, "unknown_version"), (subject, "wrong_type")])


async def test_subscribe_typed_with_several_types_and_a_queue_group(nc, unique):
    subject = unique("control")
    received = []

    async def handler(message, msg):
        received.append(type(message).__name__)

    for _ in range(2):  # two members of one queue group: each message goes to one of them
        await subscribe_typed(nc, subject, (CancelRequest, StatsRequest), handler, queue="workers")
    await nc.publish(subject, CancelRequest(request_id="a").encode())
    await nc.publish(subject, StatsRequest().encode())
    await nc.publish(subject, generate_request("b").encode())  # not one of the two: rejected
    await eventually(lambda: len(received) == 2, what="both handled")
    assert received == ["CancelRequest", "StatsRequest"]


async def test_a_failing_handler_does_not_end_the_subscription(nc, unique):
    subject = unique("fragile")
    seen = []

    async def handler(message, msg):
        seen.append(message.request_id)
        if message.request_id == "boom":
            raise RuntimeError("handler bug")

    await subscribe_typed(nc, subject, CancelRequest, handler)
    for request_id in ("boom", "next"):
        await nc.publish(subject, CancelRequest(request_id=request_id).encode())
    await eventually(lambda: len(seen) == 2, what="the message after the failing one handled")
    assert seen == ["boom", "next"]


async def test_fetch_loop_terms_malformed_messages_and_hands_over_good_ones(js, unique):
    stream = await work_queue(js, unique("jobs"), ack_wait_s=0.5)
    subject = f"{stream}.submit"
    payloads = [
        b"garbage",
        generate_request("good-1").encode(),
        msgpack.packb({**msgpack.unpackb(generate_request("x").encode()), "v": 7}),
        CancelRequest(request_id="wrong-type").encode(),
        generate_request("good-2").encode(),
        generate_request("nak-once").encode(),
    ]
    for payload in payloads:
        await js.publish(subject, payload)

    handled = []

    async def handler(message, msg):
        handled.append(message.request_id)
        if message.request_id == "nak-once" and handled.count("nak-once") == 1:
            await msg.nak()  # the handler decides: try again
            return
        await msg.in_progress()
        await msg.ack()

    counted = []
    sub = await js.pull_subscribe_bind("workers", stream=stream)
    before = subscribe.REJECTED.copy()
    task = asyncio.create_task(fetch_loop(sub, GenerateRequest, handler, batch=4, fetch_timeout_s=0.2,
                                          counter=lambda s, r: counted.append(r)))
    try:
        # Settled: every message delivered and acked or terminated (one left alone would stay pending, then be
        # delivered again, and again, its ack wait at a time).
        async def settled():
            consumer = await js.consumer_info(stream, "workers")
            return len(handled) == 4 and consumer.num_ack_pending == 0 and consumer.num_pending == 0
        await eventually(settled, 10, "every message acked or terminated")
        assert not task.done()
    finally:
        assert await cancel_and_wait(task, timeout_s=2)

    assert handled == ["good-1", "good-2", "nak-once", "nak-once"]
    # Each bad message was seen once over three ack waits: terminated, never redelivered.
    assert sorted(counted) == ["malformed", "unknown_version", "wrong_type"]
    assert subscribe.REJECTED - before == {"malformed": 1, "unknown_version": 1, "wrong_type": 1}
    consumer = await js.consumer_info(stream, "workers")
    assert consumer.num_ack_pending == 0 and consumer.num_pending == 0
    assert consumer.num_redelivered == 0  # none redelivered and still outstanding


async def test_fetch_loop_crashes_when_the_handler_raises(js, unique):
    stream = await work_queue(js, unique("jobs"), ack_wait_s=5)
    await js.publish(f"{stream}.submit", generate_request("poison").encode())

    async def handler(message, msg):
        raise RuntimeError("worker bug")

    sub = await js.pull_subscribe_bind("workers", stream=stream)
    with pytest.raises(RuntimeError, match="worker bug"):
        await asyncio.wait_for(fetch_loop(sub, GenerateRequest, handler, fetch_timeout_s=0.2), timeout=5)
    consumer = await js.consumer_info(stream, "workers")
    assert consumer.num_ack_pending == 1  # not acked: another worker gets it after the ack wait


async def test_fetch_loop_takes_no_more_than_the_room_it_is_given(js, unique):
    stream = await work_queue(js, unique("jobs"), ack_wait_s=30)
    for i in range(5):
        await js.publish(f"{stream}.submit", generate_request(f"job-{i}").encode())
    held = []  # taken, not acked: the handler's running jobs
    taken = asyncio.Queue()

    async def handler(message, msg):
        held.append(msg)
        await taken.put(message.request_id)

    sub = await js.pull_subscribe_bind("workers", stream=stream)
    task = asyncio.create_task(fetch_loop(sub, GenerateRequest, handler, batch=4, fetch_timeout_s=0.2,
                                          room=lambda: 2 - len(held)))
    try:
        assert [await asyncio.wait_for(taken.get(), 5) for _ in range(2)] == ["job-0", "job-1"]
        with pytest.raises(asyncio.TimeoutError):  # full: nothing more is taken while both are held
            await asyncio.wait_for(taken.get(), 0.5)
        consumer = await js.consumer_info(stream, "workers")
        assert consumer.num_ack_pending == 2 and consumer.num_pending == 3  # the rest stay for other workers
        await held.pop(0).ack()
        assert await asyncio.wait_for(taken.get(), 5) == "job-2"
    finally:
        assert await cancel_and_wait(task, timeout_s=2)
