"""A worker's use of the kv-store: load a prompt's cached prefix before it runs, write its full blocks back after.

As a request is added, its prompt's full blocks are looked up (each on the
kv-store instance `placement` gives it). The tier is the engine's connector:
when the engine admits the request and the store holds a longer prefix than
the engine's own prefix cache, the blocks beyond it are fetched over the side
channel into the request's blocks, and it runs from there with them as computed
(`cached_tokens`). Once a prompt's KV is complete, its full blocks that the
store does not have yet are copied out and put there, in the background.

A kv-store that is slow, full or down never fails a request: the worker
computes instead and the miss is counted.
"""

import asyncio
import threading
import time
from collections import Counter, OrderedDict

import torch
from opentelemetry import trace

from contracts import Sender
from services.common.load_reports import LoadReports
from services.common.service_settings import KVStoreTierSettings
from services.kvstore.client import KVStoreClient
from services.kvstore.placement import group_by_instance
from shared.bus.registry import Registry
from shared.engine import BlockExport, KVConnector, LoadEnd
from shared.telemetry.logging import get_logger
from shared.telemetry.tracing import tracer

log = get_logger(__name__)

_INSTANCES_TTL_S = 1.0


class _Prefix:
    """A request's prefix in the store, from `expect` until the request ends (or its load does)."""

    def __init__(self, hashes: list[bytes], span):
        self.hashes = hashes
        self.span = span  # "kvstore.load_prefix": the lookup and the fetch
        self.held_blocks: int | None = None  # of `hashes`, from the first, the store holds (None: not known yet)
        self.lookup: asyncio.Task | None = None
        self.fetch: asyncio.Task | None = None

    def cancel(self) -> None:
        for task in (self.lookup, self.fetch):
            if task is not None:
                task.cancel()  # a fetch still reports its (failed) load
        _end(self.span, 0)


def _end(span, loaded_tokens: int) -> None:
    if span.is_recording():
        span.set_attribute("splitserve.loaded_tokens", loaded_tokens)
        span.end()


class KVStoreTier(KVConnector):
    name = "kvstore"

    def __init__(self, *, client: KVStoreClient, registry: Registry, engine, engine_loop, known_capacity: int = 1 << 16,
                 max_puts_in_flight: int = 32):
        self.client = client
        self.registry = registry
        self.engine = engine
        self.engine_loop = engine_loop
        self.block_size = engine.config.block_size
        self.known_capacity = known_capacity
        self._known: OrderedDict[bytes, None] = OrderedDict()  # hashes the store has (put or loaded by us)
        self._known_lock = threading.Lock()  # the engine thread writes back, the event loop loads
        self._instances: tuple[float, list[str]] = (0.0, [])
        self._loop = asyncio.get_running_loop()
        self._puts: set[asyncio.Task] = set()
        self.counts: Counter[str] = Counter()
        self.max_puts_in_flight = max_puts_in_flight
        self._puts_in_flight = 0  # counted from the engine thread (up) and the event loop (down), under _known_lock
        self._lock = threading.Lock()  # the prefixes, shared with the engine thread
        self._prefixes: dict[str, _Prefix] = {}  # request id -> its prefix, from `expect` to its end
        self._loaded = LoadReports(engine_loop.wake)
        engine.connect(self)

    @property
    def puts_in_flight(self) -> int:
        return self._puts_in_flight

    def details(self) -> dict:
        return {"counts": dict(self.counts), "misses": dict(self.client.misses), "puts_in_flight": self._puts_in_flight}

    async def instances(self) -> list[str]:
        fetched_at, instances = self._instances
        if time.monotonic() - fetched_at > _INSTANCES_TTL_S:
            try:
                entries = await self.registry.list()
                instances = sorted(e.instance_id for e in entries if e.role == "kvstore" and e.state == "ready")
            except Exception as exc:  # the registry is unreachable: keep the last answer
                log.warning("could not list kv-store instances", error=repr(exc))
            self._instances = (time.monotonic(), instances)
        return instances

    # ---- before a request runs: the engine's admission hooks -----------------------------------
    def expect(self, request_id: str, prompt: list[int], cache_salt: str = "") -> None:
        """The request is about to be added to the engine: look its prefix up in the store now (traced under the
        current span), so that the answer is there, or close, when the engine admits it."""
        hashes = self.engine.prefix_block_hashes(prompt, cache_salt)
        with self._lock:
            if not hashes or request_id in self._prefixes:
                return  # nothing to load (or a duplicate request id, which the engine refuses)
            span = tracer().start_span("kvstore.load_prefix", attributes={"splitserve.prompt_blocks": len(hashes)})
            prefix = _Prefix(hashes, span)
            self._prefixes[request_id] = prefix
        with trace.use_span(span):
            prefix.lookup = asyncio.create_task(self._look_up(prefix))

    async def _look_up(self, prefix: "_Prefix") -> None:
        held = 0
        try:
            instances = await self.instances()
            prefix.span.set_attribute("splitserve.kvstore_instances", len(instances))
            if not instances:
                self.counts["no_kvstore"] += 1
            else:
                held = await self._held_prefix(prefix.hashes, instances)
                if held < len(prefix.hashes):
                    self.counts["lookup_misses"] += 1  # the store lacks part of the prefix (never stored, or evicted)
                    self._forget(prefix.hashes[held:])  # so that the blocks are written back again once computed
        except Exception:
            log.exception("kv-store prefix lookup failed")
            self.counts["load_failed"] += 1
        finally:
            prefix.span.set_attribute("splitserve.kvstore_blocks", held)
            with self._lock:
                prefix.held_blocks = held
            self.engine_loop.wake()

    def external_prefix(self, request_id: str, token_ids: list[int], num_local_tokens: int) -> int | None:
        """(Engine thread.) What the store holds beyond the engine's own cached prefix; None while it is asked."""
        with self._lock:
            prefix = self._prefixes.get(request_id)
            if prefix is None:
                return 0
            if prefix.held_blocks is None:
                return None
            offer = prefix.held_blocks * self.block_size - num_local_tokens
        prefix.span.set_attribute("splitserve.local_blocks", num_local_tokens // self.block_size)
        if offer <= 0:
            _end(prefix.span, 0)  # the engine's own cache holds as much (and counts it)
        return max(0, offer)

    def start_load(self, request_id: str, block_ids: list[int], first_token: int, num_tokens: int) -> None:
        """(Engine thread.) Fetch the offered blocks into the request's blocks, on the event loop."""
        self._loop.call_soon_threadsafe(self._start_fetch, request_id, block_ids, first_token, num_tokens)

    def _start_fetch(self, request_id: str, block_ids: list[int], first_token: int, num_tokens: int) -> None:
        with self._lock:
            prefix = self._prefixes.get(request_id)
        if prefix is None:  # the request ended before its fetch began
            self._loaded.report(LoadEnd(request_id, False))
            return
        first = first_token // self.block_size
        hashes = prefix.hashes[first: first + num_tokens // self.block_size]
        with trace.use_span(prefix.span):
            prefix.fetch = asyncio.create_task(self._fetch_into(request_id, prefix, hashes, block_ids))

    async def _fetch_into(self, request_id: str, prefix: "_Prefix", hashes: list[bytes], block_ids: list[int]) -> None:
        ok = False
        try:
            instances = await self.instances()
            ok = bool(instances) and await self._fetch(hashes, instances, block_ids)
        except asyncio.CancelledError:
            pass  # the request ended: reported as failed below, which frees its blocks
        except Exception:
            log.exception("kv-store prefix fetch failed", request_id=request_id)
        finally:
            if ok:
                self._remember(prefix.hashes[: prefix.held_blocks])
                self.counts["loaded"] += 1
            else:
                self.counts["fetch_failed"] += 1
            _end(prefix.span, len(hashes) * self.block_size if ok else 0)
            self._loaded.report(LoadEnd(request_id, ok))  # after the last block was written (on this loop)

    def finished_loads(self) -> list[LoadEnd]:
        return self._loaded.take()

    def request_finished(self, request_id: str) -> None:
        """(Engine thread.) Stop looking up or fetching for a request that ended."""
        with self._lock:
            prefix = self._prefixes.pop(request_id, None)
        if prefix is not None:
            self._loop.call_soon_threadsafe(prefix.cancel)

    async def _held_prefix(self, hashes: list[bytes], instances: list[str]) -> int:
        """How many of `hashes`, from the first, the instances hold between them."""
        groups = group_by_instance(hashes, instances)
        counts = await asyncio.gather(*(self.client.lookup(instance, [hashes[i] for i in indices])
                                        for instance, indices in groups.items()))
        first_missing = len(hashes)
        for (instance, indices), count in zip(groups.items(), counts):
            if count < len(indices):
                first_missing = min(first_missing, indices[count])
        return first_missing

    async def _fetch(self, hashes: list[bytes], instances: list[str], block_ids: list[int]) -> bool:
        groups = group_by_instance(hashes, instances)
        engine = self.engine

        def writer(indices: list[int]):
            def on_blocks(first: int, end: int, blocks: torch.Tensor) -> None:  # on this loop, as blocks arrive
                engine.write_blocks([block_ids[indices[i]] for i in range(first, end)], blocks)
            return on_blocks

        results = await asyncio.gather(*(self.client.get(instance, [hashes[i] for i in indices], writer(indices))
                                         for instance, indices in groups.items()))
        return all(results)

    # ---- after a prompt is computed (engine thread) -------------------------------------------
    def blocks_computed(self, hashes: list[bytes], export: BlockExport) -> None:
        """Put the blocks the store does not have yet (in the background; skipped while too many puts are out)."""
        with self._known_lock:
            new = [i for i, block_hash in enumerate(hashes) if block_hash not in self._known]
            if not new:
                return
            if self._puts_in_flight >= self.max_puts_in_flight:  # the store is slow: do not pile up copies
                self.counts["puts_skipped_busy"] += 1
                return
            self._puts_in_flight += 1
        try:
            blocks = export(new)  # a copy: the engine may reuse the blocks as soon as we return
        except BaseException:
            with self._known_lock:
                self._puts_in_flight -= 1
            raise
        new_hashes = [hashes[i] for i in new]
        self._remember(new_hashes)
        self._loop.call_soon_threadsafe(self._start_put, new_hashes, blocks)

    def _start_put(self, hashes: list[bytes], blocks: torch.Tensor) -> None:
        task = asyncio.create_task(self._put(hashes, blocks))
        self._puts.add(task)
        task.add_done_callback(self._puts.discard)

    async def _put(self, hashes: list[bytes], blocks: torch.Tensor) -> None:
        try:
            instances = await self.instances()
            if not instances:
                self._forget(hashes)
                self.counts["put_skipped"] += 1
                return
            for instance, indices in group_by_instance(hashes, instances).items():
                chosen = [hashes[i] for i in indices]
                if await self.client.put(instance, chosen, blocks[indices]):
                    self.counts["blocks_put"] += len(indices)
                else:
                    self._forget(chosen)
        finally:
            with self._known_lock:
                self._puts_in_flight -= 1

    def _remember(self, hashes: list[bytes]) -> None:
        with self._known_lock:
            for block_hash in hashes:
                self._known[block_hash] = None
                self._known.move_to_end(block_hash)
            while len(self._known) > self.known_capacity:
                self._known.popitem(last=False)

    def _forget(self, hashes: list[bytes]) -> None:
        with self._known_lock:
            for block_hash in hashes:
                self._known.pop(block_hash, None)

    async def stop(self) -> None:
        with self._lock:
            prefixes = list(self._prefixes.values())
        for prefix in prefixes:
            prefix.cancel()
        tasks = [*self._puts, *(t for p in prefixes for t in (p.lookup, p.fetch) if t is not None)]
        for task in list(self._puts):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.client.close()


async def start_kv_store_tier(settings: KVStoreTierSettings, *, nc, subjects, registry: Registry, engine,
                               engine_loop, me: Sender) -> KVStoreTier:
    """The worker's use of the kv-store, from its settings (with `--kv-store`; the side channel's too); `me`: the
    worker, as it signs its requests."""
    from services.common.options import side_channel_address, transfer_tls_of
    from shared.transfer import KVReceiver, KVSender

    tls = transfer_tls_of(settings)
    receiver = KVReceiver(tls=tls)
    host, advertise = side_channel_address(settings, settings.kv_store_receiver_host, settings.kv_store_receiver_advertise)
    await receiver.start(host, 0, advertise_host=advertise)
    client = KVStoreClient(nc=nc, subjects=subjects, receiver=receiver, sender=KVSender(tls=tls),
                           model_fingerprint=engine.fingerprint, me=me, timeout_s=settings.kv_store_timeout)
    return KVStoreTier(client=client, registry=registry, engine=engine, engine_loop=engine_loop)
