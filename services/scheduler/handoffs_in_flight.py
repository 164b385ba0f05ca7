"""Requests this scheduler has handed to workers that their registry entries do not show yet.

A worker's entry is a heartbeat old (a second, plus the scheduler's refresh), so requests routed within one
heartbeat would all see the same load and go to the same worker. Each request counts on the worker it is
offered to from the moment it is chosen (before the handoff, so routings in flight see each other) until
the worker's entry shows it: a worker counts the requests it takes (`handoffs_taken` in its entry's
details, and in its reply to each handoff), so an entry whose count has reached the one its reply carried
holds the request in its figures (or it has finished); the entry may show it before the reply comes (the
worker's load report overtook it), and the reply then ends the count. A refused or failed handoff stops
counting at once.

Bounded: a request counts `max_age_ms` at most (also the only end for a worker that does not count), its
worker leaving or restarting ends it, and at most `max_requests` are held (the oldest go first).
"""

from collections import OrderedDict
from dataclasses import dataclass

from msgspec.structs import replace

from contracts import ServiceInfo
from services.scheduler.worker_choice import num_seqs


@dataclass(slots=True)
class _Routed:
    instance_id: str
    boot_id: str  # the worker process offered it: another one (a restart) never had it
    num_blocks: int
    chosen_ms: int
    handoffs_taken: int = 0  # from the worker's acceptance; 0 while the handoff is in flight


def _shows(entry: ServiceInfo, routed: _Routed) -> bool:
    """Whether `entry`'s figures hold the request (or its end): made by its worker's process after taking it."""
    return entry.boot_id == routed.boot_id and 0 < routed.handoffs_taken <= entry.handoffs_taken


@dataclass(slots=True)
class _Counted:
    num_requests: int = 0
    num_blocks: int = 0


class RoutedTally:
    def __init__(self, max_age_ms: int = 10_000, max_requests: int = 10_000):
        self.max_age_ms = max_age_ms
        self.max_requests = max_requests
        self._routed: OrderedDict[str, _Routed] = OrderedDict()  # request id -> where it went, oldest first
        self._by_worker: dict[str, _Counted] = {}

    def __len__(self) -> int:
        return len(self._routed)

    def offered(self, request_id: str, worker: ServiceInfo, num_blocks: int, now_ms: int) -> None:
        """`request_id` is being offered to `worker`, where it will take `num_blocks` KV blocks."""
        self.discard(request_id)
        self._routed[request_id] = _Routed(worker.instance_id, worker.boot_id, num_blocks, now_ms)
        counted = self._by_worker.setdefault(worker.instance_id, _Counted())
        counted.num_requests += 1
        counted.num_blocks += num_blocks
        while len(self._routed) > self.max_requests:
            self.discard(next(iter(self._routed)))

    def accepted(self, request_id: str, handoffs_taken: int, entries: list[ServiceInfo]) -> None:
        """The worker took it, as its `handoffs_taken`-th request: an entry with that count shows it. Its entry
        among `entries` (the view now) may already: the worker's load report can overtake its reply."""
        routed = self._routed.get(request_id)
        if routed is None:
            return
        routed.handoffs_taken = handoffs_taken
        entry = next((e for e in entries if e.instance_id == routed.instance_id), None)
        if entry is not None and _shows(entry, routed):
            self.discard(request_id)

    def discard(self, request_id: str) -> None:
        """It is not (or no longer) counted here: refused, failed, or shown by its worker's entry."""
        routed = self._routed.pop(request_id, None)
        if routed is None:
            return
        counted = self._by_worker[routed.instance_id]
        counted.num_requests -= 1
        counted.num_blocks -= routed.num_blocks
        if not counted.num_requests:
            del self._by_worker[routed.instance_id]

    def settle(self, entries: list[ServiceInfo], now_ms: int) -> None:
        """Given fresh registry entries: stop counting what they show, what went to a worker that has left
        or restarted, and anything older than `max_age_ms`."""
        by_id = {entry.instance_id: entry for entry in entries}
        for request_id, routed in list(self._routed.items()):
            entry = by_id.get(routed.instance_id)
            if (entry is None or entry.boot_id != routed.boot_id or now_ms - routed.chosen_ms > self.max_age_ms
                    or _shows(entry, routed)):
                self.discard(request_id)

    def apply(self, workers: list[ServiceInfo]) -> list[ServiceInfo]:
        """The workers' entries with what is counted here added: as waiting requests that hold their blocks."""
        return [self._with_counted(worker, self._by_worker.get(worker.instance_id)) for worker in workers]

    @staticmethod
    def _with_counted(worker: ServiceInfo, counted: _Counted | None) -> ServiceInfo:
        if counted is None:
            return worker
        return replace(worker, num_waiting=num_seqs(worker) - worker.num_running + counted.num_requests,
                       kv_blocks_free=worker.kv_blocks_free - counted.num_blocks)

    def counts(self) -> dict[str, int]:
        """Per worker, how many requests are counted here (for the scheduler's stats)."""
        return {instance_id: counted.num_requests for instance_id, counted in self._by_worker.items()}
