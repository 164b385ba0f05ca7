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
