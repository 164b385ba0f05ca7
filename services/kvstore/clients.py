"""Who may use a kv-store: the model workers of the model a request names, as the registry vouches.

A lookup, put or get arrives on a subject that names its sender (`contracts.sent_by`, enforced by the sender's
NATS permissions). It is taken only when the registry holds a model worker's entry under that name (written by
that instance alone) whose model fingerprint is the one the request names: a gateway, a scheduler or another
model's worker cannot read or plant blocks. The registry is read at most every `REFRESH_S` (and on a miss, at
most every `MISS_REFRESH_S`), not per request.
"""

import time
from collections.abc import Awaitable, Callable

from contracts import Sender, ServiceInfo

WORKER_ROLES = ("decode", "prefill")  # a pipeline's head registers as its pool's worker under its own name
REFRESH_S = 1.0
MISS_REFRESH_S = 0.25


def refusal(workers: dict[str, bytes], sender: Sender, fingerprint: bytes) -> str | None:
    """Why `sender` may not use the store for the model `fingerprint` (None: it may); `workers`: each model
    worker's instance id and its registered model."""
    registered = workers.get(sender.instance_id)
    if registered is None:
        return f"{sender.instance_id} is not a registered model worker"
    if not fingerprint or registered != fingerprint:
        return f"{sender.instance_id} is registered with another model than the request names"
    return None


def model_workers(entries: list[ServiceInfo]) -> dict[str, bytes]:
    return {e.instance_id: e.kv_fingerprint for e in entries if e.role in WORKER_ROLES and e.kv_fingerprint}


class ModelWorkers:
    def __init__(self, list_entries: Callable[[], Awaitable[list[ServiceInfo]]]):
        self._list_entries = list_entries
        self._workers: dict[str, bytes] = {}
        self._read_at = float("-inf")

    async def refusal(self, sender: Sender, fingerprint: bytes) -> str | None:
        now = time.monotonic()
        if now - self._read_at > REFRESH_S:
            await self._read(now)
        reason = refusal(self._workers, sender, fingerprint)
        if reason is not None and now - self._read_at > MISS_REFRESH_S:  # it may have registered just now
            await self._read(now)
            reason = refusal(self._workers, sender, fingerprint)
        return reason

    async def _read(self, now: float) -> None:
        self._read_at = now
        try:
            self._workers = model_workers(await self._list_entries())
        except Exception:  # NATS failing over: judge by the last reading
            pass
