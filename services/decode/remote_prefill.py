"""A decode worker's side of a remotely prefilled request: the engine's connector that loads a prompt's KV
from the prefill pool.

    start: the request goes to the engine, which is not to compute its prompt
    -> the engine admits it, gives it blocks: start_load
    -> expect the KV on the side channel, queue a PrefillJob
    -> first token arrives: stream it at once -> KV arrives: the load ends with the first token,
       and the engine decodes on

Any step that fails or misses its deadline ends the load as failed, and the engine prefills locally
(counted), never a hang: after the first token if it was already streamed (sampling is stateless per
position, so the tokens are the same either way). A request that ends meanwhile (cancelled, or the first
token was its last) ends its load, and the engine frees the blocks once it has.
"""

import asyncio
import dataclasses
import hmac
import random
import threading
import time

from collections.abc import Awaitable, Callable

import msgspec
import nats.errors
from opentelemetry import context as otel_context
from opentelemetry import trace

from contracts import GenerateRequest, HandoffReply, PrefillJob, PrefillResult, TokenChunk, sender_of
from services.common.engine_loop import AddRequest
from services.common.load_reports import LoadReports
from shared.bus.registry import Registry
from shared.bus.subscribe import reject_unattributed
from shared.engine import FirstToken, KVConnector, KVOrigin, LoadEnd, SamplingParams
from shared.telemetry.histogram import CumulativeHistogram
from shared.telemetry.logging import get_logger
from shared.telemetry.tracing import inject, tracer

log = get_logger(__name__)

_OFFER_TIMEOUT_S = 1.0  # a prefill worker answers an offer at once
_WATCH_S = 1.0  # how often the registry is checked for a prefill worker that took a job directly
TRANSFER_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


@dataclasses.dataclass(slots=True)
class _Remote:
    """A remotely prefilled request, from `start` until it ends."""

    request: GenerateRequest
    params: SamplingParams
    active: object  # the decode role's ActiveRequest: where its tokens stream
    context: otel_context.Context  # the request's span, for the remote prefill's
    task: asyncio.Task | None = None
    first: FirstToken | None = None  # the first token, once it came and the engine judged it


class RemotePrefill(KVConnector):
    """A decode worker's remote prefills: `start` one per request; `on_result` takes the prefill pool's replies."""

    def __init__(self, worker, receiver, timeout_s: float, *,
                 publish_chunk: Callable[[object, TokenChunk], Awaitable[None]], forget: Callable[[str], None]):
        """`worker`: the EngineWorker; `receiver`: its KV side channel; `publish_chunk(active, chunk)` streams a
        token of a request; `forget(request_id)` ends a request that finished at its first token."""
        self.worker = worker
        self.receiver = receiver
        self.timeout_s = timeout_s
        self.publish_chunk = publish_chunk
        self.forget = forget
        self.results: dict[str, tuple[asyncio.Future, bytes]] = {}  # request id -> (its result, its job's token)
        self.counts: dict[str, int] = {}  # how the prompts were computed, by outcome
        self.transfer_seconds = CumulativeHistogram(TRANSFER_BUCKETS_S)
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()  # the requests, shared with the engine thread
        self._remotes: dict[str, _Remote] = {}
        self._ended = LoadReports(lambda: worker.engine_loop.wake())
        worker.engine.connect(self)

    def transfer_details(self) -> dict:
        return {**self.receiver.stats.snapshot(), "seconds_histogram": self.transfer_seconds.snapshot()}

    async def on_result(self, result: PrefillResult, msg) -> None:
        sender = sender_of(msg.subject)
        if sender.instance_id != result.prefill_instance or sender.role not in ("prefill", "stage"):
            reject_unattributed(sender, "prefill result", f"it names prefill worker {result.prefill_instance}")
            return
        waiting = self.results.get(result.request_id)
        if waiting is None:
            return  # over (or never asked for here)
        future, job_token = waiting
        if not hmac.compare_digest(result.job_token, job_token):  # only the worker that took the job knows it
            reject_unattributed(sender, "prefill result", "it does not carry its job's token")
            return
        if not future.done():
            future.set_result(result)  # later duplicates (a redelivered job) are ignored

    def _count(self, outcome: str) -> None:
        """How a request's prompt was computed; also on the current span (the remote prefill's)."""
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        trace.get_current_span().set_attribute("splitserve.prefill_outcome", outcome)

    # ---- the service's side (event loop) ------------------------------------------------------------
    def start(self, request: GenerateRequest, params: SamplingParams, active) -> None:
        """Hand the request to the engine, whose admission starts the remote prefill (under the current span)."""
        if params.seed is None:  # fix the seed here, so prefill, decode and any fallback sample alike
            params = msgspec.structs.replace(params, seed=random.getrandbits(63))
        with self._lock:
            self._remotes[request.request_id] = _Remote(request, params, active, otel_context.get_current())
        self.worker.engine_loop.add(AddRequest(request.request_id, request.prompt_token_ids, params,
                                               read_prefix_cache=False))

    async def stop(self) -> None:
        with self._lock:
            tasks = [r.task for r in self._remotes.values() if r.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- the engine's hooks (engine thread) ---------------------------------------------------------
    def external_prefix(self, request_id: str, token_ids: list[int], num_local_tokens: int) -> int | None:
        with self._lock:
            remote = self._remotes.get(request_id)
        return 0 if remote is None else len(remote.request.prompt_token_ids) - num_local_tokens

    def start_load(self, request_id: str, block_ids: list[int], first_token: int, num_tokens: int) -> None:
        self._loop.call_soon_threadsafe(self._begin, request_id, block_ids)

    def finished_loads(self) -> list[LoadEnd]:
        return self._ended.take()

    def request_finished(self, request_id: str) -> None:
        with self._lock:
            remote = self._remotes.pop(request_id, None)
        if remote is not None:
            self._loop.call_soon_threadsafe(_cancel, remote)

    # ---- one remote prefill (event loop) ------------------------------------------------------------
    def _begin(self, request_id: str, block_ids: list[int]) -> None:
        with self._lock:
            remote = self._remotes.get(request_id)
        if remote is None:  # it ended before its load began
            self._ended.report(LoadEnd(request_id, False))
            return
        token = otel_context.attach(remote.context)  # the task runs in (a copy of) the request's context
        try:
            remote.task = self._loop.create_task(self._run(remote, block_ids))
        finally:
            otel_context.detach(token)

    async def _run(self, remote: _Remote, block_ids: list[int]) -> None:
        rid = remote.request.request_id
        end = LoadEnd(rid, False)
        try:
            with tracer().start_as_current_span("decode.remote_prefill"):
                try:
                    end = await self._prefill_remotely(remote, block_ids)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("remote prefill failed; prefilling locally", request_id=rid)
                    self._count("local_fallback_error")
                    end = self._locally(remote)
        except asyncio.CancelledError:
            pass  # the request ended: the load ends failed, which frees its blocks
        finally:
            self.results.pop(rid, None)
            self.receiver.cancel(rid)  # no late part is written into the blocks after this
            self._ended.report(end)

    async def _prefill_remotely(self, remote: _Remote, block_ids: list[int]) -> LoadEnd:
        worker = self.worker
        engine = worker.engine
        request, params = remote.request, remote.params
        rid = request.request_id
        prompt = request.prompt_token_ids
        deadline = time.monotonic() + self.timeout_s
        ticket = self.receiver.expect(
            rid,
            on_part=lambda start, end, data: engine.write_layers(block_ids, len(prompt), start, end, data),
            total_layers=(0, engine.model_config.num_hidden_layers),
            deadline_s=self.timeout_s,
        )
        result_future = asyncio.get_running_loop().create_future()
        self.results[rid] = (result_future, ticket.token)
        job = PrefillJob(
            request_id=rid, model=request.model, prompt_token_ids=prompt, sampling=params,
            ticket=ticket, reply_subject=worker.subjects.prefill_results(worker.instance_id),
            block_size=engine.config.block_size, model_fingerprint=engine.fingerprint,
            deadline_ms=int((time.time() + self.timeout_s) * 1000), created_ms=int(time.time() * 1000),
            role_epoch=request.prefill_epoch,
        )
        target = await self._hand_out(request, job)

        result: PrefillResult | None = None
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                result = await _result_unless_gone(worker.registry, result_future, target)
        except TimeoutError:
            log.warning("no prefill result in time", request_id=rid)
        if result is None or not result.ok:
            self._count("local_fallback_no_result")
            return self._locally(remote)
        if result.model_fingerprint != engine.fingerprint:  # its first token and KV are another model's: not used
            self._count("local_fallback_other_model")
            log.warning("prefill result from another model; prefilling locally", request_id=rid,
                        prefill_worker=result.prefill_instance)
            return self._locally(remote)
        trace.get_current_span().set_attributes({"splitserve.prefill_worker": result.prefill_instance,
                                                 "splitserve.cached_tokens": result.num_cached_tokens})

        # The first token: judged by the engine (its text, its stop) and streamed now, before the KV arrives.
        origin = KVOrigin.WRITTEN_BACK if result.kv_written_back else KVOrigin.COMPUTED
        first = remote.first = engine.remote_first_token(prompt, params, result.first_token_id,
                                                         num_cached_tokens=result.num_cached_tokens, kv_origin=origin)
        active = remote.active
        await self.publish_chunk(active, TokenChunk(
            request_id=rid, seq=active.next_seq, token_ids=[result.first_token_id], text=first.text,
            logprobs=[result.first_logprobs] if result.first_logprobs else None,
            finished=first.finish_reason is not None, finish_reason=first.finish_reason, prompt_tokens=len(prompt),
            completion_tokens=1, cached_tokens=result.num_cached_tokens,
        ))
        if first.finish_reason is not None:
            self._count("remote_finished_at_first_token")
            self.forget(rid)
            return LoadEnd(rid, False, request_over=True)
        if not result.will_transfer:
            # The prefill worker judged the request over at its first token, this worker does not: go on locally.
            self._count("local_fallback_no_transfer")
            return self._locally(remote)

        transfer = await self.receiver.wait(rid)
        if not transfer.ok:
            self._count("local_fallback_transfer")
            log.warning("kv transfer failed; prefilling locally", request_id=rid, error=transfer.error)
            return self._locally(remote)
        self.transfer_seconds.observe(transfer.seconds)
        trace.get_current_span().set_attributes(transfer.span_attributes())
        self._count("remote")
        return LoadEnd(rid, True, first.continuation)

    async def _hand_out(self, request: GenerateRequest, job: PrefillJob) -> str:
        """Offer the job to the prefill worker the scheduler picked (its cache holds the prompt's prefix); if there
        is none, or it declines or is not there, queue it for the pool. Returns the worker that took it ("" the
        pool)."""
        nc, subjects = self.worker.nc, self.worker.subjects
        target = request.prefill_instance
        if target:
            try:
                response = await nc.request(subjects.prefill_offer(target), job.encode(), timeout=_OFFER_TIMEOUT_S,
                                            headers=inject())
                if HandoffReply.decode(response.data).accepted:
                    self._count("offered")
                    return target
            except nats.errors.TimeoutError:
                return target  # it may have taken the job: queueing it too could run it twice; the deadline covers it
            except Exception as exc:  # no responders, a bad reply: the pool takes it
                log.info("prefill offer not taken", request_id=request.request_id, target=target, error=repr(exc))
        job = msgspec.structs.replace(job, role_epoch=None)  # queued: whichever prefill worker pulls it
        await nc.jetstream().publish(subjects.prefill_jobs, job.encode(), timeout=5.0,
                                     headers=inject({"Nats-Msg-Id": request.request_id}))
        return ""

    @staticmethod
    def _locally(remote: _Remote) -> LoadEnd:
        """The load failed: the engine computes the prompt (and goes on after a first token already streamed)."""
        continuation = None if remote.first is None else remote.first.continuation
        return LoadEnd(remote.request.request_id, False, continuation)


def _cancel(remote: _Remote) -> None:
    if remote.task is not None:
        remote.task.cancel()


async def _result_unless_gone(registry: Registry, result: asyncio.Future, target: str) -> PrefillResult | None:
    """The prefill result; None as soon as the prefill worker that took the job directly leaves the registry
    (nothing would redeliver its job)."""
    if not target:
        return await result
    boot_id = None
    while True:
        try:
            async with asyncio.timeout(_WATCH_S):
                return await asyncio.shield(result)
        except TimeoutError:
            pass
        try:
            entry = await registry.get("prefill", target)
        except Exception:  # the registry is unreachable: keep waiting (the deadline still holds)
            continue
        if entry is None or (boot_id is not None and entry.boot_id != boot_id):
            log.warning("the prefill worker that took the job is gone", target=target)
            return None
        boot_id = entry.boot_id

