"""The decode worker's NATS side: takes handoffs, streams tokens, answers stats.

In `colocated` mode it also prefills: every request it takes runs start to end
in its engine's continuous batch. Per request it first publishes an
`Assignment` on the request's reply subject, then `TokenChunk`s numbered from
0, so the gateway can tell a gap or a duplicate from a healthy stream.
"""

import asyncio
import time
from dataclasses import dataclass

import structlog
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from contracts import (
    Assignment,
    CancelRequest,
    GenerateRequest,
    HandoffReply,
    PrefillResult,
    RequestFailed,
    ServiceInfo,
    StatsRequest,
    Subjects,
    TokenChunk,
)
from services.common.cpu_loan import CpuShare, loan_details
from services.common.engine_loop import DEFAULT_GATHER_S, AddRequest, EngineLoop, RequestRejected
from services.common.engine_thread import EngineThread
from services.common.identity import ServiceIdentity, now_ms
from services.common.kv_events import engine_kv_events, kv_hashing_details
from services.decode.remote_prefill import remote_prefill
from shared.telemetry.tracing import extract, tracer
from shared.bus.registry import Heartbeat, Registry
from shared.bus.subscribe import REJECTED, subscribe_typed
from shared.engine.engine import LLMEngine, RequestOutput
from shared.engine.errors import InvalidRequestError
from shared.engine.sampling_params import SamplingParams
from shared.telemetry.histogram import CumulativeHistogram
from shared.telemetry.logging import get_logger

log = get_logger(__name__)

TRANSFER_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


@dataclass(slots=True)
class ActiveRequest:
    reply_subject: str
    span: trace.Span = trace.INVALID_SPAN  # the request's life on this worker, in its trace
    next_seq: int = 0
    preparing: asyncio.Task | None = None  # before it reaches the engine: a remote prefill, a kv-store load

    def end(self, status: str, message: str = "", **attributes) -> None:
        if not self.span.is_recording():
            return  # ended already (or tracing is off)
        self.span.set_attributes({"splitserve.status": status, **attributes})
        if status not in ("ok", "cancelled"):
            self.span.set_status(Status(StatusCode.ERROR, message or status))
        self.span.end()


class DecodeWorker:
    def __init__(
        self,
        *,
        nc,
        registry: Registry,
        engine: LLMEngine,
        engine_thread: EngineThread,
        subjects: Subjects,
        instance_id: str,
        model: str,
        served_model_name: str,
        mode: str,
        max_active_requests: int,
        receiver=None,
        prefill_timeout_s: float = 30.0,
        kv_cache=None,
        cpu_share: CpuShare | None = None,
        gather_s: float = DEFAULT_GATHER_S,
    ):
        self.nc = nc
        self.registry = registry
        self.engine = engine
        self.subjects = subjects
        self.instance_id = instance_id
        self.model = model
        self.served_model_name = served_model_name
        self.mode = mode
        self.max_active_requests = max_active_requests
        self.receiver = receiver  # the KV side channel (disagg mode)
        self.kv_cache = kv_cache  # services.common.kvstore_cache.KVStoreCache, with --kv-store
        self.prefill_timeout_s = prefill_timeout_s
        self.prefill_results: dict[str, asyncio.Future] = {}
        self.prefill_counts: dict[str, int] = {}
        self.transfer_seconds = CumulativeHistogram(TRANSFER_BUCKETS_S)
        self.identity = ServiceIdentity(instance_id, "decode")
        self.state = "starting"
        self.requests: dict[str, ActiveRequest] = {}
        self.handoffs_taken = 0  # requests taken since start; a heartbeat with this count shows them all
        # Filled once per engine step by the engine thread; drained in order by one publisher.
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self.engine_loop = EngineLoop(engine, self._emit_from_engine_thread, engine_thread, cpu_share, gather_s)
        self.kv_events = engine_kv_events(nc=nc, subjects=subjects, identity=self.identity, engine=engine,
                                          engine_loop=self.engine_loop)
        self._heartbeat = Heartbeat(registry, self.info)
        self._subscriptions = []

    # ---- lifecycle --------------------------------------------------------------------
    async def start(self) -> list[asyncio.Task]:
        self.engine_loop.start()
        self._subscriptions = [
            await subscribe_typed(self.nc, self.subjects.worker_generate(self.instance_id), GenerateRequest, self._on_generate),
            await subscribe_typed(self.nc, self.subjects.cancel, CancelRequest, self._on_cancel),
            await subscribe_typed(self.nc, self.subjects.stats(self.instance_id), StatsRequest, self._on_stats),
        ]
        if self.receiver is not None:
            self._subscriptions.append(await subscribe_typed(
                self.nc, self.subjects.prefill_results(self.instance_id), PrefillResult, self._on_prefill_result))
        event_tasks = await self.kv_events.start()
        await self.nc.flush()
        self.state = "ready"
        self._heartbeat.start()
        return [asyncio.create_task(self._publish_outputs(), name="publish-outputs"), *event_tasks]

    async def stop(self, drain_timeout_s: float = 5.0) -> None:
        """Stop taking work, let running requests finish briefly, fail the rest, leave the registry."""
        self.state = "draining"
        for sub in self._subscriptions[:1]:
            await sub.unsubscribe()
        deadline = time.monotonic() + drain_timeout_s
        while self.requests and time.monotonic() < deadline and not self.engine_loop.crashed:
            await asyncio.sleep(0.05)
        for request_id, active in list(self.requests.items()):
            if active.preparing is not None:
                active.preparing.cancel()
            self.engine_loop.abort(request_id)
            await self._fail(request_id, active, "worker_failed", "the worker is shutting down")
        await asyncio.to_thread(self.engine_loop.stop, 1.0)  # a step in flight may not finish: the thread is a daemon
        if self.receiver is not None:
            await self.receiver.stop()
        if self.kv_cache is not None:
            await self.kv_cache.stop()
        await self._heartbeat.stop(remove=True)

    def info(self) -> ServiceInfo:
        block_manager = self.engine.block_manager
        return self.identity.info(
            model=self.model,
            served_model_name=self.served_model_name,
            state=self.state,
            num_running=self.engine.num_running,
            num_waiting=self.engine.num_waiting,
            max_num_seqs=self.engine.config.max_num_seqs,
            kv_blocks_total=block_manager.num_blocks,
            kv_blocks_free=block_manager.num_free_blocks,
            max_model_len=self.engine.max_model_len,
            details={"mode": self.mode, "active_requests": len(self.requests), "handoffs_taken": self.handoffs_taken,
                     "rejected_messages": dict(REJECTED),
                     "prefill_decisions": dict(self.prefill_counts), "kv_transfer": self._transfer_details(),
                     "uses_kv_store": self.kv_cache is not None,
                     "prefix_cache": self.engine.prefix_cache_counts(),
                     "kv_store": self.kv_cache.details() if self.kv_cache is not None else {},
                     "kv_events": dict(self.kv_events.counts), "cpu_loan": loan_details(self.engine_loop.cpu_share),
                     **kv_hashing_details(self.engine)},
        )

    # ---- handlers (event loop) --------------------------------------------------------
    async def _on_generate(self, request: GenerateRequest, msg) -> None:
        reply, params = self._admit(request)
        if params is not None:
            # The assignment goes out before any token, on the same connection, so it arrives first.
            await self.nc.publish(
                request.reply_subject,
                Assignment(request_id=request.request_id, worker_instance=self.instance_id,
                           worker_boot_id=self.identity.boot_id).encode(),
            )
            span = tracer().start_span(f"{self.identity.role}.request", context=extract(msg.headers),
                                       kind=SpanKind.CONSUMER, attributes={
                                           "splitserve.request_id": request.request_id,
                                           "splitserve.worker": self.instance_id,
                                           "splitserve.prompt_tokens": len(request.prompt_token_ids),
                                           "splitserve.prefill": request.prefill})
            active = ActiveRequest(request.reply_subject, span)
            self.requests[request.request_id] = active
            self.handoffs_taken += 1  # with no await in between: a heartbeat counting it shows the request
            # The tasks started here log with the request's ids and hang their spans under its span.
            with trace.use_span(span), structlog.contextvars.bound_contextvars(request_id=request.request_id):
                if request.prefill == "remote" and self.receiver is not None:
                    active.preparing = asyncio.create_task(remote_prefill(self, request, params, active))
                elif self.kv_cache is not None:
                    active.preparing = asyncio.create_task(self._load_prefix_then_add(request, params))
                else:
                    self.engine_loop.add(AddRequest(request.request_id, request.prompt_token_ids, params))
        if msg.reply:
            if reply.accepted:
                reply.handoffs_taken = self.handoffs_taken
            await msg.respond(reply.encode())

    def _admit(self, request: GenerateRequest) -> tuple[HandoffReply, SamplingParams | None]:
        """The reply to the scheduler, and the parameters when the request is newly taken."""

        def refuse(code: str, message: str, param: str | None = None):
            return HandoffReply(request_id=request.request_id, accepted=False, code=code, message=message, param=param), None

        if request.request_id in self.requests:
            return HandoffReply(request_id=request.request_id, accepted=True), None  # a redelivery: already ours
        if self.state != "ready":
            return refuse("draining", f"worker {self.instance_id} is {self.state}")
        if request.deadline_ms and request.deadline_ms < now_ms():
            return refuse("timeout", "the request's deadline has passed")
        if len(self.requests) >= self.max_active_requests:
            return refuse("overloaded", f"worker {self.instance_id} holds {len(self.requests)} requests")
        try:
            params = SamplingParams(**request.sampling)
        except InvalidRequestError as exc:
            return refuse("invalid_request", str(exc), exc.param)
        except TypeError as exc:
            return refuse("invalid_request", f"unknown sampling parameter: {exc}")
        return HandoffReply(request_id=request.request_id, accepted=True), params

    async def _on_cancel(self, cancel: CancelRequest, msg) -> None:
        active = self.requests.pop(cancel.request_id, None)
        if active is not None:
            if active.preparing is not None:
                active.preparing.cancel()  # releases its reserved blocks (and a remote prefill's expected transfer)
            self.engine_loop.abort(cancel.request_id)
            active.end("cancelled", reason=cancel.reason)
            log.info("request cancelled", request_id=cancel.request_id, reason=cancel.reason)

    async def _on_prefill_result(self, result: PrefillResult, msg) -> None:
        future = self.prefill_results.get(result.request_id)
        if future is not None and not future.done():
            future.set_result(result)  # later duplicates (a redelivered job) are ignored

    async def publish_chunk(self, active: ActiveRequest, chunk: TokenChunk) -> None:
        active.next_seq += 1
        await self.nc.publish(active.reply_subject, chunk.encode())

    def _transfer_details(self) -> dict:
        if self.receiver is None:
            return {}
        return {**self.receiver.stats.snapshot(), "seconds_histogram": self.transfer_seconds.snapshot()}

    async def _load_prefix_then_add(self, request: GenerateRequest, params: SamplingParams) -> None:
        """Start the request with its cached prefix from the kv-store, when the store has one."""
        options = await self.kv_cache.load_prefix(request.prompt_token_ids)
        if request.request_id not in self.requests:  # cancelled meanwhile
            if "reserved" in options:
                block_ids = options["reserved"][0]
                self.engine_loop.call(lambda engine: engine.release_blocks(block_ids))
            return
        self.engine_loop.add(AddRequest(request.request_id, request.prompt_token_ids, params, options))

    def count_prefill(self, outcome: str) -> None:
        """How a request's prompt was computed; also on the current span (the remote prefill's)."""
        self.prefill_counts[outcome] = self.prefill_counts.get(outcome, 0) + 1
        trace.get_current_span().set_attribute("splitserve.prefill_outcome", outcome)

    def record_transfer(self, result) -> None:
        self.transfer_seconds.observe(result.seconds)
        trace.get_current_span().set_attributes(result.span_attributes())

    async def _on_stats(self, _: StatsRequest, msg) -> None:
        if msg.reply:
            await msg.respond(self.info().encode())

    # ---- outputs ----------------------------------------------------------------------
    def _emit_from_engine_thread(self, items: list[RequestOutput | RequestRejected]) -> None:
        self._loop.call_soon_threadsafe(self._outbox.put_nowait, items)

    async def _publish_outputs(self) -> None:
        while True:
            items = await self._outbox.get()
            if self.engine_loop.crashed is not None:
                raise RuntimeError("the engine loop crashed") from self.engine_loop.crashed
            for item in items:
                active = self.requests.get(item.request_id)
                if active is None:
                    continue  # cancelled meanwhile
                if isinstance(item, RequestRejected):
                    param = getattr(item.error, "param", None)
                    await self._fail(item.request_id, active, "invalid_request", str(item.error), param)
                    continue
                if item.error is not None:  # the engine could not go on with it (a pipeline stage failed)
                    await self._fail(item.request_id, active, "worker_failed", item.error)
                    continue
                chunk = TokenChunk(
                    request_id=item.request_id,
                    seq=active.next_seq,
                    token_ids=item.new_token_ids,
                    text=item.new_text,
                    logprobs=[{"token_id": lp.token_id, "logprob": lp.logprob, "top": [list(t) for t in lp.top]}
                              for lp in item.new_logprobs] or None,
                    finished=item.finished,
                    finish_reason=item.finish_reason,
                    prompt_tokens=item.num_prompt_tokens,
                    completion_tokens=item.num_output_tokens,
                    cached_tokens=item.num_cached_tokens,
                )
                active.next_seq += 1
                if item.finished:
                    del self.requests[item.request_id]
                    active.end("ok", **{"splitserve.completion_tokens": item.num_output_tokens,
                                        "splitserve.cached_tokens": item.num_cached_tokens,
                                        "splitserve.finish_reason": item.finish_reason or ""})
                await self.nc.publish(active.reply_subject, chunk.encode())

    async def _fail(self, request_id: str, active: ActiveRequest, code: str, message: str, param: str | None = None) -> None:
        self.requests.pop(request_id, None)
        active.end(code, message)
        await self.nc.publish(
            active.reply_subject, RequestFailed(request_id=request_id, code=code, message=message, param=param).encode()
        )
