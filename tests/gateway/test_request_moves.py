"""Which failures move a request to another worker, and what a move does to its stream on this gateway."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from contracts import Assignment, RequestFailed, ServiceInfo, StreamAlive, Subjects, TokenChunk, sent_by
from services.gateway.request_bus import may_move
from services.gateway.beats_seen import BeatsSeen
from services.gateway.streams import StreamError, TokenStreams, silence_leaves_worker_intact
from support.waiting import eventually


@pytest.mark.parametrize("code, moves, limit, moved", [
    ("worker_failed", 0, 3, True),   # its worker died, restarted or failed it
    ("timeout", 2, 3, True),         # its worker went quiet
    ("stream_broken", 0, 3, True),   # chunks lost in transit (a NATS restart)
    ("worker_failed", 3, 3, False),  # moved as often as allowed: the client gets the error
    ("worker_failed", 0, 0, False),  # moves turned off
    ("invalid_request", 0, 3, False),  # the request's own failures stay the request's
    ("overloaded", 0, 3, False),
    ("no_worker", 0, 3, False),
])
def test_only_a_workers_failure_moves_a_request_up_to_the_limit(code, moves, limit, moved):
    assert may_move(code, moves, limit) is moved


def sent(event, sender: tuple[str, str] = ("decode", "decode-0")) -> SimpleNamespace:
    """`event` as it reaches the gateway: on its request's subject, signed by `sender` (role, instance)."""
    return SimpleNamespace(subject=sent_by(Subjects("t").tokens("gateway-0", event.request_id), *sender),
                           data=event.encode())


def chunk(request_id: str, seq: int, sender: tuple[str, str] = ("decode", "decode-0")) -> SimpleNamespace:
    return sent(TokenChunk(request_id=request_id, seq=seq, token_ids=[seq], text="x"), sender)


async def assign(streams: TokenStreams, request_id: str, worker: str = "decode-0") -> None:
    """The scheduler's word that `worker` took the request (what the gateway believes its events by)."""
    await streams.on_message(sent(Assignment(request_id=request_id, worker_instance=worker, worker_boot_id="boot-a"),
                                  ("scheduler", "scheduler-0")))


def test_a_moved_stream_takes_its_new_attempts_chunks_from_0_and_drops_the_old_ones():
    async def scenario():
        streams = TokenStreams()
        stream = streams.open("r1")
        await assign(streams, "r1")
        assert isinstance(await stream.next_event(1), Assignment)
        await streams.on_message(chunk("r1", 0))
        assert (await stream.next_event(1)).seq == 0
        await streams.on_message(chunk("r1", 1))  # queued, then the worker fails: nobody reads it
        stream.worker_instance, stream.worker_boot_id = "decode-0", "boot-a"
        assert streams.move(stream) == "r1-moved-1" == stream.bus_id
        assert stream.failed_on == ["boot-a"]
        assert stream.queue.empty() and stream.next_seq == 0 and stream.worker_instance is None
        await streams.on_message(chunk("r1", 2))  # a late chunk of the first attempt: ignored
        await streams.on_message(chunk("r1-moved-1", 0, ("decode", "decode-1")))  # held until its assignment
        await assign(streams, "r1-moved-1", "decode-1")
        assert isinstance(await stream.next_event(1), Assignment)
        assert (await stream.next_event(1)).request_id == "r1-moved-1"
        assert streams.move(stream) == "r1-moved-2" and len(streams) == 1
        streams.close(stream.bus_id)
        assert len(streams) == 0

    asyncio.run(scenario())


def test_admission_refuses_past_the_waiting_bound_with_a_429_and_retry_after():
    from services.gateway.app import check_admission
    from services.gateway.errors import from_failure
    from services.gateway.streams import StreamError

    check_admission(waiting=3, max_waiting=4)
    check_admission(waiting=10_000, max_waiting=0)  # no bound
    with pytest.raises(StreamError) as refused:
        check_admission(waiting=4, max_waiting=4)
    error = from_failure(refused.value.code, str(refused.value), retry_after_s=refused.value.retry_after_s)
    assert error.status == 429 and float(error.headers["Retry-After"]) >= 1


def test_only_requests_without_a_token_count_as_waiting():
    streams = TokenStreams()
    fresh, started, moved = streams.open("a"), streams.open("b"), streams.open("c")
    started.next_seq = 3
    moved.streamed_token_ids = [1, 2]  # moved: chunk numbers start again, but its client has tokens
    assert streams.num_waiting() == 1


def test_the_idle_deadline_counts_from_the_last_word_and_a_stream_alive_is_one():
    async def scenario():
        streams = TokenStreams()
        stream = streams.open("r1")

        async def keep_alive(times: int):
            for _ in range(times):
                await asyncio.sleep(0.1)
                await streams.on_message(sent(StreamAlive(request_id="r1")))

        await assign(streams, "r1")
        assert isinstance(await stream.next_event(1), Assignment)  # taken
        alive = asyncio.create_task(keep_alive(6))  # 0.6 s of word, twice the deadline
        with pytest.raises(StreamError) as failure:
            await stream.next_event(0.3)
        assert alive.done()  # it failed only once the word stopped, as its worker's failure
        assert failure.value.code == "worker_failed" and "went silent" in str(failure.value)
        assert stream.queue.empty()  # a StreamAlive is no event for the reader
        await streams.on_message(chunk("r1", 0))
        assert (await stream.next_event(0.3)).seq == 0
        waiting = streams.open("r2")  # not taken yet: the request's own deadline (its worker's word is held)
        await streams.on_message(sent(StreamAlive(request_id="r2")))
        with pytest.raises(StreamError) as failure:
            await waiting.next_event(0.1)
        assert failure.value.code == "timeout"

    asyncio.run(scenario())


def test_a_gap_or_a_duplicate_breaks_the_stream_as_a_movable_failure():
    async def scenario():
        streams = TokenStreams()
        stream = streams.open("r1")
        await streams.on_message(chunk("r1", 0))  # before the assignment: held, then delivered after it
        await assign(streams, "r1")
        await streams.on_message(chunk("r1", 2))  # chunk 1 lost in transit
        assert isinstance(await stream.next_event(1), Assignment)
        assert (await stream.next_event(1)).seq == 0
        with pytest.raises(StreamError) as failure:
            await stream.next_event(1)
        assert failure.value.code == "stream_broken" and "gap" in str(failure.value)
        assert may_move(failure.value.code, moves=0, migration_limit=3)
        assert failure.value.worker_intact  # lost in transit: its worker may take the request again

        again = streams.open("r2")
        await assign(streams, "r2")
        for seq in (0, 1, 1):  # chunk 1 twice: two workers on one attempt
            await streams.on_message(chunk("r2", seq))
        assert isinstance(await again.next_event(1), Assignment)
        assert [(await again.next_event(1)).seq for _ in range(2)] == [0, 1]
        with pytest.raises(StreamError) as failure:
            await again.next_event(1)
        assert "duplicate" in str(failure.value) and not failure.value.worker_intact

    asyncio.run(scenario())


def test_a_failure_its_worker_survived_moves_without_ruling_that_worker_out():
    async def scenario():
        streams = TokenStreams()
        for intact, failed_on in ((True, []), (False, ["boot-a"])):
            stream = streams.open(f"r-{intact}")
            await assign(streams, stream.bus_id, "stage-0")
            assert isinstance(await stream.next_event(1), Assignment)
            failed = RequestFailed(request_id=stream.bus_id, code="worker_failed", message="stage-1 restarted",
                                   worker_intact=intact)
            await streams.on_message(sent(failed, ("decode", "stage-0")))
            with pytest.raises(StreamError) as failure:
                await stream.next_event(1)
            assert failure.value.worker_intact is intact
            streams.move(stream, exclude_worker=not failure.value.worker_intact)
            assert stream.failed_on == failed_on  # what the moved request's `moved_from` lists

    asyncio.run(scenario())



def test_a_silent_stream_says_when_its_worker_last_spoke():
    async def scenario():
        streams = TokenStreams()
        stream = streams.open("r1")
        await assign(streams, "r1")
        await streams.on_message(chunk("r1", 0))
        assert isinstance(await stream.next_event(1), Assignment)
        assert (await stream.next_event(1)).seq == 0
        await streams.on_message(sent(StreamAlive(request_id="r1")))
        spoke_at = time.monotonic()
        with pytest.raises(StreamError) as silent:
            await stream.next_event(0.2)
        assert silent.value.code == "worker_failed" and not silent.value.worker_intact
        assert spoke_at - 0.05 <= silent.value.last_word_at <= spoke_at

    asyncio.run(scenario())


def entry(boot_id: str, heartbeat_ms: int, instance_id: str = "decode-0") -> ServiceInfo:
    return ServiceInfo(instance_id=instance_id, role="decode", boot_id=boot_id, heartbeat_ms=heartbeat_ms)


def test_a_beat_counts_as_a_sign_of_life_from_the_read_before_the_one_that_showed_it():
    beats = BeatsSeen()
    beats.read([entry("boot-a", 1000)], read_at=10.0)
    assert beats.alive_after("decode-0", "boot-a") is None  # the first read: put at some time before it
    beats.read([entry("boot-a", 1000)], read_at=11.0)
    assert beats.alive_after("decode-0", "boot-a") is None  # the same beat again says nothing new
    beats.read([entry("boot-a", 2000), entry("boot-c", 5, "decode-1")], read_at=12.0)
    assert beats.alive_after("decode-0", "boot-a") == 11.0  # a new beat: put after the read at 11.0 began
    assert beats.alive_after("decode-0", "boot-b") is None  # another process of that name: nothing known of it
    beats.read([entry("boot-a", 2000)], read_at=13.0)
    assert beats.alive_after("decode-0", "boot-a") == 11.0
    assert beats.alive_after("decode-1", "boot-c") is None  # it left the registry: forgotten
    # Wall clocks play no part: a worker whose clock runs behind still shows its new beats.
    beats.read([entry("boot-a", 1500)], read_at=14.0)
    assert beats.alive_after("decode-0", "boot-a") == 13.0


@pytest.mark.parametrize("alive_after, intact", [
    (13.0, True),    # alive 3 s after its last word (it says one a second): the words were lost on the way
    (11.5, False),   # not known alive past its next word or two: frozen, or gone
    (None, False),   # nothing known of that process since
])
def test_silence_leaves_the_worker_intact_only_if_its_process_was_alive_well_after(alive_after, intact):
    assert silence_leaves_worker_intact(alive_after, last_word_at=10.0) is intact


def test_a_request_gone_silent_on_a_worker_that_kept_beating_may_go_back_to_it(nats_server):
    """Through the request bus, on a real NATS: the stream goes silent, the worker was seen alive since, and the
    request moves without ruling the worker out (with one worker, the only place it can go)."""
    import uuid

    import nats

    from shared.engine.sampling_params import SamplingParams
    from services.common.queues import provision_request_queue
    from services.gateway.request_bus import RequestBus

    async def scenario():
        nc = await nats.connect(nats_server.url)
        subjects = Subjects("t" + uuid.uuid4().hex[:10])
        await provision_request_queue(nc.jetstream(), subjects)
        streams = TokenStreams()

        def alive_after(instance_id, boot_id):  # decode-0's process, seen beating well after any word
            return time.monotonic() + 5 if (instance_id, boot_id) == ("decode-0", "boot-a") else None

        bus = RequestBus(nc=nc, subjects=subjects, gateway_id="gateway-0", streams=streams, idle_timeout_s=0.3,
                         migration_limit=3, assign_timeout_s=2.0, worker_alive_after=alive_after)
        stream = streams.open("r1")
        stream.submission = SimpleNamespace(model="m", prompt_token_ids=[1, 2], sampling=SamplingParams(), headers={})
        stream.worker_instance, stream.worker_boot_id = "decode-0", "boot-a"
        stream.routed_to = "decode-0"

        async def assign_the_next_attempt():
            await eventually(lambda: stream.bus_id != "r1", 5, "the request submitted again")
            await assign(streams, stream.bus_id)
            await streams.on_message(sent(TokenChunk(request_id=stream.bus_id, seq=0, token_ids=[7], text="x",
                                                     finished=True)))

        helper = asyncio.create_task(assign_the_next_attempt())
        try:
            chunks = [c async for c in bus.chunks(stream)]
        finally:
            helper.cancel()
            await nc.close()
        assert [c.token_ids for c in chunks] == [[7]] and stream.moves == 1
        assert stream.failed_on == []  # decode-0 may take it again

    asyncio.run(scenario())
