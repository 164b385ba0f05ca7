"""Whom the gateway believes about a request (issue 35, item 1): the scheduler's assignment, then that worker only; and
whom a decode worker believes about a prefill."""

import asyncio

import pytest

from contracts import Assignment, RequestFailed, Sender, StreamAlive, TokenChunk
from services.gateway.attribution import judge
from services.gateway.streams import MAX_HELD_EVENTS, TokenStreams
from test_request_moves import assign, chunk, sent

SCHEDULER, WORKER, OTHER = Sender("scheduler", "scheduler-0"), Sender("decode", "decode-0"), Sender("decode", "decode-1")
ASSIGNED = Assignment(request_id="r", worker_instance="decode-0", worker_boot_id="b")
TOKEN = TokenChunk(request_id="r", seq=0, token_ids=[1], text="x")
FAILED = RequestFailed(request_id="r", code="worker_failed", message="m")


@pytest.mark.parametrize("sender, event, routed_to, verdict", [
    (SCHEDULER, ASSIGNED, None, "accept"),
    (SCHEDULER, ASSIGNED, "decode-0", "again"),
    (SCHEDULER, ASSIGNED, "decode-1", "forged"),  # a second, different assignment: the first stands
    (SCHEDULER, FAILED, None, "accept"),  # no worker could take it
    (SCHEDULER, FAILED, "decode-0", "forged"),  # once a worker has it, only that worker fails it
    (SCHEDULER, TOKEN, "decode-0", "forged"),
    (WORKER, ASSIGNED, None, "forged"),  # a worker cannot claim a request
    (WORKER, TOKEN, None, "hold"),  # it may come before the scheduler's word
    (WORKER, TOKEN, "decode-0", "accept"),
    (WORKER, FAILED, "decode-0", "accept"),
    (OTHER, TOKEN, "decode-0", "forged"),
    (OTHER, FAILED, "decode-0", "forged"),
    (Sender("stage", "decode-0"), TOKEN, "decode-0", "accept"),  # the name decides, whatever pool it heads
])
def test_judge(sender, event, routed_to, verdict):
    assert judge(sender, event, routed_to) == verdict


def test_another_workers_chunks_and_failures_are_dropped_and_counted():
    async def scenario():
        streams = TokenStreams()
        stream = streams.open("r1")
        await streams.on_message(chunk("r1", 0, ("decode", "decode-1")))  # a forger, before the assignment
        await streams.on_message(chunk("r1", 0))  # the real worker, also early
        await assign(streams, "r1")
        await streams.on_message(chunk("r1", 1, ("decode", "decode-1")))
        await streams.on_message(sent(RequestFailed(request_id="r1", code="worker_failed", message="forged"),
                                      ("decode", "decode-1")))
        await streams.on_message(sent(RequestFailed(request_id="r1", code="no_worker", message="forged"),
                                      ("scheduler", "scheduler-0")))
        await streams.on_message(chunk("r1", 1))
        assert isinstance(await stream.next_event(1), Assignment)
        assert [(await stream.next_event(1)).token_ids for _ in range(2)] == [[0], [1]]
        assert stream.queue.empty() and streams.num_forged == 4

    asyncio.run(scenario())


def test_a_forgers_words_do_not_keep_a_silent_request_alive():
    async def scenario():
        streams = TokenStreams()
        stream = streams.open("r1")
        await assign(streams, "r1")
        assert isinstance(await stream.next_event(1), Assignment)
        heard_at = stream.heard_at
        await streams.on_message(sent(StreamAlive(request_id="r1"), ("decode", "decode-1")))
        assert stream.heard_at == heard_at and streams.num_forged == 1

    asyncio.run(scenario())


def test_what_is_held_before_the_assignment_is_bounded():
    async def scenario():
        streams = TokenStreams()
        stream = streams.open("r1")
        for seq in range(MAX_HELD_EVENTS + 10):
            await streams.on_message(chunk("r1", seq, ("decode", "decode-1")))
        assert len(stream.held) == MAX_HELD_EVENTS and streams.num_held_dropped == 10
        await assign(streams, "r1")
        assert not stream.held and streams.num_forged == MAX_HELD_EVENTS and stream.queue.qsize() == 1

    asyncio.run(scenario())


def test_an_event_for_another_request_than_its_subject_names_is_rejected():
    async def scenario():
        streams = TokenStreams()
        streams.open("r1")
        message = sent(TokenChunk(request_id="r1", seq=0, token_ids=[1], text="x"))
        message.subject = message.subject.replace(".r1.", ".r2.")
        await streams.on_message(message)
        assert streams.num_rejected == 1

    asyncio.run(scenario())


def test_a_decode_worker_believes_a_prefill_result_only_from_the_worker_that_took_its_job():
    """Signed by the prefill worker it names, and carrying the job's token (only the worker that took the job from
    the queue, or was offered it, knows it)."""
    from types import SimpleNamespace

    from contracts import PrefillResult, Subjects, sent_by
    from services.decode.remote_prefill import RemotePrefill

    async def scenario():
        remote = RemotePrefill.__new__(RemotePrefill)  # its results table alone: no engine behind it
        future = asyncio.get_running_loop().create_future()
        remote.results = {"r1": (future, b"t" * 32)}
        subject = Subjects("t").prefill_results("decode-0")

        async def deliver(result: PrefillResult, sender: str) -> None:
            await remote.on_result(result, SimpleNamespace(subject=sent_by(subject, "prefill", sender)))

        await deliver(PrefillResult(request_id="r1", ok=True, prefill_instance="prefill-0", job_token=b"t" * 32),
                      "prefill-1")  # names another worker than its sender
        await deliver(PrefillResult(request_id="r1", ok=True, prefill_instance="prefill-1", job_token=b"x" * 32),
                      "prefill-1")  # a worker that never took the job
        assert not future.done()
        taken = PrefillResult(request_id="r1", ok=True, prefill_instance="prefill-0", job_token=b"t" * 32)
        await deliver(taken, "prefill-0")
        assert future.result() is taken

    asyncio.run(scenario())
