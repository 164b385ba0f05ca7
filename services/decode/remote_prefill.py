"""A decode worker's side of a remotely prefilled request.

    reserve blocks -> expect the KV on the side channel -> queue a PrefillJob
    -> first token arrives: stream it at once -> KV arrives: adopt the blocks
    and decode on

Any step that fails or misses its deadline ends in a local prefill (counted),
never a hang: with the first token if it was already streamed (sampling is
stateless per position, so the tokens are the same either way), without it
otherwise. Cancelling the task releases everything it holds.
"""

import asyncio
import dataclasses
import random
import time

from collections.abc import Awaitable, Callable

import nats.errors
from opentelemetry import trace

from contracts import GenerateRequest, HandoffReply, PrefillJob, PrefillResult, TokenChunk
from services.common.engine_loop import AddRequest
from services.common.sampling_wire import to_wire
from shared.bus.registry import Registry
from shared.engine.continuation import Continuation, KVOrigin, ReservedKV
from shared.engine.kv_cache import KVLayout
from shared.engine.sampling_params import SamplingParams
from shared.telemetry.histogram import CumulativeHistogram
from shared.telemetry.logging import get_logger
from shared.telemetry.tracing import inject, tracer

log = get_logger(__name__)

_OFFER_TIMEOUT_S = 1.0  # a prefill worker answers an offer at once
_WATCH_S = 1.0  # how often the registry is checked for a prefill worker that took a job directly
TRANSFER_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class _Held:
    """What a remote prefill holds, released whatever the ending."""

    def __init__(self):
        self.block_ids: list[int] | None = None
        self.first_token: int | None = None
        self.detok = None
        self.adopted = False


class RemotePrefill:
    """A decode worker's remote prefills: `run` one per request; `on_result` takes the prefill pool's replies."""

    def __init__(self, worker, receiver, timeout_s: float, *,
                 publish_chunk: Callable[[object, TokenChunk], Awaitable[None]], forget: Callable[[str], None]):
        """`worker`: the EngineWorker; `receiver`: its KV side channel; `publish_chunk(active, chunk)` streams a
        token of a request; `forget(request_id)` ends a request that finished at its first token."""
        self.worker = worker
        self.receiver = receiver
        self.timeout_s = timeout_s
        self.publish_chunk = publish_chunk
        self.forget = forget
        self.results: dict[str, asyncio.Future] = {}
        self.counts: dict[str, int] = {}  # how the prompts were computed, by outcome
        self.transfer_seconds = CumulativeHistogram(TRANSFER_BUCKETS_S)

    def transfer_details(self) -> dict:
        return {**self.receiver.stats.snapshot(), "seconds_histogram": self.transfer_seconds.snapshot()}

    async def on_result(self, result: PrefillResult, msg) -> None:
        future = self.results.get(result.request_id)
        if future is not None and not future.done():
            future.set_result(result)  # later duplicates (a redelivered job) are ignored

    def _count(self, outcome: str) -> None:
        """How a request's prompt was computed; also on the current span (the remote prefill's)."""
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        trace.get_current_span().set_attribute("splitserve.prefill_outcome", outcome)

    async def run(self, request: GenerateRequest, params: SamplingParams, active) -> None:
        rid = request.request_id
        if params.seed is None:  # fix the seed here, so prefill, decode and any fallback sample alike
            params = dataclasses.replace(params, seed=random.getrandbits(63))
        held = _Held()
        try:
            with tracer().start_as_current_span("decode.remote_prefill"):
                await self._run(request, params, active, held)
        except Exception:
            log.exception("remote prefill failed; prefilling locally", request_id=rid)
            self._count("local_fallback_error")
            self._prefill_locally(request, params, held)
        finally:
            self.results.pop(rid, None)
            if not held.adopted:
                self.receiver.cancel(rid)
                if held.block_ids is not None:
                    block_ids = held.block_ids
                    self.worker.engine_loop.call(lambda e: e.release_blocks(block_ids))

    async def _run(self, request: GenerateRequest, params: SamplingParams, active, held: _Held) -> None:
        worker = self.worker
        engine = worker.engine
        rid = request.request_id
        prompt = request.prompt_token_ids
        deadline = time.monotonic() + self.timeout_s
        reserving = worker.engine_loop.call(lambda e: e.reserve_blocks(len(prompt)))
        try:
            # Shielded: if this task is cancelled meanwhile, the blocks still get reserved, and must be given back.
            held.block_ids = await asyncio.shield(reserving)
        except asyncio.CancelledError:
            reserving.add_done_callback(self._release_result)
            raise
        except Exception as exc:
            self._count("local_no_blocks")
            log.info("no blocks for a remote prefill; prefilling locally", request_id=rid, error=str(exc))
            return self._prefill_locally(request, params, held)

        block_ids = held.block_ids
        layout_of = _layout_factory(engine, len(block_ids), len(prompt))
        ticket = self.receiver.expect(
            rid,
            on_part=lambda start, end, data: engine.write_kv(block_ids, data, layout_of(start, end)),
            total_layers=(0, engine.model_config.num_hidden_layers),
            deadline_s=self.timeout_s,
        )
        result_future = asyncio.get_running_loop().create_future()
        self.results[rid] = result_future
        job = PrefillJob(
            request_id=rid, model=request.model, prompt_token_ids=prompt, sampling=to_wire(params),
            ticket=ticket, reply_subject=worker.subjects.prefill_results(worker.instance_id),
            block_size=engine.config.block_size, model_fingerprint=engine.fingerprint,
            deadline_ms=int((time.time() + self.timeout_s) * 1000), created_ms=int(time.time() * 1000),
        )
        target = await self._hand_out(request, job)

        result: PrefillResult | None = None
        try:
            result = await asyncio.wait_for(_result_unless_gone(worker.registry, result_future, target),
                                            max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            log.warning("no prefill result in time", request_id=rid)
        if result is None or not result.ok:
            self._count("local_fallback_no_result")
            return self._prefill_locally(request, params, held)
        if result.model_fingerprint != engine.fingerprint:  # its first token and KV are another model's: not used
            self._count("local_fallback_other_model")
            log.warning("prefill result from another model; prefilling locally", request_id=rid,
                        prefill_worker=result.prefill_instance)
            return self._prefill_locally(request, params, held)
        trace.get_current_span().set_attributes({"splitserve.prefill_worker": result.prefill_instance,
                                                 "splitserve.cached_tokens": result.num_cached_tokens})

        # The first token: streamed now, before the KV arrives.
        held.first_token = result.first_token_id
        held.detok = engine.new_detokenizer(prompt, params)
        text, finish_reason, _ = engine.judge_token(params, held.first_token, held.detok, len(prompt) + 1,
                                                    engine.max_total_tokens(len(prompt), params))
        await self.publish_chunk(active, TokenChunk(
            request_id=rid, seq=active.next_seq, token_ids=[held.first_token], text=text,
            logprobs=[result.first_logprobs] if result.first_logprobs else None,
            finished=finish_reason is not None, finish_reason=finish_reason, prompt_tokens=len(prompt),
            completion_tokens=1, cached_tokens=result.num_cached_tokens,
        ))
        if finish_reason is not None:
            self._count("remote_finished_at_first_token")
            self.forget(rid)
            return  # the finally cancels the expected transfer and releases the blocks
        if not result.will_transfer:
            # The prefill worker judged the request over at its first token, this worker does not: go on locally.
            self._count("local_fallback_no_transfer")
            return self._prefill_locally(request, params, held)

        transfer = await self.receiver.wait(rid)
        if not transfer.ok:
            self._count("local_fallback_transfer")
            log.warning("kv transfer failed; prefilling locally", request_id=rid, error=transfer.error)
            return self._prefill_locally(request, params, held)
        self.transfer_seconds.observe(transfer.seconds)
        trace.get_current_span().set_attributes(transfer.span_attributes())
        worker.engine_loop.add(AddRequest(rid, prompt, params, Continuation(
            output_token_ids=[held.first_token], reserved=ReservedKV(block_ids, len(prompt)), detokenizer=held.detok,
            num_cached_tokens=result.num_cached_tokens,
            kv_origin=KVOrigin.WRITTEN_BACK if result.kv_written_back else KVOrigin.COMPUTED)))
        held.adopted = True
        self._count("remote")

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
        await nc.jetstream().publish(subjects.prefill_jobs, job.encode(), timeout=5.0,
                                     headers=inject({"Nats-Msg-Id": request.request_id}))
        return ""

    def _release_result(self, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            block_ids = future.result()
            self.worker.engine_loop.call(lambda e: e.release_blocks(block_ids))

    def _prefill_locally(self, request: GenerateRequest, params: SamplingParams, held: _Held) -> None:
        """Give back what the remote attempt held, then run the request here (continuing after a streamed first
        token)."""
        self.receiver.cancel(request.request_id)
        if held.block_ids is not None:
            block_ids, held.block_ids = held.block_ids, None
            self.worker.engine_loop.call(lambda e: e.release_blocks(block_ids))
        held.adopted = True  # the request now lives in the engine
        continuation = (Continuation(output_token_ids=[held.first_token], detokenizer=held.detok)
                        if held.first_token is not None else None)
        self.worker.engine_loop.add(AddRequest(request.request_id, request.prompt_token_ids, params, continuation))


async def _result_unless_gone(registry: Registry, result: asyncio.Future, target: str) -> PrefillResult | None:
    """The prefill result; None as soon as the prefill worker that took the job directly leaves the registry
    (nothing would redeliver its job)."""
    if not target:
        return await result
    boot_id = None
    while True:
        try:
            return await asyncio.wait_for(asyncio.shield(result), _WATCH_S)
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


def _layout_factory(engine, num_blocks: int, num_tokens: int):
    def layout(layer_start: int, layer_end: int) -> KVLayout:
        return engine.executor.kv_layout(layer_start, layer_end, num_blocks, num_tokens)

    return layout
