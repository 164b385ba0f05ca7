"""The prefill role of an `EngineWorker`: pull a job, compute the prompt's KV and first token, ship both.

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
from typing import Protocol

import msgspec
import nats.errors
import structlog
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from contracts import CancelRequest, HandoffReply, LogprobEntry, PrefillJob, PrefillResult, sent_by
from services.common.cpu_loan import CpuLender
from services.common.engine_loop import AddRequest, RequestRejected
from services.common.engine_worker import EngineWorker
from services.common.identity import now_ms
from services.common.role_epoch import STALE_ROLE, epoch_refusal
from services.prefill.prompt_kv_stream import PromptKVStream
from shared.bus.subscribe import fetch_loop
from shared.engine import EngineError, RequestOutput
from shared.telemetry.logging import get_logger
from shared.telemetry.tracing import extract, inject, tracer
from shared.transfer import KVSender
from shared.transfer.tls import TransferTLS
from shared.transfer.shm import region_of

log = get_logger(__name__)

_KEEPALIVE_S = 1.0  # in-progress acks while a job runs (the consumer's ack wait is a few seconds)


class StageShipments(Protocol):
    """A pipelined prefill pool's other stages, which ship their own layers' KV of each job."""

    def begin(self, job: PrefillJob) -> None:
        """A job starts: expect every stage's report for it (earlier attempts' reports no longer count)."""

    async def shipped(self, job: PrefillJob) -> str | None:
        """Once this process shipped its layers: None when every stage's part arrived too, else why not."""

    def end(self, job: PrefillJob) -> None:
        """The job is over, whatever the ending: forget it."""


class PrefillRole:
    def __init__(self, worker: EngineWorker, *, max_concurrent_jobs: int, kv_transport: str,
                 transfer_tls: TransferTLS | None = None, stages: StageShipments | None = None):
        self.worker = worker
        self.max_concurrent_jobs = max_concurrent_jobs
        self.kv_transport = kv_transport
        self.stages = stages
        self.sender = KVSender(tls=transfer_tls)
        self.jobs: dict[str, asyncio.Task] = {}
        self._cancelled: dict[str, bool] = {}
        self._first_tokens: dict[str, asyncio.Future] = {}
        self._loop = asyncio.get_running_loop()
        self.prompt_kv = PromptKVStream(self._loop)
        worker.engine.connect(self.prompt_kv)
        if isinstance(worker.engine_loop.cpu_share, CpuLender):
            worker.engine_loop.cpu_share.quiet = self._quiet
        self.counts: dict[str, int] = {}
        self._consumer = None  # the prefill queue's pull subscription, once started
        self._offers = None  # the direct offers' subscription, once started
        self.job_traces: dict[str, dict[str, str]] = {}  # request id -> its job span's trace context

    async def start(self) -> list[asyncio.Task]:
        w = self.worker
        cache_in_region = all(region_of(tensor) is not None for tensor in w.engine.executor.kv_tensors())
        if self.kv_transport in ("auto", "shm") and not cache_in_region:
            self.sender.prewarm_shm()  # the first staged transfers would otherwise pay for fresh shared-memory pages
        self._offers = await w.subscribe(w.subjects.prefill_offer(w.instance_id), PrefillJob, self._on_offer)
        self._consumer = await w.nc.jetstream().pull_subscribe(
            w.subjects.prefill_jobs, durable=w.subjects.prefill_consumer, stream=w.subjects.prefill_stream
        )
        return [asyncio.create_task(self._pull_jobs(), name="pull-jobs")]

    async def lapsed(self) -> None:
        """Nothing to drop: a job's decode worker waits for it until the job's deadline (and prefills locally
        after), and a job past its deadline is not started; going on with one is what serves it soonest."""

    async def drain(self, wait_s: float | None = None) -> None:
        """Pull no more jobs; let those running finish for `wait_s` (None: none), then stop the rest (a queued
        job is redelivered to another worker; an offered one's decode worker prefills it locally)."""
        if self._offers is not None:
            await self._offers.unsubscribe()
            self._offers = None
        if self._consumer is not None:
            # A fetch cancelled mid-wait leaves the server's timeout status in the subscription's queue, where
            # nothing reads it; the connection's drain would then wait for it until its deadline.
            try:
                await self._consumer.unsubscribe()
            except (nats.errors.Error, ValueError) as exc:
                log.warning("could not unsubscribe from the prefill queue", error=repr(exc))
        if self.jobs and wait_s:
            await asyncio.wait(list(self.jobs.values()), timeout=wait_s)
        for task in list(self.jobs.values()):
            task.cancel()  # their jobs are redelivered to another worker
        await asyncio.gather(*self.jobs.values(), return_exceptions=True)

    async def close(self) -> None:
        self.sender.close()
        self.worker.engine.disconnect(self.prompt_kv)

    def load(self) -> dict:
        return {"num_running": len(self.jobs), "max_num_seqs": self.max_concurrent_jobs}

    def details(self) -> dict:
        return {"jobs": dict(self.counts), "kv_transfer": self.sender.stats.snapshot()}

    # ---- the job loop -------------------------------------------------------------------
    async def _pull_jobs(self) -> None:
        await fetch_loop(self._consumer, PrefillJob, self._on_job, batch=1,
                         room=lambda: self.max_concurrent_jobs - len(self.jobs))

    async def _on_job(self, job: PrefillJob, msg) -> None:
        if msg.metadata.num_delivered > 1:  # another worker (or this one, earlier) pulled it and never settled it
            self._count("redelivered")
        if job.request_id not in self.jobs:  # else a redelivery of a job this worker is still running
            self._start_job(job, msg, msg.headers)

    def _start_job(self, job: PrefillJob, msg, headers: dict | None) -> None:
        task = asyncio.create_task(self._run(job, msg, headers), name=f"prefill-{job.request_id}")
        self.jobs[job.request_id] = task
        task.add_done_callback(lambda _, rid=job.request_id: self.jobs.pop(rid, None))

    async def _on_offer(self, job: PrefillJob, msg) -> None:
        """A job offered to this worker directly (its cache holds the prompt's prefix): take it if there is room.
        Not redelivered if this worker dies: the decode worker watches for that and prefills locally."""
        w = self.worker
        stale = epoch_refusal("prefill", job.role_epoch, w.identity.role, w.role_epoch)
        if stale is not None:  # offered under an epoch this worker has left: the decode worker queues it
            reply = HandoffReply(request_id=job.request_id, accepted=False, code=STALE_ROLE, message=stale)
        elif w.state != "ready" or len(self.jobs) >= self.max_concurrent_jobs:
            reply = HandoffReply(request_id=job.request_id, accepted=False, code="overloaded",
                                 message=f"prefill worker {w.instance_id} is {w.state} with {len(self.jobs)} jobs")
        else:
            if job.request_id not in self.jobs:
                self._start_job(job, None, msg.headers)
            reply = HandoffReply(request_id=job.request_id, accepted=True)
        if msg.reply:
            await msg.respond(reply.encode())

    async def _run(self, job: PrefillJob, msg, headers: dict | None) -> None:
        """One job (`msg` its JetStream message; None when it was offered directly), in its own span."""
        with tracer().start_as_current_span(
            "prefill.job", context=extract(headers), kind=SpanKind.CONSUMER,
            attributes={"splitserve.request_id": job.request_id, "splitserve.worker": self.worker.instance_id,
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
            self.worker.engine_loop.abort(job.request_id)  # frees the blocks it held for the transfer
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

    async def _refused(self, job: PrefillJob) -> str | None:
        """Why the job is not computed here ("expired", "refused", told to its decode worker), or None."""
        if job.deadline_ms < now_ms():
            return "expired"  # its decode worker has already prefilled locally
        engine = self.worker.engine
        if job.block_size != engine.config.block_size:
            await self._report(job, ok=False, error=f"block size {job.block_size} != {engine.config.block_size}")
            return "refused"
        if job.model_fingerprint != engine.fingerprint:  # another model's KV would be wrong, silently
            self.counts["refused_other_model"] = self.counts.get("refused_other_model", 0) + 1
            await self._report(job, ok=False, error="the job is for another model (or dtype) than this worker's")
            return "refused"
        try:
            job.sampling.validate()  # the bus's decode checked its types, not its values
        except EngineError as exc:
            await self._report(job, ok=False, error=f"bad sampling parameters: {exc}")
            return "refused"
        return None

    async def _prefill_and_ship(self, job: PrefillJob) -> str:
        refused = await self._refused(job)
        if refused is not None:
            return refused
        engine, params = self.worker.engine, job.sampling
        # Only the first token is drawn here (min_tokens kept for it: its EOS stays suppressed if it was).
        first_only = msgspec.structs.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        # The KV streams out layer by layer while the prompt's last step computes the next layers.
        layers = self.prompt_kv.open(job.request_id)
        # The layers whose KV this process ships: a pipeline's stages ship the rest.
        num_layers = engine.local_layers_end

        async def parts():
            for _ in range(num_layers):
                yield await layers.get()

        claim = None if num_layers == engine.model_config.num_hidden_layers else (0, num_layers)
        sending = asyncio.create_task(
            self.sender.send(job.ticket, parts(), backend=self.kv_transport, layers=claim))
        if self.stages is not None:
            self.stages.begin(job)
        future = self._loop.create_future()
        self._first_tokens[job.request_id] = future
        try:
            if self.worker.kv_store is not None:  # the engine starts from the prefix the store holds, if longer
                self.worker.kv_store.expect(job.request_id, job.prompt_token_ids, params.cache_salt)
            self.worker.engine_loop.add(AddRequest(job.request_id, job.prompt_token_ids, first_only,
                                                   hold_kv=True, stream_prompt_kv=True))
            remaining_s = max(0.0, (job.deadline_ms - now_ms()) / 1000)
            try:
                async with asyncio.timeout(remaining_s):
                    output = await future
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
                       and prompt_len + 1 < engine.max_model_len)
            await self._report(job, ok=True, output=output, will_transfer=goes_on)
            if not goes_on:
                return "finished_at_first_token"
            result = await sending
            trace.get_current_span().set_attributes(
                {**result.span_attributes(), "splitserve.cached_tokens": output.num_cached_tokens})
            # Even when this process's own part failed: the other stages may still read the blocks in place.
            others_error = await self.stages.shipped(job) if self.stages is not None else None
        finally:
            self._first_tokens.pop(job.request_id, None)
            self.prompt_kv.close(job.request_id)
            if self.stages is not None:
                self.stages.end(job)
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

    async def _keep_alive(self, msg) -> None:
        while msg is not None:
            await asyncio.sleep(_KEEPALIVE_S)
            try:
                await msg.in_progress()
            except Exception as exc:  # the job will be redelivered; nothing else to do
                log.warning("in-progress ack failed", error=repr(exc))

    async def _report(self, job: PrefillJob, ok: bool, output: RequestOutput | None = None,
                      will_transfer: bool = False, error: str = "") -> None:
        w = self.worker
        result = PrefillResult(request_id=job.request_id, ok=ok, prefill_instance=w.instance_id, error=error,
                               will_transfer=will_transfer, kv_written_back=w.kv_store is not None,
                               model_fingerprint=w.engine.fingerprint, job_token=job.ticket.token)
        if output is not None:
            result.first_token_id = output.new_token_ids[0]
            result.num_prompt_tokens = output.num_prompt_tokens
            result.num_cached_tokens = output.num_cached_tokens
            if output.new_logprobs:
                result.first_logprobs = LogprobEntry.of(output.new_logprobs[0])
        await w.nc.publish(sent_by(job.reply_subject, w.identity.role, w.instance_id), result.encode())

    async def on_cancel(self, cancel: CancelRequest) -> None:
        task = self.jobs.get(cancel.request_id)
        if task is not None:
            self._cancelled[cancel.request_id] = True
            task.cancel()

    def _quiet(self) -> bool:
        """Nothing of this worker runs on its CPUs but the engine (read from the engine thread: it lends them)."""
        kv_store = self.worker.kv_store
        return self.sender.sends_in_flight == 0 and (kv_store is None or kv_store.puts_in_flight == 0)

    async def on_outputs(self, items: list[RequestOutput | RequestRejected]) -> None:
        for item in items:
            future = self._first_tokens.get(item.request_id)
            if future is not None and not future.done():
                future.set_result(item)

    def _count(self, outcome: str) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
