"""The prefill worker: pull a job, compute the prompt's KV and first token, ship both.

A job is pulled only when the worker has room for it (a busy worker simply
does not pull), kept alive with in-progress acks while it runs, and acked only
once its KV is delivered, so a worker killed mid-job leaves the job to be
redelivered to another one. The KV streams out layer by layer while the
prompt's last step is still computing the next layers, and the first token
goes to the decode worker as soon as it is sampled, so neither waits for the
other.

The KV is shipped from the engine's cache in place (the request holds its
blocks until the transfer ends). With the cache in a shared-memory region
(`services.common.kv_memory`), a decode worker on this host copies the blocks
straight into its own cache: one copy in all.
"""

import asyncio

import nats.errors
import structlog
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from contracts import (
    CancelRequest,
    HandoffReply,
    PrefillJob,
    PrefillResult,
    ServiceInfo,
    StatsRequest,
    Subjects,
)
from services.common.cpu_loan import CpuLender, CpuShare, loan_details
from services.common.engine_loop import AddRequest, EngineLoop, RequestRejected
from services.common.engine_thread import EngineThread
from services.common.identity import ServiceIdentity, now_ms
from services.common.kv_events import engine_kv_events, kv_hashing_details
from shared.bus.registry import Heartbeat, Registry
from shared.bus.subscribe import REJECTED, fetch_loop, subscribe_typed
from shared.engine.engine import LLMEngine, RequestOutput
from shared.engine.errors import EngineError
from shared.engine.sampling_params import SamplingParams
from shared.telemetry.logging import get_logger
from shared.telemetry.tracing import extract, inject, tracer
from shared.transfer import KVSender, TransferTicket
from shared.transfer.tls import TransferTLS
from shared.transfer.shm import region_of

log = get_logger(__name__)

_KEEPALIVE_S = 1.0  # in-progress acks while a job runs (the consumer's ack wait is a few seconds)


class PrefillWorker:
    def __init__(self, *, nc, registry: Registry, engine: LLMEngine, engine_thread: EngineThread, subjects: Subjects,
                 instance_id: str, model: str, served_model_name: str, max_concurrent_jobs: int, kv_transport: str,
                 cpu_share: CpuShare | None = None, transfer_tls: TransferTLS | None = None):
        self.nc = nc
        self.js = nc.jetstream()
        self.registry = registry
        self.engine = engine
        self.subjects = subjects
        self.instance_id = instance_id
        self.model = model
        self.served_model_name = served_model_name
        self.max_concurrent_jobs = max_concurrent_jobs
        self.kv_transport = kv_transport
        self.identity = ServiceIdentity(instance_id, "prefill")
        self.state = "starting"
        self.sender = KVSender(tls=transfer_tls)
        self.jobs: dict[str, asyncio.Task] = {}
        self._cancelled: dict[str, bool] = {}
        self._first_tokens: dict[str, asyncio.Future] = {}
        self._loop = asyncio.get_running_loop()
        self.engine_loop = EngineLoop(engine, self._from_engine_thread, engine_thread, cpu_share)
        if isinstance(cpu_share, CpuLender):
            cpu_share.quiet = self._quiet
        self._heartbeat = Heartbeat(registry, self.info)
        self.counts: dict[str, int] = {}
        self.kv_cache = None  # services.common.kvstore_cache.KVStoreCache, with --kv-store
        self._consumer = None  # the prefill queue's pull subscription, once started
        self.job_traces: dict[str, dict[str, str]] = {}  # request id -> its job span's trace context
        self.kv_events = engine_kv_events(nc=nc, subjects=subjects, identity=self.identity, engine=engine,
                                          engine_loop=self.engine_loop)

    async def start(self) -> list[asyncio.Task]:
        self.engine_loop.start()
        cache_in_region = region_of(self.engine.executor.runners[0].kv_cache.tensor) is not None
        if self.kv_transport in ("auto", "shm") and not cache_in_region:
            self.sender.prewarm_shm()  # the first staged transfers would otherwise pay for fresh shared-memory pages
        await subscribe_typed(self.nc, self.subjects.cancel, CancelRequest, self._on_cancel)
        await subscribe_typed(self.nc, self.subjects.stats(self.instance_id), StatsRequest, self._on_stats)
        await subscribe_typed(self.nc, self.subjects.prefill_offer(self.instance_id), PrefillJob, self._on_offer)
        self._consumer = await self.js.pull_subscribe(
            self.subjects.prefill_jobs, durable=self.subjects.prefill_consumer, stream=self.subjects.prefill_stream
        )
        event_tasks = await self.kv_events.start()
        await self.nc.flush()
        self.state = "ready"
        self._heartbeat.start()
        return [asyncio.create_task(self._pull_jobs(), name="pull-jobs"),
                asyncio.create_task(self._watch_engine(), name="watch-engine"), *event_tasks]

    async def stop(self) -> None:
        self.state = "draining"
        if self._consumer is not None:
            # A fetch cancelled mid-wait leaves the server's timeout status in the subscription's queue, where
            # nothing reads it; the connection's drain would then wait for it until its deadline.
            try:
                await self._consumer.unsubscribe()
            except nats.errors.Error as exc:
                log.warning("could not unsubscribe from the prefill queue", error=repr(exc))
        for task in list(self.jobs.values()):
            task.cancel()  # their jobs are redelivered to another worker
        await asyncio.gather(*self.jobs.values(), return_exceptions=True)
        await asyncio.to_thread(self.engine_loop.stop, 1.0)  # a step in flight may not finish: the thread is a daemon
        self.sender.close()
        if self.kv_cache is not None:
            await self.kv_cache.stop()
        await self._heartbeat.stop(remove=True)

    def info(self) -> ServiceInfo:
        block_manager = self.engine.block_manager
        return self.identity.info(
            model=self.model, served_model_name=self.served_model_name, state=self.state, num_running=len(self.jobs),
            max_num_seqs=self.max_concurrent_jobs, kv_blocks_total=block_manager.num_blocks,
            kv_blocks_free=block_manager.num_free_blocks, max_model_len=self.engine.max_model_len,
            details={"jobs": dict(self.counts), "rejected_messages": dict(REJECTED),
                     "kv_transfer": self.sender.stats.snapshot(), "uses_kv_store": self.kv_cache is not None,
                     "prefix_cache": self.engine.prefix_cache_counts(),
                     "kv_events": dict(self.kv_events.counts), **kv_hashing_details(self.engine),
                     "cpu_loan": loan_details(self.engine_loop.cpu_share),
                     "kv_store": self.kv_cache.details() if self.kv_cache is not None else {}},
        )

    # ---- the job loop -------------------------------------------------------------------
    async def _pull_jobs(self) -> None:
        await fetch_loop(self._consumer, PrefillJob, self._on_job, batch=1,
                         room=lambda: self.max_concurrent_jobs - len(self.jobs))

    async def _on_job(self, job: PrefillJob, msg) -> None:
        if job.request_id not in self.jobs:  # else a redelivery of a job this worker is still running
            self._start_job(job, msg, msg.headers)

    def _start_job(self, job: PrefillJob, msg, headers: dict | None) -> None:
        task = asyncio.create_task(self._run(job, msg, headers), name=f"prefill-{job.request_id}")
        self.jobs[job.request_id] = task
        task.add_done_callback(lambda _, rid=job.request_id: self.jobs.pop(rid, None))

    async def _on_offer(self, job: PrefillJob, msg) -> None:
        """A job offered to this worker directly (its cache holds the prompt's prefix): take it if there is room.
        Not redelivered if this worker dies: the decode worker watches for that and prefills locally."""
        if self.state != "ready" or len(self.jobs) >= self.max_concurrent_jobs:
            reply = HandoffReply(request_id=job.request_id, accepted=False, code="overloaded",
                                 message=f"prefill worker {self.instance_id} is {self.state} with {len(self.jobs)} jobs")
        else:
            if job.request_id not in self.jobs:
                self._start_job(job, None, msg.headers)
            reply = HandoffReply(request_id=job.request_id, accepted=True)
        if msg.reply:
            await msg.respond(reply.encode())

    async def _watch_engine(self) -> None:
        while self.engine_loop.crashed is None:
            await asyncio.sleep(0.5)
        raise RuntimeError("the engine loop crashed") from self.engine_loop.crashed

    async def _run(self, job: PrefillJob, msg, headers: dict | None) -> None:
        """One job (`msg` its JetStream message; None when it was offered directly), in its own span."""
        with tracer().start_as_current_span(
            "prefill.job", context=extract(headers), kind=SpanKind.CONSUMER,
            attributes={"splitserve.request_id": job.request_id, "splitserve.worker": self.instance_id,
                        "splitserve.prompt_tokens": len(job.prompt_token_ids), "splitserve.offered": msg is None,
                        "splitserve.queue_wait_s": max(0.0, (now_ms() - job.created_ms) / 1000)},
        ) as span, structlog.contextvars.bound_contextvars(request_id=job.request_id):
            self.job_traces[job.request_id] = inject({}, span)
            try:
                outcome = await self._run_job(job, msg)
            finally:
                self.job_traces.pop(job.request_id, None)
            span.set_attribute("splitserve.outcome", outcome)
            if outcome not in ("shipped", "finished_at_first_token", "cancelled"):
                span.set_status(Status(StatusCode.ERROR, outcome))

    async def _run_job(self, job: PrefillJob, msg) -> str:
        keepalive = asyncio.create_task(self._keep_alive(msg))
        outcome = "failed"
        try:
            outcome = await self._prefill_and_ship(job)
        except asyncio.CancelledError:
            # Cancelled by the client: the job is over. Stopped with the worker: someone else takes it.
            outcome = "cancelled" if self._cancelled.get(job.request_id) else "interrupted"
            raise
        except Exception:
            log.exception("prefill job failed", request_id=job.request_id)
            await self._report(job, ok=False, error="the prefill worker failed")
        finally:
            keepalive.cancel()
            self._cancelled.pop(job.request_id, None)
            self._count(outcome)
            self.engine_loop.abort(job.request_id)  # frees the blocks it held for the transfer
            await self._settle(msg, outcome)
        return outcome

    @staticmethod
    async def _settle(msg, outcome: str) -> None:
        """Ack only delivered work; hand an interrupted job to another worker; end every other one."""
        if msg is None:
            return  # an offered job: nothing to settle
        try:
            if outcome in ("shipped", "finished_at_first_token"):
                await msg.ack()
            elif outcome == "interrupted":
                await msg.nak()
            else:
                await msg.term()
        except Exception as exc:  # the connection is going: the ack wait will sort it out
            log.warning("could not settle the job", outcome=outcome, error=repr(exc))

    async def _prefill_and_ship(self, job: PrefillJob) -> str:
        if job.deadline_ms < now_ms():
            return "expired"  # its decode worker has already prefilled locally
        if job.block_size != self.engine.config.block_size:
            await self._report(job, ok=False, error=f"block size {job.block_size} != {self.engine.config.block_size}")
            return "refused"
        if job.model_fingerprint != self.engine.fingerprint:  # another model's KV would be wrong, silently
            self.counts["refused_other_model"] = self.counts.get("refused_other_model", 0) + 1
            await self._report(job, ok=False, error="the job is for another model (or dtype) than this worker's")
            return "refused"
        try:
            params = SamplingParams(**job.sampling)
            first_only = SamplingParams(**{**job.sampling, "max_tokens": 1})
        except (EngineError, TypeError) as exc:
            await self._report(job, ok=False, error=f"bad sampling parameters: {exc}")
            return "refused"
        # The KV streams out layer by layer while the prompt's last step computes the next layers.
        layers: asyncio.Queue = asyncio.Queue()
        first_layer, end_layer = self.shipped_layers
        num_layers = end_layer - first_layer

        def on_prompt_kv(data, layout) -> None:  # on the engine thread, between two layers; data: a BlockSlice
            self._loop.call_soon_threadsafe(layers.put_nowait, (layout.layer_start, layout.layer_end, data))

        async def parts():
            for _ in range(num_layers):
                yield await layers.get()

        claim = None if self.shipped_layers == (0, self.engine.model_config.num_hidden_layers) else self.shipped_layers
        sending = asyncio.create_task(
            self.sender.send(TransferTicket.from_dict(job.ticket), parts(), backend=self.kv_transport, layers=claim))
        self._job_started(job)
        future = self._loop.create_future()
        self._first_tokens[job.request_id] = future
        try:
            options = {"seed": params.seed, "on_prompt_kv": on_prompt_kv, "hold_kv": True}
            if self.kv_cache is not None:  # start from the prefix the kv-store holds, if longer than our own
                options |= await self.kv_cache.load_prefix(job.prompt_token_ids)
            self.engine_loop.add(AddRequest(job.request_id, job.prompt_token_ids, first_only, options))
            remaining_s = max(0.0, (job.deadline_ms - now_ms()) / 1000)
            try:
                output = await asyncio.wait_for(future, remaining_s)
            except TimeoutError:
                return "expired"
            if isinstance(output, RequestRejected):
                await self._report(job, ok=False, error=str(output.error))
                return "refused"
            if output.error is not None:  # the engine could not compute it (a pipeline stage failed)
                await self._report(job, ok=False, error=output.error)
                return "failed"
            prompt_len = len(job.prompt_token_ids)
            # The request goes on only if it stopped because of the one-token limit, not at its real end.
            goes_on = (output.finish_reason == "length" and (params.max_tokens is None or params.max_tokens > 1)
                       and prompt_len + 1 < self.engine.max_model_len)
            await self._report(job, ok=True, output=output, will_transfer=goes_on)
            if not goes_on:
                return "finished_at_first_token"
            result = await sending
            trace.get_current_span().set_attributes(
                {**result.span_attributes(), "splitserve.cached_tokens": output.num_cached_tokens})
            # Even when this process's own part failed: the other stages may still read the blocks in place.
            others_error = await self._others_shipped(job)
        finally:
            self._first_tokens.pop(job.request_id, None)
            self._job_ended(job)
            if not sending.done():
                sending.cancel()
                # Its lease is given back as it unwinds: only then may the blocks be freed.
                await asyncio.gather(sending, return_exceptions=True)
        if not result.ok:
            log.warning("kv transfer failed", request_id=job.request_id, error=result.error, backend=result.backend)
            return "transfer_failed"
        if others_error is not None:
            log.warning("kv transfer failed at a pipeline stage", request_id=job.request_id, error=others_error)
            return "transfer_failed"
        log.info("kv shipped", request_id=job.request_id, backend=result.backend, bytes=result.num_bytes,
                 seconds=round(result.seconds, 4))
        return "shipped"

    # ---- hooks for a pipelined prefill pool (services/stage/prefill_head.py) -----------------------
    @property
    def shipped_layers(self) -> tuple[int, int]:
        """The layers whose KV this process ships; a pipeline's stages ship the rest."""
        return 0, self.engine.model_config.num_hidden_layers

    def _job_started(self, job: PrefillJob) -> None:
        pass

    async def _others_shipped(self, job: PrefillJob) -> str | None:
        """Once this process shipped its layers: None when every other part of the KV arrived too, else why not."""
        return None

    def _job_ended(self, job: PrefillJob) -> None:
        pass

    async def _keep_alive(self, msg) -> None:
        while msg is not None:
            await asyncio.sleep(_KEEPALIVE_S)
            try:
                await msg.in_progress()
            except Exception as exc:  # the job will be redelivered; nothing else to do
                log.warning("in-progress ack failed", error=repr(exc))

    async def _report(self, job: PrefillJob, ok: bool, output: RequestOutput | None = None,
                      will_transfer: bool = False, error: str = "") -> None:
        result = PrefillResult(request_id=job.request_id, ok=ok, prefill_instance=self.instance_id, error=error,
                               will_transfer=will_transfer, kv_written_back=self.kv_cache is not None,
                               model_fingerprint=self.engine.fingerprint)
        if output is not None:
            result.first_token_id = output.new_token_ids[0]
            result.num_prompt_tokens = output.num_prompt_tokens
            result.num_cached_tokens = output.num_cached_tokens
            if output.new_logprobs:
                lp = output.new_logprobs[0]
                result.first_logprobs = {"token_id": lp.token_id, "logprob": lp.logprob, "top": [list(t) for t in lp.top]}
        await self.nc.publish(job.reply_subject, result.encode())

    async def _on_stats(self, _: StatsRequest, msg) -> None:
        if msg.reply:
            await msg.respond(self.info().encode())

    async def _on_cancel(self, cancel: CancelRequest, msg) -> None:
        task = self.jobs.get(cancel.request_id)
        if task is not None:
            self._cancelled[cancel.request_id] = True
            task.cancel()

    def _quiet(self) -> bool:
        """Nothing of this worker runs on its CPUs but the engine (read from the engine thread: it lends them)."""
        return self.sender.sends_in_flight == 0 and (self.kv_cache is None or self.kv_cache.puts_in_flight == 0)

    def _from_engine_thread(self, items: list) -> None:
        self._loop.call_soon_threadsafe(self._deliver, items)

    def _deliver(self, items: list) -> None:
        for item in items:
            future = self._first_tokens.get(item.request_id)
            if future is not None and not future.done():
                future.set_result(item)

    def _count(self, outcome: str) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
