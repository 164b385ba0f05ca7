"""Which worker gets a request: pure functions over registry entries."""

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from msgspec.structs import replace

from contracts import ServiceInfo, WorkerLoad
from services.scheduler.prefix_index import KVSTORE
from shared.engine import cacheable_block_hashes


def eligible_workers(entries: list[ServiceInfo], role: str, served_model_name: str) -> list[ServiceInfo]:
    return [e for e in entries if e.role == role and e.state == "ready" and e.served_model_name == served_model_name]


def with_load(entry: ServiceInfo, load: WorkerLoad | None) -> ServiceInfo:
    """`entry` with the figures of `load`, a report from the same process made after the entry's heartbeat: one
    counting more handoffs taken (a count that only grows), or as many and sent later. The count decides first
    because both are stamped in milliseconds: a handoff taken between a heartbeat and a report made within the
    same one would otherwise leave the heartbeat's figures standing, without that request."""
    if load is None or load.boot_id != entry.boot_id:
        return entry
    if (load.handoffs_taken, load.sent_ms) <= (entry.handoffs_taken, entry.heartbeat_ms):
        return entry
    return replace(entry, num_running=load.num_running, num_waiting=load.num_waiting,
                   kv_blocks_free=load.kv_blocks_free, active_requests=load.active_requests,
                   handoffs_taken=load.handoffs_taken)


def num_seqs(worker: ServiceInfo) -> int:
    """The requests a worker holds: running and waiting in its engine, or (a decode worker's `active_requests`)
    every one it has taken and not finished, including those still loading or waiting for their prefill."""
    return max(worker.num_running + worker.num_waiting, worker.active_requests)


def describe_load(worker: ServiceInfo, cached_blocks: int | None = None) -> str:
    """What the scheduler saw of `worker` when it ranked it (its route span lists them, best first)."""
    described = (f"{worker.instance_id}: {num_seqs(worker)}/{worker.max_num_seqs} seqs, "
                 f"{worker.kv_blocks_total - worker.kv_blocks_free}/{worker.kv_blocks_total} blocks")
    return described if cached_blocks is None else f"{described}, {cached_blocks} cached"


def load_score(worker: ServiceInfo) -> tuple[float, float]:
    """Lower is better: share of sequence slots in use, then share of KV blocks in use."""
    slots = max(worker.max_num_seqs, 1)
    blocks = max(worker.kv_blocks_total, 1)
    return (num_seqs(worker) / slots, 1 - worker.kv_blocks_free / blocks)


def rank_by_load(workers: list[ServiceInfo]) -> list[ServiceInfo]:
    """Least loaded first; ties broken by instance id so the order is deterministic."""
    return sorted(workers, key=lambda w: (load_score(w), w.instance_id))


@dataclass
class CachedPrefixes:
    """Per worker: how many of a prompt's blocks its cache (or the kv-store it uses) holds."""

    prompt_blocks: int = 0
    blocks: dict[str, int] = field(default_factory=dict)
    block_size: dict[str, int] = field(default_factory=dict)

    def tokens(self, worker: ServiceInfo) -> int:
        return self.blocks.get(worker.instance_id, 0) * self.block_size.get(worker.instance_id, 0)


def cached_prefixes(workers: list[ServiceInfo], prompt: list[int],
                    overlaps_of: Callable[[list[bytes]], dict[str, int]], cache_salt: str = "") -> CachedPrefixes:
    """How much of `prompt` each worker can start from, given `overlaps_of(hashes)` (the prefix index).

    The prompt is hashed (with its request's cache salt) once per block size and model fingerprint the workers
    report; a worker that reports none is taken to hold nothing."""
    cached = CachedPrefixes()
    by_hashing: dict[tuple[int, bytes], list[ServiceInfo]] = {}
    for worker in workers:
        if worker.kv_block_size and worker.kv_fingerprint:
            by_hashing.setdefault((worker.kv_block_size, worker.kv_fingerprint), []).append(worker)
    for (block_size, fingerprint), group in by_hashing.items():
        overlaps = overlaps_of(cacheable_block_hashes(prompt, block_size, fingerprint, cache_salt))
        cached.prompt_blocks = max(cached.prompt_blocks, -(-len(prompt) // block_size))
        for worker in group:
            cached.blocks[worker.instance_id] = cached_blocks(worker, overlaps, overlaps.get(KVSTORE, 0))
            cached.block_size[worker.instance_id] = block_size
    return cached


def cached_blocks(worker: ServiceInfo, overlaps: dict[str, int], kvstore_blocks: int) -> int:
    """How many of a prompt's blocks `worker` can start from: its own cache's, or the kv-store's if it uses one."""
    own = overlaps.get(worker.instance_id, 0)
    return max(own, kvstore_blocks) if worker.uses_kv_store else own


def kv_cost(worker: ServiceInfo, num_prompt_blocks: int, num_cached_blocks: int, overlap_weight: float) -> float:
    """Lower is better: the prompt blocks it would compute (weighted), plus the KV blocks it has in use other
    than the prompt's cached prefix, plus this prompt's blocks for each request beyond its batch's sequence
    slots (those wait, holding no blocks).

    All are in blocks, so a cached prefix draws a request to a worker until that worker's extra load
    outweighs the prefill it saves. Computing a block costs more than holding one for a while, so the default
    weight, 2, leans to the cache; < 1 leans to the balance. The cached prefix is not load: the request shares
    those blocks, and the figures that show them in use (a heartbeat old, or counted since the routing of the
    request that made them) are mostly that conversation's previous turn, often finished since.
    """
    uncached = max(num_prompt_blocks - num_cached_blocks, 0)
    in_use = max(worker.kv_blocks_total - worker.kv_blocks_free - num_cached_blocks, 0)
    slots = worker.max_num_seqs
    queued = max(0, num_seqs(worker) - slots) if slots else worker.num_waiting
    return overlap_weight * uncached + in_use + queued * num_prompt_blocks


def rank_by_kv(workers: list[ServiceInfo], num_prompt_blocks: int, cached: dict[str, int],
               overlap_weight: float = 2.0) -> list[ServiceInfo]:
    """Cheapest first by `kv_cost`; ties go to the less loaded, then by instance id.

    When every worker holds as much of the prompt as the others (usually none), the cache decides nothing
    and the request goes by `rank_by_load`: sequences first, as KV blocks alone miss the requests that hold
    none yet (waiting, loading a prefix, being prefilled elsewhere).
    """
    if len({cached.get(w.instance_id, 0) for w in workers}) <= 1:
        return rank_by_load(workers)
    return sorted(workers, key=lambda w: (kv_cost(w, num_prompt_blocks, cached.get(w.instance_id, 0), overlap_weight),
                                          load_score(w), w.instance_id))


def blocks_to_take(worker: ServiceInfo, num_prompt_tokens: int, num_cached_blocks: int = 0) -> int:
    """The KV blocks a prompt will take on `worker`: its blocks, less the cached prefix it starts from."""
    block_size = worker.kv_block_size or 1
    return max(-(-num_prompt_tokens // block_size) - num_cached_blocks, 0)


def pick_prefill_worker(workers: list[ServiceInfo], num_prompt_blocks: int, cached: dict[str, int],
                        overlap_weight: float = 2.0) -> str:
    """The prefill worker to offer a job to directly, or "" to leave it to the pool's shared queue.

    Only a worker whose own cache holds more of the prompt than the others can start from is worth
    aiming at; otherwise whichever worker has room first takes it (the queue balances the load).
    """
    if not workers:
        return ""
    ranked = rank_by_kv(workers, num_prompt_blocks, cached, overlap_weight)
    best = cached.get(ranked[0].instance_id, 0)
    if best == 0 or all(cached.get(w.instance_id, 0) == best for w in ranked[1:]):
        return ""
    return ranked[0].instance_id


# Below this many uncached tokens a prompt is always computed where it decodes: shipping its KV costs more
# than the stall it would cause.
MIN_OFFLOADED_PREFILL = 32


def prefill_backlog(routed_tokens: Sequence[int], queue_depth: int) -> int:
    """The prompt tokens the prefill pool has yet to compute, as far as this scheduler knows.

    `routed_tokens`: the uncached tokens of the jobs this scheduler sent to the pool's queue, oldest first;
    `queue_depth`: the jobs in the queue, waiting or running. The queue is first in, first out, so the jobs
    still in it are the newest `queue_depth` sent (jobs other schedulers sent are not known, and not counted).
    """
    if queue_depth <= 0:
        return 0
    return sum(itertools.islice(reversed(routed_tokens), queue_depth))


def decide_prefill(uncached_prompt_tokens: int, prefill_queue_depth: int, *, max_local_prefill: int,
                   max_prefill_queue: int, prefill_workers_ready: int, decode_worker_busy: bool = False,
                   offload_short: bool = True, prefill_backlog_tokens: int = 0,
                   backlog_factor: float = 0.0) -> str:
    """"remote" or "local": where a request's prompt is computed.

    Never remote without a prefill pool, or when its queue (waiting and
    running jobs) is `max_prefill_queue` deep: then waiting in it is worse
    than prefilling on the decode worker. Otherwise remote when the part of
    the prompt not already cached is longer than `max_local_prefill` tokens
    (0: every prompt); and, with `offload_short`, a shorter prompt too when
    its decode worker is busy streaming (computing the prompt there stalls
    every stream for that step) while a prefill worker sits idle.

    With `backlog_factor` > 0 (and `max_local_prefill` > 0), a long prompt
    stays local when each prefill worker has more than `backlog_factor` times
    the prompt's own tokens queued ahead of it (`prefill_backlog_tokens`):
    it would wait longer for the pool than the pool takes to compute it,
    while its decode worker computes it at once, in chunks beside its
    streams (whose tokens ride along those chunks' weight reads).
    """
    if prefill_workers_ready == 0 or prefill_queue_depth >= max_prefill_queue:
        return "local"
    if uncached_prompt_tokens > max_local_prefill:
        backlog_per_worker = prefill_backlog_tokens / prefill_workers_ready
        if max_local_prefill > 0 and backlog_factor > 0 and backlog_per_worker > backlog_factor * uncached_prompt_tokens:
            return "local"
        return "remote"
    pool_idle = prefill_queue_depth < prefill_workers_ready
    if offload_short and decode_worker_busy and pool_idle and uncached_prompt_tokens >= MIN_OFFLOADED_PREFILL:
        return "remote"
    return "local"
