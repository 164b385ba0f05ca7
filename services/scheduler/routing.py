"""Which worker gets a request: pure functions over registry entries."""

from contracts import ServiceInfo


def eligible_workers(entries: list[ServiceInfo], role: str, served_model_name: str) -> list[ServiceInfo]:
    return [e for e in entries if e.role == role and e.state == "ready" and e.served_model_name == served_model_name]


def load_score(worker: ServiceInfo) -> tuple[float, float]:
    """Lower is better: share of sequence slots in use, then share of KV blocks in use."""
    slots = max(worker.max_num_seqs, 1)
    blocks = max(worker.kv_blocks_total, 1)
    return ((worker.num_running + worker.num_waiting) / slots, 1 - worker.kv_blocks_free / blocks)


def rank_by_load(workers: list[ServiceInfo]) -> list[ServiceInfo]:
    """Least loaded first; ties broken by instance id so the order is deterministic."""
    return sorted(workers, key=lambda w: (load_score(w), w.instance_id))


def cached_blocks(worker: ServiceInfo, overlaps: dict[str, int], kvstore_blocks: int) -> int:
    """How many of a prompt's blocks `worker` can start from: its own cache's, or the kv-store's if it uses one."""
    own = overlaps.get(worker.instance_id, 0)
    return max(own, kvstore_blocks) if worker.details.get("uses_kv_store") else own


def kv_cost(worker: ServiceInfo, num_prompt_blocks: int, num_cached_blocks: int, overlap_weight: float) -> float:
    """Lower is better: the prompt blocks it would compute (weighted) plus the KV blocks it already has in use.

    Both are in blocks, so a cached prefix draws a request to a worker until that worker's extra load
    outweighs the prefill it saves. Computing a block costs more than holding one for a while (and the load
    figures are a heartbeat old), so the default weight, 2, leans to the cache; < 1 leans to the balance.
    """
    uncached = max(num_prompt_blocks - num_cached_blocks, 0)
    in_use = worker.kv_blocks_total - worker.kv_blocks_free
    return overlap_weight * uncached + in_use


def rank_by_kv(workers: list[ServiceInfo], num_prompt_blocks: int, cached: dict[str, int],
               overlap_weight: float = 2.0) -> list[ServiceInfo]:
    """Cheapest first by `kv_cost`; ties go to the less loaded, then by instance id."""
    return sorted(workers, key=lambda w: (kv_cost(w, num_prompt_blocks, cached.get(w.instance_id, 0), overlap_weight),
                                          load_score(w), w.instance_id))


def decide_prefill(uncached_prompt_tokens: int, prefill_queue_depth: int, *, max_local_prefill: int,
                   max_prefill_queue: int, prefill_workers_ready: int) -> str:
    """"remote" or "local": where a request's prompt is computed.

    Remote only when there is a prefill pool, the part of the prompt not
    already cached is longer than `max_local_prefill` tokens (0: every
    prompt), and the prefill queue is short enough that waiting in it beats
    prefilling on the decode worker.
    """
    if prefill_workers_ready == 0:
        return "local"
    if uncached_prompt_tokens <= max_local_prefill:
        return "local"
    if prefill_queue_depth >= max_prefill_queue:
        return "local"
    return "remote"
