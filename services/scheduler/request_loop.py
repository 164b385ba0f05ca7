"""The scheduler's request loop: take a request off JetStream, hand it to a worker, ack.

A request is acked only once a worker has taken it (or it has failed for
good), so a scheduler that dies mid-handoff leaves it to be redelivered; the
same request id is recognised (here and by the worker) and never run twice.
One that was frozen past the ack wait leaves it to its redelivery (`lease`).
"""

import asyncio
import time
from collections import Counter, OrderedDict, deque

import nats.errors
import structlog
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from contracts import (
    Assignment,
    CancelRequest,
    ContractError,
    GenerateRequest,
    HandoffReply,
    KVEvents,
    KVSnapshotRequest,
    RequestFailed,
    ServiceInfo,
    ServiceStats,
    StatsRequest,
    Subjects,
    WorkerLoad,
    from_anyone,
    sender_of,
    sent_by,
)
from services.common.identity import ServiceIdentity, now_ms
from services.common.queues import REQUEST_ACK_WAIT_S
from services.common.role_epoch import STALE_ROLE
from services.scheduler.lease import Lease
from services.scheduler.prefix_index import PrefixIndex
from services.scheduler.handoffs_in_flight import RoutedTally
from services.scheduler.worker_choice import (
    CachedPrefixes,
    blocks_to_take,
    cached_prefixes,
    decide_prefill,
    describe_load,
    eligible_workers,
    num_seqs,
    prefill_backlog,
    pick_prefill_worker,
    rank_by_kv,
    rank_by_load,
    with_load,
)
from shared.bus.registry import Heartbeat, Registry
from shared.bus.subscribe import REJECTED, fetch_loop, reject_unattributed, subscribe_typed
from shared.telemetry.logging import get_logger
from shared.telemetry.tracing import extract, inject, tracer

log = get_logger(__name__)

_RECENT_REQUESTS = 10_000  # request ids remembered for de-duplication
_REFRESH_S = 0.5
_RECENT_POOL_MS = 15_000  # a model's decode workers all gone for less than this: a request waits for them
_WAIT_MARGIN_MS = 2_000  # a request waiting for a worker gives up this long before its deadline
_SNAPSHOT_RETRY_S = 2.0  # ask one publisher of KV events for a snapshot at most this often
_MAX_PUBLISHERS = 4096  # publishers remembered for the snapshot retry interval
ROUTERS = ("load", "kv")


class Router:
    def __init__(self, *, nc, registry: Registry, subjects: Subjects, instance_id: str,
                 handoff_timeout_s: float, max_local_prefill: int, max_prefill_queue: int,
                 offload_short_prefills: bool, prefill_backlog_factor: float, router: str, overlap_weight: float,
                 max_index_blocks: int, max_concurrent_handoffs: int = 64):
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, not {router!r}")
        self.nc = nc
        self.registry = registry
        self.subjects = subjects
        self.instance_id = instance_id
        self.handoff_timeout_s = handoff_timeout_s
        self.workers: list[ServiceInfo] = []
        self._decode_seen_ms: dict[str, int] = {}  # model -> when a decode worker serving it was last in view
        self._recent: OrderedDict[str, str] = OrderedDict()
        self._slots = asyncio.Semaphore(max_concurrent_handoffs)
        self.heartbeat = Heartbeat(registry, self.info)
        self.identity = ServiceIdentity(instance_id, "scheduler")
        self.counts: dict[str, int] = {}
        self.stale_refusals = 0  # handoffs refused by a worker that switched role after this view of it
        self.redelivered = 0  # requests taken that an earlier delivery left unacked
        self.decisions: dict[str, int] = {}
        self.max_local_prefill = max_local_prefill
        self.offload_short_prefills = offload_short_prefills
        self.max_prefill_queue = max_prefill_queue
        self.prefill_backlog_factor = prefill_backlog_factor
        self.prefill_queue_depth = 0
        # The uncached tokens of the jobs sent to the prefill queue, oldest first: the newest `prefill_queue_depth`
        # of them are what the pool has yet to compute (`prefill_backlog`).
        self._queued_prefills: deque[int] = deque(maxlen=max(max_prefill_queue, 1))
        self.request_queue_depth = 0
        self.router = router
        self.overlap_weight = overlap_weight
        self.index = PrefixIndex(max_index_blocks)
        self.routed = RoutedTally()  # what the workers' heartbeats do not show yet
        self._loads: dict[str, WorkerLoad] = {}  # instance id -> its latest load report
        self._snapshot_asked: dict[str, float] = {}
        self.prefix_hits = {"requests": 0, "prompt_blocks": 0, "cached_blocks": 0}  # of the workers chosen (kv router)

    def info(self) -> ServiceInfo:
        return self.identity.info(state="ready")

    def stats(self) -> ServiceStats:
        return ServiceStats.of(self.info(), {
            "routed": dict(self.counts), "redelivered": self.redelivered, "rejected_messages": dict(REJECTED),
            "stale_refusals": self.stale_refusals,
            "disagg_decisions": dict(self.decisions), "prefill_queue_depth": self.prefill_queue_depth,
            "queue_depths": {"requests": self.request_queue_depth, "prefill": self.prefill_queue_depth},
            "workers_seen": dict(Counter(w.role for w in self.workers if w.state == "ready")),
            # What it routes by: each engine worker's requests and KV blocks in use, as it last heard.
            "loads_seen": {w.instance_id: {"requests": num_seqs(w), "blocks_in_use": w.kv_blocks_total
                                           - w.kv_blocks_free} for w in self.workers if w.kv_blocks_total},
            "router": self.router, "routed_unconfirmed": self.routed.counts(),
            "prefix_index": {"blocks": len(self.index), **self.index.counts,
                             "by_instance": {i: self.index.blocks_of(i) for i in self.index.instances()}},
            "prefix_hits": dict(self.prefix_hits)})

    async def start(self) -> list[asyncio.Task]:
        await subscribe_typed(self.nc, self.subjects.stats(self.instance_id), StatsRequest, self._on_stats)
        if self.router == "kv":
            await subscribe_typed(self.nc, from_anyone(self.subjects.kv_events), KVEvents, self._on_kv_events)
        await subscribe_typed(self.nc, from_anyone(self.subjects.worker_load), WorkerLoad, self._on_load)
        await self.nc.flush()
        await self._refresh()
        self.heartbeat.start()
        consumer = await self.nc.jetstream().pull_subscribe(
            self.subjects.submit, durable=self.subjects.scheduler_consumer, stream=self.subjects.requests_stream
        )
        return [asyncio.create_task(self._refresh_forever(), name="refresh-workers"),
                asyncio.create_task(fetch_loop(consumer, GenerateRequest, self.on_request), name="fetch-requests")]

    async def _on_stats(self, _: StatsRequest, msg) -> None:
        if msg.reply:
            await msg.respond(self.stats().encode())

    async def stop(self) -> None:
        await self.heartbeat.stop(remove=True)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(_REFRESH_S)
            await self._refresh_or_keep()

    async def _refresh_or_keep(self) -> None:
        try:
            await self._refresh()
        except Exception as exc:  # NATS restarting, JetStream not back yet: route by the last view meanwhile
            log.warning("registry read failed; routing by the last view", error=repr(exc))

    async def _refresh(self) -> None:
        entries = await self.registry.list()
        self._loads = {e.instance_id: self._loads[e.instance_id] for e in entries if e.instance_id in self._loads}
        self.workers = [with_load(entry, self._loads.get(entry.instance_id)) for entry in entries]
        for model in {w.served_model_name for w in self.workers if w.role == "decode" and w.state == "ready"}:
            self._decode_seen_ms[model] = now_ms()
        self.routed.settle(self.workers, now_ms())
        if self.router == "kv":
            present = {w.instance_id for w in self.workers}
            known = set(self.index.instances())
            for instance_id in known - present:
                self.index.forget(instance_id)  # it left (or its heartbeat lapsed): its cache is gone
            for worker in self.workers:
                # Registered, but nothing heard (it published before this scheduler listened, or its snapshot
                # came before its heartbeat and was dropped above): ask, as an idle one sends nothing else.
                if worker.instance_id not in known and worker.publishes_kv_events:
                    await self._ask_snapshot(worker.instance_id, "unknown")
        if any(w.role == "prefill" for w in self.workers):
            try:
                info = await self.nc.jetstream().consumer_info(self.subjects.prefill_stream, self.subjects.prefill_consumer)
                self.prefill_queue_depth = info.num_pending + info.num_ack_pending
            except Exception as exc:  # the queue may not exist yet
                self.prefill_queue_depth = 0  # unknown: do not let local increments pile up
                log.debug("prefill queue depth unknown", error=repr(exc))
        try:
            info = await self.nc.jetstream().consumer_info(self.subjects.requests_stream, self.subjects.scheduler_consumer)
            self.request_queue_depth = info.num_pending
        except Exception as exc:
            self.request_queue_depth = 0  # unknown
            log.debug("request queue depth unknown", error=repr(exc))

    # ---- one request --------------------------------------------------------------------
    async def on_request(self, request: GenerateRequest, msg) -> None:
        """Called by the fetch loop; routes concurrently, bounded by the handoff slots."""
        lease = Lease(msg, REQUEST_ACK_WAIT_S)  # from now: waiting for a slot counts too
        if msg.metadata.num_delivered > 1:  # a scheduler pulled it and never acked it (it died, or its lease lapsed)
            self.redelivered += 1
        await self._slots.acquire()
        task = asyncio.create_task(self._route(request, msg, lease))
        task.add_done_callback(lambda _: self._slots.release())

    async def _route(self, request: GenerateRequest, msg, lease: Lease) -> None:
        with tracer().start_as_current_span(
            "scheduler.route", context=extract(msg.headers), kind=SpanKind.CONSUMER,
            attributes={"splitserve.request_id": request.request_id, "splitserve.router": self.router,
                        "splitserve.prompt_tokens": len(request.prompt_token_ids),
                        "splitserve.queue_wait_s": max(0.0, (now_ms() - request.created_ms) / 1000)},
        ) as span, structlog.contextvars.bound_contextvars(request_id=request.request_id):
            keeper = asyncio.create_task(lease.keep())
            try:
                outcome = await self._hand_over(request, lease)
            except Exception:
                log.exception("routing failed")
                outcome = "internal"
                await self._fail(request, "internal", "the scheduler failed to route the request")
            finally:
                keeper.cancel()
            span.set_attribute("splitserve.outcome", outcome)
            if outcome != "assigned":
                span.set_status(Status(StatusCode.ERROR, outcome))
            self.counts[outcome] = self.counts.get(outcome, 0) + 1
            if outcome == "lapsed":
                log.warning("request left to its redelivery: this scheduler held it past its ack wait")
                return  # unacked: whoever it was redelivered to routes it
            await msg.ack()

    async def _hand_over(self, request: GenerateRequest, lease: Lease) -> str:
        if request.request_id in self._recent:
            return "duplicate"
        if lease.lapsed():
            return "lapsed"
        if request.deadline_ms and request.deadline_ms < now_ms():
            await self._fail(request, "timeout", "the request expired before a worker could take it")
            return "expired"
        if not eligible_workers(self.workers, "decode", request.model):
            await self._refresh_or_keep()  # the snapshot may predate a worker that just registered
        outcome, unreached = await self._offer_to_workers(request, lease)
        # Wait for a worker, short of the request's deadline (so that its gateway hears why), where a 503 would be
        # wrong: a moved request's client holds an open stream and cannot retry it (wait for a worker to come
        # back: one restarting, a pipeline whose stage restarts); no worker was reached at all (this
        # scheduler's NATS connection is failing over, or theirs is), which says nothing of their capacity; and
        # the model's workers were all there moments ago (restarting, or their registry entries lapsing while
        # NATS fails over). A model nobody has served for a while is a 503 at once.
        while (outcome is None and (request.moves or unreached or self._pool_just_emptied(request.model))
               and now_ms() + _WAIT_MARGIN_MS < request.deadline_ms):
            await asyncio.sleep(_REFRESH_S)
            if lease.lapsed():
                return "lapsed"
            outcome, unreached = await self._offer_to_workers(request, lease)  # on `_refresh_forever`'s view
        if outcome is not None:
            return outcome
        await self._fail(request, "no_worker", f"no {request.model!r} worker can take the request now",
                         retry_after_s=1.0)
        return "no_worker"

    def _pool_just_emptied(self, model: str) -> bool:
        """No `model` decode worker in view now, though one was within `_RECENT_POOL_MS`."""
        seen = self._decode_seen_ms.get(model)
        return (seen is not None and now_ms() - seen < _RECENT_POOL_MS
                and not eligible_workers(self.workers, "decode", model))

    async def _offer_to_workers(self, request: GenerateRequest, lease: Lease) -> tuple[str | None, bool]:
        """Offer the request to the eligible workers, best first: (the outcome, or None when none would take it
        now; whether none was reached at all, by a bus that is not connected or no answer from any)."""
        prompt = request.prompt_token_ids
        decode_workers = self.routed.apply([w for w in eligible_workers(self.workers, "decode", request.model)
                                            if w.boot_id not in request.moved_from])  # a stale entry may list it
        prefill_workers = eligible_workers(self.workers, "prefill", request.model)
        cached = None
        if self.router == "kv":
            cached = cached_prefixes(decode_workers + prefill_workers, prompt, self.index.overlaps,
                                     request.sampling.cache_salt)
            candidates = rank_by_kv(decode_workers, cached.prompt_blocks, cached.blocks, self.overlap_weight)
        else:
            candidates = rank_by_load(decode_workers)
        span = trace.get_current_span()
        if span.is_recording():  # the loads it was routed by, this scheduler's own count of its routing included
            span.set_attribute("splitserve.candidates", [
                describe_load(w, cached.blocks.get(w.instance_id, 0) if cached is not None else None)
                for w in candidates])
        unreached = not self.nc.is_connected or bool(candidates)
        for worker in candidates:
            if lease.lapsed():  # frozen while routing: it may be another scheduler's now
                return "lapsed", False
            uncached = self._plan_prefill(request, worker, prefill_workers, cached)
            # Counted on the worker before the handoff, so that the requests routed meanwhile see it.
            self.routed.offered(request.request_id, worker, now_ms=now_ms(), num_blocks=blocks_to_take(
                worker, len(prompt), cached.blocks.get(worker.instance_id, 0) if cached is not None else 0))
            request.role_epoch = worker.role_epoch  # it refuses the request if it has switched role since
            reply = await self._offer(worker, request)
            if reply == "timeout":
                reply = await self._offer_again(worker, request, lease)
            stale = isinstance(reply, HandoffReply) and reply.code == STALE_ROLE
            unreached = unreached and (reply is None or stale)  # a stale view: wait for the next, as for none
            if isinstance(reply, HandoffReply) and reply.accepted:
                self.routed.accepted(request.request_id, reply.handoffs_taken, self.workers)
            else:
                self.routed.discard(request.request_id)
            if reply == "timeout":
                # It may have taken the request after all: offering it elsewhere could run it twice.
                await self.nc.publish(self.subjects.cancel, CancelRequest(request_id=request.request_id,
                                                                          reason="handoff_timeout").encode())
                # The client may try again at once: a 503 with Retry-After, not a server error.
                await self._fail(request, "no_worker", f"worker {worker.instance_id} did not answer the handoff",
                                 retry_after_s=1.0)
                return "handoff_timeout", False
            if stale:
                self.stale_refusals += 1  # it switched role since this view: the next refresh shows it
                continue
            if reply is None or not reply.accepted and reply.code in ("overloaded", "draining", "timeout"):
                continue
            if not reply.accepted:
                await self._fail(request, reply.code or "invalid_request", reply.message, reply.param)
                return "rejected", False
            self._assigned(request, worker, cached, uncached)
            # The gateway believes the request's events only from the worker this names (its own are not enough:
            # any worker could claim a request).
            await self._tell_gateway(request, Assignment(request_id=request.request_id,
                                                         worker_instance=worker.instance_id,
                                                         worker_boot_id=worker.boot_id))
            return "assigned", False
        return None, unreached

    def _plan_prefill(self, request: GenerateRequest, worker: ServiceInfo, prefill_workers: list[ServiceInfo],
                      cached: CachedPrefixes | None) -> int:
        """Where `worker` is to get the request's prompt computed: itself, or the prefill pool (which worker).
        Returns the prompt tokens that `worker` does not hold."""
        uncached = len(request.prompt_token_ids) - (cached.tokens(worker) if cached is not None else 0)
        if request.resume_output_token_ids:  # a moved request: its worker computes the streamed tokens after it too
            request.prefill, request.prefill_instance = "local", ""
            return uncached + len(request.resume_output_token_ids)
        if request.sampling.prompt_logprobs is not None:  # its worker computes the whole prompt: it has the logits
            request.prefill, request.prefill_instance = "local", ""
            return len(request.prompt_token_ids)
        request.prefill = decide_prefill(
            uncached, self.prefill_queue_depth, max_local_prefill=self.max_local_prefill,
            max_prefill_queue=self.max_prefill_queue, prefill_workers_ready=len(prefill_workers),
            decode_worker_busy=worker.num_running + worker.num_waiting > 0, offload_short=self.offload_short_prefills,
            prefill_backlog_tokens=(prefill_backlog(self._queued_prefills, self.prefill_queue_depth)
                                    if self.prefill_backlog_factor else 0),  # summed only where it is used
            backlog_factor=self.prefill_backlog_factor,
        )
        request.prefill_instance = ""
        if request.prefill == "remote" and cached is not None:
            request.prefill_instance = pick_prefill_worker(prefill_workers, cached.prompt_blocks, cached.blocks,
                                                           self.overlap_weight)
        request.prefill_epoch = next((w.role_epoch for w in prefill_workers
                                      if w.instance_id == request.prefill_instance), None)
        return uncached

    def _assigned(self, request: GenerateRequest, worker: ServiceInfo, cached: CachedPrefixes | None,
                  uncached: int) -> None:
        self.decisions[request.prefill] = self.decisions.get(request.prefill, 0) + 1
        if request.prefill == "remote" and not request.prefill_instance:  # a job offered to one worker is not queued
            self.prefill_queue_depth += 1  # until the next refresh shows the real depth
            self._queued_prefills.append(uncached)
        self._remember(request.request_id, worker.instance_id)
        span = trace.get_current_span()
        span.set_attributes({"splitserve.worker": worker.instance_id, "splitserve.prefill": request.prefill,
                             "splitserve.prefill_worker": request.prefill_instance})
        if cached is not None:
            self.prefix_hits["requests"] += 1
            self.prefix_hits["prompt_blocks"] += cached.prompt_blocks
            self.prefix_hits["cached_blocks"] += cached.blocks.get(worker.instance_id, 0)
            span.set_attributes({"splitserve.prompt_blocks": cached.prompt_blocks,
                                 "splitserve.cached_blocks": cached.blocks.get(worker.instance_id, 0)})

    async def _on_load(self, load: WorkerLoad, msg) -> None:
        """A worker's load between heartbeats: its entry shows it at once (and what it shows is no longer counted
        here). Reports of workers not in the registry are dropped: the registry bounds what is kept."""
        if not _from_itself(load.instance_id, msg, "load report"):
            return
        if not any(worker.instance_id == load.instance_id for worker in self.workers):
            return
        self._loads[load.instance_id] = load
        self.workers = [with_load(w, load) if w.instance_id == load.instance_id else w for w in self.workers]
        self.routed.settle(self.workers, now_ms())

    async def _on_kv_events(self, event: KVEvents, msg) -> None:
        if not _from_itself(event.instance_id, msg, "KV events"):
            return
        if not self.index.apply(event):
            await self._ask_snapshot(event.instance_id, "gap" if event.seq else "new")

    async def _ask_snapshot(self, instance_id: str, reason: str) -> None:
        """Ask a publisher of KV events for a snapshot, at most once per _SNAPSHOT_RETRY_S."""
        now = time.monotonic()
        asked = self._snapshot_asked.pop(instance_id, None)
        if asked is not None and now - asked < _SNAPSHOT_RETRY_S:
            self._snapshot_asked[instance_id] = asked
            return
        self._snapshot_asked[instance_id] = now
        while len(self._snapshot_asked) > _MAX_PUBLISHERS:  # bounded: instances come and go
            self._snapshot_asked.pop(next(iter(self._snapshot_asked)))
        try:
            await self.nc.publish(self.subjects.kv_snapshot(instance_id), KVSnapshotRequest(reason=reason).encode())
        except Exception as exc:
            log.warning("could not ask for a KV snapshot", instance=instance_id, error=repr(exc))

    async def _offer_again(self, worker: ServiceInfo, request: GenerateRequest, lease: Lease) -> HandoffReply | str | None:
        """After a handoff that timed out: the same offer to the same worker while it stays registered (as the
        same process), short of the request's deadline. It may have taken the request (it then answers that it
        has it: workers know a request by its id) or never seen it (its connection failing over); offering it
        elsewhere instead could run it twice. "timeout" if it never answers."""
        reply: HandoffReply | str | None = "timeout"
        while reply in ("timeout", None) and now_ms() + _WAIT_MARGIN_MS < request.deadline_ms and not lease.lapsed():
            if not any(w.instance_id == worker.instance_id and w.boot_id == worker.boot_id for w in self.workers):
                break
            if reply is None:  # not subscribed now (reconnecting): it answers at once, so pause
                await asyncio.sleep(_REFRESH_S)
            reply = await self._offer(worker, request)
        return "timeout" if reply is None else reply

    async def _offer(self, worker: ServiceInfo, request: GenerateRequest) -> HandoffReply | str | None:
        """The worker's reply; None when it is not there (try the next); "timeout" when it did not answer."""
        try:
            response = await self.nc.request(
                self.subjects.worker_generate(worker.instance_id), request.encode(), timeout=self.handoff_timeout_s,
                headers=inject(),
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
        await self._tell_gateway(request, RequestFailed(request_id=request.request_id, code=code, message=message,
                                                        param=param, retry_after_s=retry_after_s))

    async def _tell_gateway(self, request: GenerateRequest, event: Assignment | RequestFailed) -> None:
        await self.nc.publish(sent_by(request.reply_subject, "scheduler", self.instance_id), event.encode())


def _from_itself(instance_id: str, msg, what: str) -> bool:
    """Whether a report about `instance_id` was sent by that instance (no worker speaks for another)."""
    sender = sender_of(msg.subject)
    if sender.instance_id == instance_id:
        return True
    reject_unattributed(sender, what, f"it is about {instance_id}")
    return False
