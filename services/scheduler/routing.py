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
