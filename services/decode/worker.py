"""The decode role of an `EngineWorker`: takes handoffs, streams tokens.

In `colocated` mode it also prefills: every request it takes runs start to end
in its engine's continuous batch; in `disagg` mode a request the scheduler
marked remote gets its prompt computed by the prefill pool (`RemotePrefill`).
Per request it publishes `TokenChunk`s numbered from 0 on the request's reply
subject, signed with its own name (`sent_by`), so the gateway can tell a gap or a
duplicate from a healthy stream, and a forger from its worker (the scheduler
says which worker took the request). A request that has had nothing sent for
`STREAM_ALIVE_EVERY_S` (queued here, or a long prompt) gets a `StreamAlive`,
so the gateway's idle deadline can be seconds. A cancel ends a request with a
`cancelled` failure on its reply subject (a gateway that asked has forgotten
the request and drops it; one that did not is told at once), and a request
cancelled before it is offered here is refused.
"""

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import structlog
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from contracts import (
    CancelRequest,
    GenerateRequest,
    HandoffReply,
    LogprobEntry,
    PrefillResult,
    RequestFailed,
    STREAM_ALIVE_EVERY_S,
    StreamAlive,
    TokenChunk,
    from_anyone,
    sent_by,
)
from services.common.engine_loop import AddRequest, RequestRejected
from services.common.engine_worker import EngineWorker
from services.common.identity import now_ms
from services.common.role_epoch import STALE_ROLE, epoch_refusal
from services.decode.remote_prefill import RemotePrefill
from shared.engine import Continuation, InvalidRequestError, RequestOutput, SamplingParams
from shared.telemetry.logging import get_logger
from shared.telemetry.tracing import extract, inject, tracer

log = get_logger(__name__)

REMEMBERED_CANCELS = 4096  # ids cancelled before they reached this worker, refused if they come


@dataclass(slots=True)
class ActiveRequest:
    reply_subject: str  # the gateway's, signed by this worker
    span: trace.Span = trace.INVALID_SPAN  # the request's life on this worker, in its trace
    next_seq: int = 0
    sent_at: float = field(default_factory=time.monotonic)  # when its gateway last heard of it from here

    def end(self, status: str, message: str = "", **attributes) -> None:
        if not self.span.is_recording():
            return  # ended already (or tracing is off)
        self.span.set_attributes({"splitserve.status": status, **attributes})
        if status not in ("ok", "cancelled"):
            self.span.set_status(Status(StatusCode.ERROR, message or status))
        self.span.end()


class DecodeRole:
    def __init__(self, worker: EngineWorker, *, mode: str, max_active_requests: int, prefill_timeout_s: float,
                 drain_timeout_s: float, receiver=None):
        """`receiver`: the KV side channel (disagg mode), on which the prefill pool sends the prompts' KV."""
        self.worker = worker
        self.mode = mode
        self.max_active_requests = max_active_requests
        self.drain_timeout_s = drain_timeout_s
        self.remote = (RemotePrefill(worker, receiver, prefill_timeout_s, publish_chunk=self.publish_chunk,
                                     forget=self.forget) if receiver is not None else None)
        self.requests: dict[str, ActiveRequest] = {}
        self.handoffs_taken = 0  # requests taken since start; a heartbeat with this count shows them all
        self._generate_subscription = None
        self._results_subscription = None
        self._cancelled_elsewhere: OrderedDict[str, None] = OrderedDict()  # oldest first

    # ---- lifecycle --------------------------------------------------------------------
    async def start(self) -> list[asyncio.Task]:
        w = self.worker
        self._generate_subscription = await w.subscribe(w.subjects.worker_generate(w.instance_id), GenerateRequest,
                                                        self._on_generate)
        if self.remote is not None:
            self._results_subscription = await w.subscribe(from_anyone(w.subjects.prefill_results(w.instance_id)),
                                                           PrefillResult, self.remote.on_result)
        return [asyncio.create_task(self._keep_streams_alive(), name="stream-alive")]

    async def _keep_streams_alive(self) -> None:
        while True:
            await asyncio.sleep(STREAM_ALIVE_EVERY_S / 2)
            now = time.monotonic()
            for request_id, active in list(self.requests.items()):
                if now - active.sent_at >= STREAM_ALIVE_EVERY_S:
                    active.sent_at = now
                    try:
                        await self.worker.nc.publish(active.reply_subject, StreamAlive(request_id=request_id).encode())
                    except Exception as exc:  # NATS away: the gateway's deadline does what it should then
                        log.warning("stream-alive publish failed", request_id=request_id, error=repr(exc))
                        break

    async def drain(self, wait_s: float | None = None) -> None:
        """Take no more requests, let the running ones go on for the drain time (or `wait_s`), then hand the rest
        back to their gateways (a worker failure: they move the requests to other workers)."""
        await self._generate_subscription.unsubscribe()
        deadline = time.monotonic() + (self.drain_timeout_s if wait_s is None else wait_s)
        while self.requests and time.monotonic() < deadline and not self.worker.engine_loop.crashed:
            await asyncio.sleep(0.05)
        await self._hand_back_all(f"worker {self.worker.instance_id} is shutting down")

    async def _hand_back_all(self, message: str) -> None:
        """Stop computing every request here and fail it to its gateway as a worker failure (which moves it)."""
        for request_id, active in list(self.requests.items()):
            self.worker.engine_loop.abort(request_id)  # ends a remote prefill too
            await self._fail(request_id, active, "worker_failed", message)

    async def close(self) -> None:
        if self._results_subscription is not None:
            await self._results_subscription.unsubscribe()
        if self.remote is not None:
            await self.remote.stop()
            await self.remote.receiver.stop()
            self.worker.engine.disconnect(self.remote)

    def load(self) -> dict:
        engine = self.worker.engine
        return {"num_running": engine.num_running, "num_waiting": engine.num_waiting,
                "max_num_seqs": engine.config.max_num_seqs, "active_requests": len(self.requests),
                "handoffs_taken": self.handoffs_taken}

    def details(self) -> dict:
        remote = self.remote
        return {"mode": self.mode, "prefill_decisions": dict(remote.counts) if remote is not None else {},
                "kv_transfer": remote.transfer_details() if remote is not None else {}}

    def trace_of(self, request_id: str) -> dict[str, str] | None:
        """The trace context of a request's span here (for a pipeline's stages), None if it has none."""
        active = self.requests.get(request_id)
        return inject({}, active.span) if active is not None and active.span.is_recording() else None

    # ---- handlers (event loop) --------------------------------------------------------
    async def _on_generate(self, request: GenerateRequest, msg) -> None:
        w = self.worker
        reply, params = self._admit(request)
        if params is not None:
            # (The scheduler tells the gateway it is ours: the gateway holds what is sent here until then.)
            span = tracer().start_span(f"{w.identity.role}.request", context=extract(msg.headers),
                                       kind=SpanKind.CONSUMER, attributes={
                                           "splitserve.request_id": request.request_id,
                                           "splitserve.worker": w.instance_id,
                                           "splitserve.prompt_tokens": len(request.prompt_token_ids),
                                           "splitserve.prefill": request.prefill})
            active = ActiveRequest(sent_by(request.reply_subject, w.identity.role, w.instance_id), span)
            self.requests[request.request_id] = active
            self.handoffs_taken += 1  # with no await in between: a heartbeat counting it shows the request
            # The tasks started here log with the request's ids and hang their spans under its span.
            with trace.use_span(span), structlog.contextvars.bound_contextvars(request_id=request.request_id):
                # A moved request's tokens so far are computed here, after its prompt: never remotely.
                resumed = request.resume_output_token_ids
                if request.prefill == "remote" and self.remote is not None and not resumed:
                    self.remote.start(request, params, active)
                else:
                    if w.kv_store is not None:  # the engine loads the prefix the store holds when it admits it
                        w.kv_store.expect(request.request_id, request.prompt_token_ids, params.cache_salt)
                    w.engine_loop.add(AddRequest(request.request_id, request.prompt_token_ids, params,
                                                 Continuation(output_token_ids=list(resumed)) if resumed else None))
        if msg.reply:
            if reply.accepted:
                reply.handoffs_taken = self.handoffs_taken
            await msg.respond(reply.encode())

    def _admit(self, request: GenerateRequest) -> tuple[HandoffReply, SamplingParams | None]:
        """The reply to the scheduler, and the parameters when the request is newly taken."""

        def refuse(code: str, message: str, param: str | None = None):
            return HandoffReply(request_id=request.request_id, accepted=False, code=code, message=message, param=param), None

        w = self.worker
        if request.request_id in self.requests:
            return HandoffReply(request_id=request.request_id, accepted=True), None  # a redelivery: already ours
        if request.request_id in self._cancelled_elsewhere:
            return refuse("cancelled", "the request was cancelled before it reached a worker")
        stale = epoch_refusal("decode", request.role_epoch, w.identity.role, w.role_epoch)
        if stale is not None:  # routed before a role switch: the scheduler routes it again
            return refuse(STALE_ROLE, stale)
        if w.state != "ready":
            return refuse("draining", f"worker {w.instance_id} is {w.state}")
        if request.deadline_ms and request.deadline_ms < now_ms():
            return refuse("timeout", "the request's deadline has passed")
        if len(self.requests) >= self.max_active_requests:
            return refuse("overloaded", f"worker {w.instance_id} holds {len(self.requests)} requests")
        try:
            request.sampling.validate()  # the bus's decode checked its types, not its values
        except InvalidRequestError as exc:
            return refuse("invalid_request", str(exc), exc.param)
        return HandoffReply(request_id=request.request_id, accepted=True), request.sampling

    async def on_cancel(self, cancel: CancelRequest) -> None:
        active = self.requests.pop(cancel.request_id, None)
        if active is None:
            # Not here (yet): the scheduler may still offer it (the client left while it was queued).
            self._cancelled_elsewhere[cancel.request_id] = None
            while len(self._cancelled_elsewhere) > REMEMBERED_CANCELS:
                self._cancelled_elsewhere.popitem(last=False)
            return
        self.worker.engine_loop.abort(cancel.request_id)  # ends a remote prefill or kv-store load too
        active.end("cancelled", reason=cancel.reason)
        log.info("request cancelled", request_id=cancel.request_id, reason=cancel.reason)
        await self.worker.nc.publish(active.reply_subject, RequestFailed(
            request_id=cancel.request_id, code="cancelled",
            message=f"the request was cancelled on worker {self.worker.instance_id} ({cancel.reason})").encode())

    async def lapsed(self) -> None:
        """Every request here was taken for lost and moved by its gateway: stop computing it, and say so to a
        gateway that has not noticed yet (it moves the request now; one that has drops the message)."""
        await self._hand_back_all(f"worker {self.worker.instance_id} stalled: its registry entry lapsed")

    async def publish_chunk(self, active: ActiveRequest, chunk: TokenChunk) -> None:
        active.next_seq += 1
        active.sent_at = time.monotonic()
        await self.worker.nc.publish(active.reply_subject, chunk.encode())

    def forget(self, request_id: str) -> None:
        """The request ended outside the engine (a remote prefill's first token was its last)."""
        self.requests.pop(request_id, None)

    # ---- outputs ----------------------------------------------------------------------
    async def on_outputs(self, items: list[RequestOutput | RequestRejected]) -> None:
        for item in items:
            active = self.requests.get(item.request_id)
            if active is None:
                continue  # cancelled meanwhile
            if isinstance(item, RequestRejected):
                param = getattr(item.error, "param", None)
                await self._fail(item.request_id, active, "invalid_request", str(item.error), param)
                continue
            if item.error is not None:  # the engine could not go on with it (a pipeline stage failed)
                await self._fail(item.request_id, active, "worker_failed", item.error, worker_intact=True)
                continue
            chunk = TokenChunk(
                request_id=item.request_id,
                seq=active.next_seq,
                token_ids=item.new_token_ids,
                text=item.new_text,
                logprobs=[LogprobEntry.of(lp) for lp in item.new_logprobs] or None,
                prompt_logprobs=(None if item.prompt_logprobs is None
                                 else [LogprobEntry.of(lp) for lp in item.prompt_logprobs]),
                finished=item.finished,
                finish_reason=item.finish_reason,
                prompt_tokens=item.num_prompt_tokens,
                completion_tokens=item.num_output_tokens,
                cached_tokens=item.num_cached_tokens,
            )
            data = chunk.encode()
            if len(data) > self.worker.nc.max_payload:  # (a long prompt's logprobs): refused, never a crash
                if not item.finished:
                    self.worker.engine_loop.abort(item.request_id)
                await self._fail(item.request_id, active, "invalid_request",
                                 f"the response's first chunk ({len(data)} bytes, with the prompt's logprobs) is "
                                 f"larger than the bus carries ({self.worker.nc.max_payload}); ask for fewer "
                                 "prompt_logprobs", "prompt_logprobs")
                continue
            active.next_seq += 1
            active.sent_at = time.monotonic()
            if item.finished:
                del self.requests[item.request_id]
                active.end("ok", **{"splitserve.completion_tokens": item.num_output_tokens,
                                    "splitserve.cached_tokens": item.num_cached_tokens,
                                    "splitserve.finish_reason": item.finish_reason or ""})
            await self.worker.nc.publish(active.reply_subject, data)

    async def _fail(self, request_id: str, active: ActiveRequest, code: str, message: str, param: str | None = None,
                    worker_intact: bool = False) -> None:
        self.requests.pop(request_id, None)
        active.end(code, message)
        await self.worker.nc.publish(active.reply_subject, RequestFailed(
            request_id=request_id, code=code, message=message, param=param, worker_intact=worker_intact).encode())
