"""The scheduler's request loop: take a request off JetStream, hand it to a worker, ack.

A request is acked only once a worker has taken it (or it has failed for
good), so a scheduler that dies mid-handoff leaves it to be redelivered; the
same request id is recognised (here and by the worker) and never run twice.
"""

import asyncio
from collections import OrderedDict

import nats.errors

from contracts import CancelRequest, ContractError, GenerateRequest, HandoffReply, RequestFailed, ServiceInfo, Subjects
from services.common.identity import ServiceIdentity, now_ms
from services.scheduler.routing import decide_prefill, eligible_workers, rank_by_load
from shared.bus.registry import Heartbeat, Registry
from shared.bus.subscribe import REJECTED, fetch_loop
from shared.telemetry.logging import get_logger

log = get_logger(__name__)

_RECENT_REQUESTS = 10_000  # request ids remembered for de-duplication
_REFRESH_S = 0.5


class Router:
    def __init__(self, *, nc, registry: Registry, subjects: Subjects, instance_id: str,
                 handoff_timeout_s: float = 5.0, max_concurrent_handoffs: int = 64,
                 max_local_prefill: int = 256, max_prefill_queue: int = 64):
        self.nc = nc
        self.registry = registry
        self.subjects = subjects
        self.instance_id = instance_id
        self.handoff_timeout_s = handoff_timeout_s
        self.workers: list[ServiceInfo] = []
        self._recent: OrderedDict[str, str] = OrderedDict()
        self._slots = asyncio.Semaphore(max_concurrent_handoffs)
        self._heartbeat = Heartbeat(registry, self.info)
        self.identity = ServiceIdentity(instance_id, "scheduler")
        self.counts: dict[str, int] = {}
        self.decisions: dict[str, int] = {}
        self.max_local_prefill = max_local_prefill
        self.max_prefill_queue = max_prefill_queue
        self.prefill_queue_depth = 0

    def info(self) -> ServiceInfo:
        return self.identity.info(
            state="ready",
            details={"routed": dict(self.counts), "rejected_messages": dict(REJECTED),
                     "disagg_decisions": dict(self.decisions), "prefill_queue_depth": self.prefill_queue_depth},
        )

    async def start(self) -> list[asyncio.Task]:
        await self._refresh()
        self._heartbeat.start()
        consumer = await self.nc.jetstream().pull_subscribe(
            self.subjects.submit, durable=self.subjects.scheduler_consumer, stream=self.subjects.requests_stream
        )
        return [asyncio.create_task(self._refresh_forever(), name="refresh-workers"),
                asyncio.create_task(fetch_loop(consumer, GenerateRequest, self.on_request), name="fetch-requests")]

    async def stop(self) -> None:
        await self._heartbeat.stop(remove=True)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(_REFRESH_S)
            await self._refresh()

    async def _refresh(self) -> None:
        self.workers = await self.registry.list()
        if any(w.role == "prefill" for w in self.workers):
            try:
                info = await self.nc.jetstream().consumer_info(self.subjects.prefill_stream, self.subjects.prefill_consumer)
                self.prefill_queue_depth = info.num_pending + info.num_ack_pending
            except Exception as exc:  # the queue may not exist yet
                self.prefill_queue_depth = 0  # unknown: do not let local increments pile up
                log.debug("prefill queue depth unknown", error=repr(exc))

    # ---- one request --------------------------------------------------------------------
    async def on_request(self, request: GenerateRequest, msg) -> None:
        """Called by the fetch loop; routes concurrently, bounded by the handoff slots."""
        await self._slots.acquire()
        task = asyncio.create_task(self._route(request, msg))
        task.add_done_callback(lambda _: self._slots.release())

    async def _route(self, request: GenerateRequest, msg) -> None:
        try:
            outcome = await self._hand_over(request)
        except Exception:
            log.exception("routing failed", request_id=request.request_id)
            outcome = "internal"
            await self._fail(request, "internal", "the scheduler failed to route the request")
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        await msg.ack()

    async def _hand_over(self, request: GenerateRequest) -> str:
        if request.request_id in self._recent:
            return "duplicate"
        if request.deadline_ms and request.deadline_ms < now_ms():
            await self._fail(request, "timeout", "the request expired before a worker could take it")
            return "expired"
        if not eligible_workers(self.workers, "decode", request.model):
            await self._refresh()  # the snapshot may predate a worker that just registered
        candidates = rank_by_load(eligible_workers(self.workers, "decode", request.model))
        request.prefill = decide_prefill(
            len(request.prompt_token_ids), self.prefill_queue_depth, max_local_prefill=self.max_local_prefill,
            max_prefill_queue=self.max_prefill_queue,
            prefill_workers_ready=len(eligible_workers(self.workers, "prefill", request.model)),
        )
        self.decisions[request.prefill] = self.decisions.get(request.prefill, 0) + 1
        if request.prefill == "remote":
            self.prefill_queue_depth += 1  # until the next refresh shows the real depth
        for worker in candidates:
            reply = await self._offer(worker, request)
            if reply == "timeout":
                # It may have taken the request after all: offering it elsewhere could run it twice.
                await self.nc.publish(self.subjects.cancel, CancelRequest(request_id=request.request_id,
                                                                          reason="handoff_timeout").encode())
                await self._fail(request, "worker_failed", f"worker {worker.instance_id} did not answer the handoff")
                return "handoff_timeout"
            if reply is None or not reply.accepted and reply.code in ("overloaded", "draining", "timeout"):
                continue
            if not reply.accepted:
                await self._fail(request, reply.code or "invalid_request", reply.message, reply.param)
                return "rejected"
            worker.num_waiting += 1  # until the next refresh shows the real load
            self._remember(request.request_id, worker.instance_id)
            return "assigned"
        await self._fail(request, "no_worker", f"no {request.model!r} worker can take the request now",
                         retry_after_s=1.0)
        return "no_worker"

    async def _offer(self, worker: ServiceInfo, request: GenerateRequest) -> HandoffReply | str | None:
        """The worker's reply; None when it is not there (try the next); "timeout" when it did not answer."""
        try:
            response = await self.nc.request(
                self.subjects.worker_generate(worker.instance_id), request.encode(), timeout=self.handoff_timeout_s
            )
            return HandoffReply.decode(response.data)
        except ContractError as exc:
            log.warning("bad handoff reply", worker=worker.instance_id, error=str(exc))
        except nats.errors.TimeoutError:
            log.warning("handoff timed out", worker=worker.instance_id)
            return "timeout"
        except Exception as exc:  # no responders, connection trouble: try the next worker
            log.warning("handoff failed", worker=worker.instance_id, error=type(exc).__name__)
        return None

    def _remember(self, request_id: str, worker_id: str) -> None:
        self._recent[request_id] = worker_id
        while len(self._recent) > _RECENT_REQUESTS:
            self._recent.popitem(last=False)

    async def _fail(self, request: GenerateRequest, code: str, message: str, param: str | None = None,
                    retry_after_s: float | None = None) -> None:
        failure = RequestFailed(request_id=request.request_id, code=code, message=message, param=param,
                                retry_after_s=retry_after_s)
        await self.nc.publish(request.reply_subject, failure.encode())
