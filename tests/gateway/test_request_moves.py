"""Which failures move a request to another worker, and what a move does to its stream on this gateway."""

import asyncio
from types import SimpleNamespace

import pytest

from contracts import RequestFailed, StreamAlive, TokenChunk
from services.gateway.request_bus import may_move
from services.gateway.streams import StreamError, TokenStreams


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


def chunk(request_id: str, seq: int) -> SimpleNamespace:
    return SimpleNamespace(subject="t", data=TokenChunk(request_id=request_id, seq=seq, token_ids=[seq], text="x").encode())


def test_a_moved_stream_takes_its_new_attempts_chunks_from_0_and_drops_the_old_ones():
    async def scenario():
        streams = TokenStreams()
        stream = streams.open("r1")
        await streams.on_message(chunk("r1", 0))
        assert (await stream.next_event(1)).seq == 0
        await streams.on_message(chunk("r1", 1))  # queued, then the worker fails: nobody reads it
        stream.worker_instance, stream.worker_boot_id = "decode-0", "boot-a"
        assert streams.move(stream) == "r1-moved-1" == stream.bus_id
        assert stream.failed_on == ["boot-a"]
        assert stream.queue.empty() and stream.next_seq == 0 and stream.worker_instance is None
        await streams.on_message(chunk("r1", 2))  # a late chunk of the first attempt: ignored
        await streams.on_message(chunk("r1-moved-1", 0))
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
                await streams.on_message(SimpleNamespace(subject="t", data=StreamAlive(request_id="r1").encode()))

        stream.worker_instance = "decode-0"  # taken
        alive = asyncio.create_task(keep_alive(6))  # 0.6 s of word, twice the deadline
        with pytest.raises(StreamError) as failure:
            await stream.next_event(0.3)
        assert alive.done()  # it failed only once the word stopped, as its worker's failure
        assert failure.value.code == "worker_failed" and "went silent" in str(failure.value)
        assert stream.queue.empty()  # a StreamAlive is no event for the reader
        await streams.on_message(chunk("r1", 0))
        assert (await stream.next_event(0.3)).seq == 0
        waiting = streams.open("r2")  # not taken yet: the request's own deadline
        with pytest.raises(StreamError) as failure:
            await waiting.next_event(0.1)
        assert failure.value.code == "timeout"

    asyncio.run(scenario())


def test_a_gap_or_a_duplicate_breaks_the_stream_as_a_movable_failure():
    async def scenario():
        streams = TokenStreams()
        stream = streams.open("r1")
        await streams.on_message(chunk("r1", 0))
        await streams.on_message(chunk("r1", 2))  # chunk 1 lost in transit
        assert (await stream.next_event(1)).seq == 0
        with pytest.raises(StreamError) as failure:
            await stream.next_event(1)
        assert failure.value.code == "stream_broken" and "gap" in str(failure.value)
        assert may_move(failure.value.code, moves=0, migration_limit=3)
        assert failure.value.worker_intact  # lost in transit: its worker may take the request again

        again = streams.open("r2")
        for seq in (0, 1, 1):  # chunk 1 twice: two workers on one attempt
            await streams.on_message(chunk("r2", seq))
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
            stream.worker_instance, stream.worker_boot_id = "stage-0", "boot-a"
            failed = RequestFailed(request_id=stream.bus_id, code="worker_failed", message="stage-1 restarted",
                                   worker_intact=intact)
            await streams.on_message(SimpleNamespace(subject="t", data=failed.encode()))
            with pytest.raises(StreamError) as failure:
                await stream.next_event(1)
            assert failure.value.worker_intact is intact
            streams.move(stream, exclude_worker=not failure.value.worker_intact)
            assert stream.failed_on == failed_on  # what the moved request's `moved_from` lists

    asyncio.run(scenario())

