"""A worker's use of the kv-store: load a prompt's cached prefix before it runs, write its full blocks back after.

Before a request runs, its prompt's full blocks are looked up (each on the
kv-store instance `placement` gives it); when the store holds a longer prefix
than the worker's own prefix cache, those blocks are fetched over the side
channel into reserved blocks and the request starts with them as computed
(`cached_tokens`). Once a prompt's KV is complete, its full blocks that the
store does not have yet are copied out and put there, in the background.

A kv-store that is slow, full or down never fails a request: the worker
computes instead and the miss is counted.
"""

import argparse
import asyncio
import threading
import time
from collections import Counter, OrderedDict

import torch
from opentelemetry import trace

from services.kvstore.client import KVStoreClient
from services.kvstore.placement import group_by_instance
from shared.bus.registry import Registry
from shared.engine.continuation import Continuation, KVOrigin, ReservedKV
from shared.engine.kv_connector import BlockExport, KVConnector
from shared.telemetry.logging import get_logger
from shared.telemetry.tracing import tracer

log = get_logger(__name__)

_INSTANCES_TTL_S = 1.0


class KVStoreTier(KVConnector):
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

    # ---- before a request runs ------------------------------------------------------------------
    async def load_prefix(self, prompt: list[int]) -> Continuation | None:
        """The start of the request from its cached prefix in the store, or None (also when anything fails: the
        store is a cache, without it the prompt is computed in full)."""
        with tracer().start_as_current_span("kvstore.load_prefix") as span:
            try:
                loaded = await self._load_prefix(prompt)
            except Exception:
                log.exception("kv-store prefix load failed")
                self.counts["load_failed"] += 1
                loaded = None
            span.set_attribute("splitserve.loaded_tokens", loaded.num_cached_tokens if loaded else 0)
            return loaded

    async def _load_prefix(self, prompt: list[int]) -> Continuation | None:
        hashes = self.engine.prefix_block_hashes(prompt)
        if not hashes:
            return None
        local = await self.engine_loop.call(lambda engine: engine.local_prefix_blocks(hashes))
        instances = await self.instances()
        span = trace.get_current_span()
        span.set_attributes({"splitserve.prompt_blocks": len(hashes), "splitserve.local_blocks": local,
                             "splitserve.kvstore_instances": len(instances)})
        if not instances:
            self.counts["no_kvstore"] += 1
            return None
        held = await self._held_prefix(hashes, instances)
        span.set_attribute("splitserve.kvstore_blocks", held)
        if held < len(hashes):
            self.counts["lookup_misses"] += 1  # the store lacks part of the prefix (never stored, or evicted)
            self._forget(hashes[held:])  # so that the blocks are written back again once computed
        if held <= local:
            return None  # the engine finds its own cached prefix (and counts the lookup) when it schedules it
        reserving = self.engine_loop.call(lambda engine: engine.reserve_blocks(held * self.block_size))
        try:
            block_ids = await asyncio.shield(reserving)  # if cancelled meanwhile, the blocks still come: give back
        except asyncio.CancelledError:
            reserving.add_done_callback(self._release_reserved)
            raise
        except Exception:
            self.counts["no_blocks"] += 1
            return None
        try:
            fetched = await self._fetch(hashes[:held], instances, block_ids)
        except BaseException:
            self.engine_loop.call(lambda engine: engine.release_blocks(block_ids))
            raise
        if not fetched:
            self.engine_loop.call(lambda engine: engine.release_blocks(block_ids))
            self.counts["fetch_failed"] += 1
            return None
        self._remember(hashes[:held])
        self.counts["loaded"] += 1
        return Continuation(reserved=ReservedKV(block_ids, held * self.block_size),
                            num_cached_tokens=held * self.block_size, kv_origin=KVOrigin.KV_STORE)

    def _release_reserved(self, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            block_ids = future.result()
            self.engine_loop.call(lambda engine: engine.release_blocks(block_ids))

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
        for task in list(self._puts):
            task.cancel()
        await asyncio.gather(*self._puts, return_exceptions=True)
        await self.client.close()


async def start_kv_store_tier(args: argparse.Namespace, *, nc, subjects, registry: Registry, engine,
                               engine_loop) -> KVStoreTier:
    """The worker's use of the kv-store, from `add_kv_store_options`' arguments (with `--kv-store`)."""
    from services.common.options import transfer_tls_of
    from shared.transfer import KVReceiver, KVSender

    tls = transfer_tls_of(args)
    receiver = KVReceiver(tls=tls)
    await receiver.start(args.kv_store_receiver_host, 0, advertise_host=args.kv_store_receiver_advertise)
    client = KVStoreClient(nc=nc, subjects=subjects, receiver=receiver, sender=KVSender(tls=tls),
                           model_fingerprint=engine.fingerprint, timeout_s=args.kv_store_timeout)
    return KVStoreTier(client=client, registry=registry, engine=engine, engine_loop=engine_loop)
