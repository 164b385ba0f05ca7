"""Per-request event streams arriving at this gateway over NATS.

One wildcard subscription receives every event for this gateway's requests;
each is decoded, judged by its sender (`attribution`: only the worker the
scheduler assigned speaks for a request) and routed to its request's bounded
queue. A `RequestStream`
checks the chunk sequence numbers, so a gap or a duplicate becomes an error
instead of wrong text. The worker that owns a request is watched through the
registry: if it disappears or restarts, its requests fail at once rather than
waiting out their deadline.
"""

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from contracts import (STREAM_ALIVE_EVERY_S, Assignment, ContractError, RequestFailed, Sender, ServiceInfo,
                       StreamAlive, TokenChunk, decode_one_of, sender_of)
from services.gateway.attribution import judge
from shared.bus.subscribe import reject_unattributed
from shared.telemetry.logging import get_logger

log = get_logger(__name__)

MAX_QUEUED_EVENTS = 4096  # per request; a consumer this far behind is failed, not buffered forever
# Per request: workers' events held until the scheduler's assignment (its connection may lag the worker's by a NATS
# node's failover, seconds of tokens); past this they are dropped and counted, and the gap moves the request.
MAX_HELD_EVENTS = MAX_QUEUED_EVENTS


class StreamError(Exception):
    """The request ended badly; `code` is a RequestFailed code."""

    def __init__(self, code: str, message: str, param: str | None = None, retry_after_s: float | None = None,
                 worker_intact: bool = False, last_word_at: float | None = None):
        super().__init__(message)
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s
        self.worker_intact = worker_intact  # the worker said it can serve again (RequestFailed.worker_intact)
        self.last_word_at = last_word_at  # went silent: when (time.monotonic()) its worker last said a word for it


def silence_leaves_worker_intact(worker_alive_after: float | None, last_word_at: float) -> bool:
    """Whether a stream that went silent leaves its worker free to take the request again: its process was alive
    (`BeatsSeen.alive_after`) two of its word intervals after its last word for the request. It was there while
    it said nothing more of the request, so what went missing is the request's messages (its last chunk, lost
    with the gateway's NATS node) or the request itself, not the worker; the one worker of a pool must not be
    ruled out for it. A worker frozen or gone has shown no such sign."""
    return worker_alive_after is not None and worker_alive_after >= last_word_at + 2 * STREAM_ALIVE_EVERY_S


@dataclass(slots=True)
class RequestStream:
    """One client request's events. `bus_id` names its current attempt on the bus: the request id, then a new
    one each time it moves to another worker (`TokenStreams.move`), so nothing from an earlier attempt's worker
    reaches it."""
    request_id: str
    bus_id: str = ""
    queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(MAX_QUEUED_EVENTS))
    worker_instance: str | None = None
    worker_boot_id: str | None = None
    assigned_at: float = 0.0
    next_seq: int = 0
    finished: bool = False
    moves: int = 0
    streamed_token_ids: list[int] = field(default_factory=list)  # every token the client has been sent
    failed_on: list[str] = field(default_factory=list)  # the worker processes (boot ids) it moved away from
    submission: Any = None  # what it was submitted with (the request bus's), submitted again when it moves
    heard_at: float = field(default_factory=time.monotonic)  # the last word for this attempt (sent, or from its worker)
    routed_to: str | None = None  # the worker the scheduler assigned this attempt to, as soon as its word arrives
    held: list[tuple[Sender, Any]] = field(default_factory=list)  # workers' events before that word

    def __post_init__(self) -> None:
        self.bus_id = self.bus_id or self.request_id

    async def next_event(self, timeout_s: float) -> Assignment | TokenChunk:
        """The next event in order; raises StreamError on failure, gap, duplicate, or `timeout_s` without a word
        for the request (an event, or its worker's `StreamAlive`)."""
        while True:
            left = self.heard_at + timeout_s - time.monotonic()
            if left <= 0:
                if self.worker_instance is None:
                    raise StreamError("timeout", f"no worker took the request within {timeout_s:g} s")
                # A taken request hears from its worker every second: this one is stalled or gone (or the words
                # were lost on the way: `silence_leaves_worker_intact` tells).
                raise StreamError("worker_failed", f"worker {self.worker_instance} went silent: no word from it "
                                                   f"for {timeout_s:g} s",
                                  last_word_at=self.heard_at)
            try:
                async with asyncio.timeout(left):  # unlike 3.11's wait_for, never swallows a cancel
                    event = await self.queue.get()
                break
            except TimeoutError:
                continue  # maybe its worker said it is still at it meanwhile
        if isinstance(event, RequestFailed):
            self.finished = True
            raise StreamError(event.code, event.message, event.param, event.retry_after_s, event.worker_intact)
        if isinstance(event, Assignment):
            self.worker_instance, self.worker_boot_id = event.worker_instance, event.worker_boot_id
            self.assigned_at = time.monotonic()
            return event
        if event.seq != self.next_seq:
            self.finished = True
            gap = event.seq > self.next_seq
            # Movable, from what the client has. A gap is chunks lost in transit (the gateway's NATS node going
            # away under it): its worker is not at fault, and may be the only one there is, so it may take the
            # request again. A duplicate is two workers on one attempt: the one it heard from is ruled out.
            raise StreamError("stream_broken", f"token stream {'gap' if gap else 'duplicate'}: expected chunk "
                                               f"{self.next_seq}, got {event.seq}", worker_intact=gap)
        self.next_seq += 1
        self.finished = event.finished
        return event


class TokenStreams:
    def __init__(self):
        self._streams: dict[str, RequestStream] = {}
        self.num_rejected = 0
        self.num_forged = 0  # events dropped because their sender does not speak for the request
        self.num_held_dropped = 0  # workers' events dropped while their request waited for its assignment

    def open(self, request_id: str) -> RequestStream:
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        return stream

    def close(self, bus_id: str) -> None:
        self._streams.pop(bus_id, None)

    def move(self, stream: RequestStream, exclude_worker: bool = True) -> str:
        """Start the stream's next attempt: a new bus id (returned), its events from chunk 0, no worker yet.
        `exclude_worker`: the attempt may not go to the failed one's worker process again."""
        self._streams.pop(stream.bus_id, None)
        stream.moves += 1
        if exclude_worker and stream.worker_boot_id is not None:
            stream.failed_on.append(stream.worker_boot_id)
        stream.bus_id = f"{stream.request_id}-moved-{stream.moves}"
        while not stream.queue.empty():
            stream.queue.get_nowait()
        stream.worker_instance = stream.worker_boot_id = stream.routed_to = None
        stream.held.clear()
        stream.next_seq, stream.finished = 0, False
        stream.heard_at = time.monotonic()
        self._streams[stream.bus_id] = stream
        return stream.bus_id

    def __len__(self) -> int:
        return len(self._streams)

    def num_waiting(self) -> int:
        """Open requests that have had no token yet (queued, or prefilling): the queue admission bounds."""
        return sum(1 for s in self._streams.values() if s.next_seq == 0 and not s.streamed_token_ids)

    async def on_message(self, msg) -> None:
        """Subscription callback for `{ns}.tokens.{gateway}.*.*.*` (request, then its sender's role and name)."""
        try:
            event = decode_one_of(msg.data, Assignment, TokenChunk, RequestFailed, StreamAlive)
            if msg.subject.split(".")[-3] != event.request_id:
                raise ContractError(f"{type(event).__name__} for {event.request_id!r} on another request's subject",
                                    "wrong_subject")
        except ContractError as exc:
            self.num_rejected += 1
            log.warning("rejected token stream message", subject=msg.subject, reason=exc.reason, error=str(exc))
            return
        stream = self._streams.get(event.request_id)
        if stream is None:
            return  # the request is gone (finished or client left)
        sender = sender_of(msg.subject)
        verdict = judge(sender, event, stream.routed_to)
        if verdict == "forged":
            self._forged(sender, event, stream)
        elif verdict == "hold":
            if isinstance(event, StreamAlive):
                return
            if len(stream.held) < MAX_HELD_EVENTS:
                stream.held.append((sender, event))
                return
            self.num_held_dropped += 1
            if self.num_held_dropped in (1, 10, 100) or self.num_held_dropped % 1000 == 0:
                log.warning("events dropped while their request waited for its assignment", request_id=stream.bus_id,
                            dropped_in_all=self.num_held_dropped)
        elif verdict == "accept":
            if isinstance(event, Assignment):
                stream.routed_to = event.worker_instance
            self._deliver(stream, event)
            if isinstance(event, Assignment):
                held, stream.held = stream.held, []
                for held_sender, held_event in held:
                    if held_sender.instance_id == stream.routed_to:
                        self._deliver(stream, held_event)
                    else:
                        self._forged(held_sender, held_event, stream)

    def _deliver(self, stream: RequestStream, event) -> None:
        stream.heard_at = time.monotonic()
        if isinstance(event, StreamAlive):
            return
        try:
            stream.queue.put_nowait(event)
        except asyncio.QueueFull:
            self._fail(stream, "internal", "the client is reading too slowly; the stream overflowed")

    def _forged(self, sender: Sender, event, stream: RequestStream) -> None:
        self.num_forged += 1
        reject_unattributed(sender, type(event).__name__, f"request {stream.bus_id} is "
                            + (f"{stream.routed_to}'s" if stream.routed_to else "not assigned yet"))

    def fail_orphans(self, services: list[ServiceInfo], listed_at: float) -> None:
        """Fail requests whose worker has left the registry or restarted since taking them.

        `listed_at` (time.monotonic) is when the registry was read: requests
        assigned after that are judged by the next reading.
        """
        boots = {s.instance_id: s.boot_id for s in services}
        for stream in list(self._streams.values()):
            if stream.worker_instance is None or stream.finished or stream.assigned_at >= listed_at:
                continue
            if boots.get(stream.worker_instance) != stream.worker_boot_id:
                self._fail(stream, "worker_failed", f"worker {stream.worker_instance} stopped while serving the request")

    def fail_all(self, code: str, message: str) -> None:
        """End every open request (the gateway is shutting down)."""
        for stream in list(self._streams.values()):
            self._fail(stream, code, message)

    def _fail(self, stream: RequestStream, code: str, message: str) -> None:
        # What was queued no longer matters: the reader's next event is the reason it ends.
        while not stream.queue.empty():
            stream.queue.get_nowait()
        stream.queue.put_nowait(RequestFailed(request_id=stream.request_id, code=code, message=message))
