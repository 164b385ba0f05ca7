"""The gateway's side of a request's life on the bus: submit, follow, move, cancel.

A request whose worker fails under it (gone from the registry or restarted, a failure it reports, or no word
within the idle deadline) moves to another worker, up to `migration_limit` times: it is submitted again under
a new bus id with the tokens its client already has, the new worker computes them after the prompt and goes on,
and the old one is told to cancel (a stalled worker that wakes up drops it). The client sees one stream.
The failed worker may not take it again, unless what failed was the way to it: a gap in the chunks, a lost
assignment, or silence from a worker whose registry entry shows it beating meanwhile.
"""

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from contracts import Assignment, CancelRequest, GenerateRequest, Subjects, TokenChunk
from services.common.identity import now_ms
from services.gateway.streams import RequestStream, StreamError, TokenStreams, silence_leaves_worker_intact
from shared.cancellation import raise_if_cancelled
from shared.engine import SamplingParams
from shared.telemetry.logging import get_logger

log = get_logger(__name__)

# The failures a request moves on from: its worker's or its stream's, never the request's own (bad input,
# overload, no worker).
MOVABLE_FAILURES = frozenset({"worker_failed", "timeout", "stream_broken"})
# The request queue may be without a leader for a few seconds when a cluster node goes: submits are sent again
# for this long before the client gets a 503.
SUBMIT_RETRY_S = 15.0
SUBMIT_RETRY_PAUSE_S = 0.25
SUBMIT_ATTEMPT_S = 2.0  # one attempt's wait for the stream's ack (a stuck one gives way to the next)


def may_move(code: str, moves: int, migration_limit: int) -> bool:
    """Whether a request that failed with `code`, moved `moves` times already, moves to another worker."""
    return code in MOVABLE_FAILURES and moves < migration_limit


@dataclass(frozen=True, slots=True)
class Submission:
    """What a request was submitted with: what it is submitted with again when it moves."""
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    headers: dict[str, str]


class RequestBus:
    def __init__(self, *, nc, subjects: Subjects, gateway_id: str, streams: TokenStreams,
                 idle_timeout_s: float, migration_limit: int,
                 assign_timeout_s: float = 30.0, on_move=lambda failure_code: None,
                 worker_alive_after: Callable[[str, str | None], float | None] = lambda instance_id, boot_id: None):
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects = subjects
        self.gateway_id = gateway_id
        self.streams = streams
        self.assign_timeout_s = assign_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.migration_limit = migration_limit
        self.on_move = on_move  # told the failure code of every move
        self.worker_alive_after = worker_alive_after  # a worker process's latest known sign of life (BeatsSeen)

    async def submit(self, request_id: str, model: str, prompt_token_ids: list[int], sampling: SamplingParams,
                     headers: dict[str, str] | None = None) -> RequestStream:
        """Queue the request for the scheduler (with `headers`, e.g. its trace context) and wait until a
        worker owns it.

        Raises StreamError (e.g. "no_worker") when it cannot start; nothing is
        left behind in that case.
        """
        stream = self.streams.open(request_id)
        stream.submission = Submission(model, prompt_token_ids, sampling, headers or {})
        try:
            await self._start_moving_on(stream)
        except BaseException:
            # Timed out, failed or the client left: make sure no worker keeps it.
            await self.release(stream)
            raise
        return stream

    async def _start(self, stream: RequestStream) -> None:
        """Publish the stream's current attempt and wait until a worker owns it."""
        submission = stream.submission
        created_ms = now_ms()
        request = GenerateRequest(
            request_id=stream.bus_id,
            model=submission.model,
            prompt_token_ids=submission.prompt_token_ids,
            sampling=submission.sampling,
            reply_subject=self.subjects.tokens(self.gateway_id, stream.bus_id),
            deadline_ms=created_ms + int(self.assign_timeout_s * 1000),
            created_ms=created_ms,
            resume_output_token_ids=list(stream.streamed_token_ids),
            moved_from=list(stream.failed_on),
            moves=stream.moves,
        )
        # Nats-Msg-Id lets JetStream drop a re-sent duplicate of the same attempt: sent again while the queue has
        # no leader (a cluster node lost, a new one being elected), it is queued once.
        headers = {**submission.headers, "Nats-Msg-Id": stream.bus_id}
        deadline = time.monotonic() + SUBMIT_RETRY_S
        while True:
            try:
                await self.js.publish(self.subjects.submit, request.encode(), headers=headers,
                                      timeout=max(0.5, min(SUBMIT_ATTEMPT_S, deadline - time.monotonic())))
                break
            except Exception as exc:  # NATS down, no stream or no leader for it, publish timeout
                if time.monotonic() + SUBMIT_RETRY_PAUSE_S >= deadline:
                    log.warning("submit failed", request_id=stream.request_id, error=repr(exc))
                    raise StreamError("no_worker", "the request queue is unavailable", retry_after_s=1.0) from exc
                log.info("submit failed; trying again", request_id=stream.request_id, error=repr(exc))
                await asyncio.sleep(SUBMIT_RETRY_PAUSE_S)
        raise_if_cancelled()  # (a cancel that came with the publish's ack: nobody waits for the assignment)
        event = await stream.next_event(self.assign_timeout_s)
        if not isinstance(event, Assignment):  # sent first on the worker's connection: it was lost on the way
            raise StreamError("stream_broken", "the worker's assignment was lost in transit", worker_intact=True)

    async def _start_moving_on(self, stream: RequestStream) -> None:
        """`_start`, moving the request on where its worker failed it before its first token. Not when nobody took
        it within the assignment deadline: another attempt would wait for the same workers."""
        while True:
            try:
                return await self._start(stream)
            except StreamError as exc:
                if exc.code == "timeout" or not may_move(exc.code, stream.moves, self.migration_limit):
                    raise
                await self._cancel(self._reroute(stream, exc), "moved")

    async def chunks(self, stream: RequestStream) -> AsyncIterator[TokenChunk]:
        """The request's token chunks in order, until the finished one, across the workers it moves to."""
        while not stream.finished:
            try:
                event = await stream.next_event(self.idle_timeout_s)
            except StreamError as exc:
                if not may_move(exc.code, stream.moves, self.migration_limit):
                    raise
                if exc.last_word_at is not None and stream.worker_instance is not None:
                    exc.worker_intact = silence_leaves_worker_intact(
                        self.worker_alive_after(stream.worker_instance, stream.worker_boot_id), exc.last_word_at)
                await self._move(stream, exc)
                continue
            if isinstance(event, TokenChunk):
                stream.streamed_token_ids.extend(event.token_ids)
                yield event

    async def _move(self, stream: RequestStream, failure: StreamError) -> None:
        """Go on with the request on another worker from the tokens its client has."""
        await self._cancel(self._reroute(stream, failure), "moved")
        await self._start_moving_on(stream)

    def _reroute(self, stream: RequestStream, failure: StreamError) -> str:
        """Make the stream's next attempt, the failed one's events no longer read; the failed one's bus id (for
        its cancel)."""
        old_bus_id, old_worker = stream.bus_id, stream.worker_instance
        self.streams.move(stream, exclude_worker=not failure.worker_intact)
        self.on_move(failure.code)
        log.warning("request moved to another worker", request_id=stream.request_id, from_worker=old_worker,
                    failure=failure.code, error=str(failure), tokens_streamed=len(stream.streamed_token_ids),
                    move=stream.moves)
        return old_bus_id

    async def release(self, stream: RequestStream) -> None:
        """Forget the request; if it is still running anywhere, cancel it there."""
        self.streams.close(stream.bus_id)
        if not stream.finished:
            await self._cancel(stream.bus_id, "client_disconnected")

    async def _cancel(self, bus_id: str, reason: str) -> None:
        try:
            await self.nc.publish(self.subjects.cancel, CancelRequest(request_id=bus_id, reason=reason).encode())
        except Exception as exc:
            log.warning("cancel publish failed", request_id=bus_id, error=repr(exc))

