"""The kv-store service: lookups and bookkeeping over NATS, block bytes over the side channel only.

    lookup  {hashes}                         -> {num_hit, tiers}
    put     {transfer_id, hashes, dtype, block_shape}
                                             -> {ticket}; the worker then sends block i as "layer" i
    get     {hashes, ticket}                 -> {ok}; the store then sends block i as "layer" i to the ticket

Data arrives only through an authenticated side-channel transfer this store
expects (its ticket); a put is stored once the whole transfer arrived, never in
part, and never over a block already held (the first write stands). Bounds:
blocks per request, bytes per block, bytes per put and puts in flight (their
count and their bytes), each refused up front with its reason, and the tiers'
own (see `store.py`). Disk work runs off the event loop.
"""

import asyncio
import math
import secrets
import time

from opentelemetry.trace import SpanKind, Status, StatusCode

from contracts import (KVStoreGet, KVStoreLookup, KVStorePut, KVStoreReply, ServiceInfo, ServiceStats, StatsRequest,
                       Subjects, from_anyone, sender_of)
from services.common.identity import ServiceIdentity, now_ms
from services.common.kv_event_publisher import KVEventPublisher
from services.kvstore.block import StoredBlock
from services.kvstore.clients import ModelWorkers
from services.kvstore.store import TieredBlockStore
from shared.bus.registry import Heartbeat, Registry
from shared.bus.subscribe import REJECTED, reject_unattributed, subscribe_typed
from shared.engine import BLOCK_HASH_BYTES
from shared.telemetry.logging import get_logger
from shared.telemetry.tracing import extract, tracer
from shared.transfer import KVReceiver, KVSender, TransferTicket
from shared.transfer.wire import DTYPES

log = get_logger(__name__)


class KVStoreService:
    def __init__(self, *, nc, registry: Registry, subjects: Subjects, instance_id: str, store: TieredBlockStore,
                 receiver: KVReceiver, sender: KVSender, max_put_bytes: int, max_put_bytes_in_flight: int,
                 max_blocks_per_request: int = 4096, max_block_bytes: int = 64 << 20, max_puts_in_flight: int = 64,
                 transfer_timeout_s: float = 30.0):
        self.nc = nc
        self.registry = registry
        self.subjects = subjects
        self.instance_id = instance_id
        self.store = store
        self.receiver = receiver
        self.sender = sender
        self.max_blocks_per_request = max_blocks_per_request
        self.max_block_bytes = max_block_bytes
        self.max_puts_in_flight = max_puts_in_flight
        self.max_put_bytes = max_put_bytes
        self.max_put_bytes_in_flight = max_put_bytes_in_flight
        self.transfer_timeout_s = transfer_timeout_s
        self.identity = ServiceIdentity(instance_id, "kvstore")
        self.state = "starting"
        self.counts: dict[str, int] = {}
        self._tasks: set[asyncio.Task] = set()
        self._puts_in_flight = 0
        self._put_bytes_in_flight = 0  # declared by the puts in flight: what their blocks will take here
        self.heartbeat = Heartbeat(registry, self.info)
        self.workers = ModelWorkers(registry.list)
        self.kv_events = KVEventPublisher(nc=nc, subjects=subjects, instance_id=instance_id, role="kvstore",
                                          boot_id=self.identity.boot_id, events=store.kv_events,
                                          held_hashes=lambda: asyncio.to_thread(store.held_hashes))

    async def start(self) -> list[asyncio.Task]:
        event_tasks = await self.kv_events.start()
        for endpoint, cls, handler in (("lookup", KVStoreLookup, self._on_lookup), ("put", KVStorePut, self._on_put),
                                       ("get", KVStoreGet, self._on_get)):
            await subscribe_typed(self.nc, from_anyone(self.subjects.kvstore(self.instance_id, endpoint)), cls,
                                  self._from_model_worker(endpoint, handler))
        await subscribe_typed(self.nc, self.subjects.stats(self.instance_id), StatsRequest, self._on_stats)
        await self.nc.flush()
        self.state = "ready"
        self.heartbeat.start()
        return event_tasks

    async def stop(self) -> None:
        self.state = "draining"
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.receiver.stop()
        self.sender.close()
        await self.heartbeat.stop(remove=True)

    def info(self) -> ServiceInfo:
        return self.identity.info(state=self.state, publishes_kv_events=True)

    def stats(self) -> ServiceStats:
        return ServiceStats.of(self.info(), {
            "store": self.store.snapshot(), "requests": dict(self.counts), "puts_in_flight": self._puts_in_flight,
            "put_bytes_in_flight": self._put_bytes_in_flight,
            "kv_transfer_in": self.receiver.stats.snapshot(), "kv_transfer_out": self.sender.stats.snapshot(),
            "rejected_messages": dict(REJECTED), "kv_events": dict(self.kv_events.counts)})

    async def _on_stats(self, _: StatsRequest, msg) -> None:
        if msg.reply:
            await msg.respond(self.stats().encode())

    # ---- requests -----------------------------------------------------------------------------
    def _bad_hashes(self, hashes: list[bytes]) -> str | None:
        if not hashes:
            return "no block hashes"
        if len(hashes) > self.max_blocks_per_request:
            return f"{len(hashes)} blocks in one request; at most {self.max_blocks_per_request}"
        if any(len(h) != BLOCK_HASH_BYTES for h in hashes):
            return f"block hashes are {BLOCK_HASH_BYTES} bytes"
        return None

    def _from_model_worker(self, endpoint: str, handler):
        """`handler`, for requests from a registered worker of the model they name; others refused and counted."""

        async def checked(request, msg) -> None:
            sender = sender_of(msg.subject)
            reason = await self.workers.refusal(sender, request.model_fingerprint)
            if reason is not None:
                reject_unattributed(sender, f"kv-store {endpoint}", reason)
                return await self._answer(msg, KVStoreReply(ok=False, error=reason), f"{endpoint}_not_a_worker")
            await handler(request, msg)

        return checked

    async def _answer(self, msg, reply: KVStoreReply, outcome: str) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        if msg.reply:
            await msg.respond(reply.encode())

    async def _on_lookup(self, request: KVStoreLookup, msg) -> None:
        problem = self._bad_hashes(request.hashes)
        if problem:
            return await self._answer(msg, KVStoreReply(ok=False, error=problem), "lookup_refused")
        with tracer().start_as_current_span("kvstore.lookup", context=extract(msg.headers), kind=SpanKind.SERVER,
                                            attributes={"splitserve.blocks_asked": len(request.hashes)}) as span:
            count = self.store.longest_prefix(request.hashes)
            tiers = [self.store.tier_of(h) or "gone" for h in request.hashes[:count]]
            span.set_attributes({"splitserve.blocks_held": count, "splitserve.blocks_on_disk": tiers.count("disk")})
            await self._answer(msg, KVStoreReply(ok=True, num_hit=count, tiers=tiers), "lookup")

    def _put_problem(self, request: KVStorePut) -> tuple[str, str] | None:
        """Why a put is refused before anything is received (the outcome counted, the reason), or None."""
        problem = self._bad_hashes(request.hashes)
        if problem is None and request.dtype not in DTYPES:
            problem = f"dtype {request.dtype!r} is not one of {', '.join(DTYPES)}"
        if problem is None and (not request.block_shape or any(d <= 0 for d in request.block_shape)):
            problem = "block_shape must be a list of positive sizes"
        if problem is None and math.prod(request.block_shape) * DTYPES[request.dtype].itemsize > self.max_block_bytes:
            problem = f"blocks of more than {self.max_block_bytes} bytes"
        if problem is not None:
            return "put_refused", problem
        nbytes = put_bytes(request)
        if nbytes > self.max_put_bytes:
            return "put_over_budget", f"a put of {nbytes} bytes; this store takes at most {self.max_put_bytes} per put"
        if self._put_bytes_in_flight + nbytes > self.max_put_bytes_in_flight:
            return "put_over_budget", (f"{self._put_bytes_in_flight} bytes of puts in flight; this store takes at "
                                       f"most {self.max_put_bytes_in_flight}")
        if self._puts_in_flight >= self.max_puts_in_flight:
            # The worker computes instead; nothing is lost but a cache entry.
            return "put_refused", "too many puts in flight"
        return None

    async def _on_put(self, request: KVStorePut, msg) -> None:
        refused = self._put_problem(request)
        if refused is not None:
            outcome, problem = refused
            return await self._answer(msg, KVStoreReply(ok=False, error=problem), outcome)
        received: dict[int, StoredBlock] = {}
        shape = tuple(request.block_shape)
        dtype = DTYPES[request.dtype]

        def keep(start: int, end: int, part) -> None:  # a view, valid during the call: copy what it holds
            if part.dtype != dtype or tuple(part.shape[1:]) != shape:
                raise ValueError(f"a {part.dtype} part of shape {list(part.shape)} for {request.dtype} blocks of "
                                 f"shape {list(shape)}")
            for offset in range(end - start):
                received[start + offset] = StoredBlock.from_tensor(part[offset], request.model_fingerprint)

        deadline_s = max(0.1, min(self.transfer_timeout_s, (request.deadline_ms - now_ms()) / 1000))
        transfer_id = f"put-{request.transfer_id}-{secrets.token_hex(4)}"
        try:
            ticket = self.receiver.expect(transfer_id, on_part=keep, total_layers=(0, len(request.hashes)),
                                          deadline_s=deadline_s)
        except ValueError as exc:
            return await self._answer(msg, KVStoreReply(ok=False, error=str(exc)), "put_refused")
        nbytes = put_bytes(request)
        self._puts_in_flight += 1
        self._put_bytes_in_flight += nbytes
        self._spawn(self._finish_put(transfer_id, request.hashes, received, nbytes))
        await self._answer(msg, KVStoreReply(ok=True, ticket=ticket), "put")

    async def _finish_put(self, transfer_id: str, hashes: list[bytes], received: dict[int, StoredBlock],
                          nbytes: int) -> None:
        try:
            result = await self.receiver.wait(transfer_id)
            if not result.ok:
                self.counts["put_failed"] = self.counts.get("put_failed", 0) + 1
                return  # stored nothing: a put is all or none
            await asyncio.to_thread(lambda: [self.store.put(h, received[i]) for i, h in enumerate(hashes)])
        finally:
            self._puts_in_flight -= 1
            self._put_bytes_in_flight -= nbytes

    async def _on_get(self, request: KVStoreGet, msg) -> None:
        span = tracer().start_span("kvstore.get", context=extract(msg.headers), kind=SpanKind.SERVER,
                                   attributes={"splitserve.blocks": len(request.hashes)})
        sending = False
        try:
            problem = self._bad_hashes(request.hashes)
            ticket = request.ticket
            if problem:
                span.set_status(Status(StatusCode.ERROR, problem))
                return await self._answer(msg, KVStoreReply(ok=False, error=problem), "get_refused")
            found = await asyncio.to_thread(lambda: [self.store.get(h) for h in request.hashes])
            foreign = sum(1 for item in found if item is not None and item[0].model_fingerprint != request.model_fingerprint)
            if foreign:  # computed by another model: never served as this one's (the hashes should have differed)
                span.set_status(Status(StatusCode.ERROR, f"{foreign} blocks of another model"))
                return await self._answer(msg, KVStoreReply(ok=False, error=f"{foreign} of the blocks are another "
                                                                          "model's"), "get_wrong_model")
            missing = sum(1 for item in found if item is None)
            if missing:
                span.set_status(Status(StatusCode.ERROR, f"{missing} blocks missing"))
                return await self._answer(msg, KVStoreReply(ok=False, error=f"{missing} of the blocks are not here"),
                                          "get_missing")
            tiers = [tier for _, tier in found]
            span.set_attribute("splitserve.blocks_from_disk", tiers.count("disk"))
            await self._answer(msg, KVStoreReply(ok=True, num_hit=len(found), tiers=tiers), "get")
            parts = [(i, i + 1, block.tensor()[None]) for i, (block, _) in enumerate(found)]
            self._spawn(self._send(ticket, parts, span))
            sending = True  # the send ends the span
        finally:
            if not sending:
                span.end()

    async def _send(self, ticket: TransferTicket, parts, span) -> None:
        started = time.perf_counter()
        try:
            result = await self.sender.send(ticket, parts)
            span.set_attributes(result.span_attributes())
            if not result.ok:
                self.counts["get_failed"] = self.counts.get("get_failed", 0) + 1
                span.set_status(Status(StatusCode.ERROR, result.error or "transfer failed"))
                log.info("kv-store send failed", error=result.error, seconds=round(time.perf_counter() - started, 3))
        finally:
            span.end()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def put_bytes(request: KVStorePut) -> int:
    """The bytes a put declares: its blocks', as they would be held here."""
    return len(request.hashes) * math.prod(request.block_shape) * DTYPES[request.dtype].itemsize
