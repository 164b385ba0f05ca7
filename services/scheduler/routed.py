"""Requests this scheduler has handed to workers that their registry entries may not show yet.

A worker's entry is a heartbeat old (a second, plus the scheduler's refresh), so requests routed within one
heartbeat would all see the same load and go to the same worker. Each request counts on the worker it was
offered to from the moment it is chosen (before the handoff, so routings in flight see each other) until
the worker's first heartbeat made after it accepted: that entry shows the request itself (or that it has
finished). A refused or failed handoff stops counting at once.

Heartbeats are stamped with the worker's wall clock and acceptances with the scheduler's, as deadlines
already assume; a heartbeat in the same millisecond counts as after, since counting a request for a moment
too little only loosens the balance, while counting it twice as well as the heartbeat pushes work away.
Bounded: a request counts `max_age_ms` at most, its worker leaving ends it, and at most `max_requests`
are held (the oldest go first).
"""

from collections import OrderedDict
from dataclasses import dataclass, replace

from contracts import ServiceInfo
from services.scheduler.routing import num_seqs


@dataclass(slots=True)
class _Routed:
    instance_id: str
    num_blocks: int
    chosen_ms: int
    accepted_ms: int = 0  # when the worker's acceptance came back; 0 while the handoff is in flight


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

    def offered(self, request_id: str, instance_id: str, num_blocks: int, now_ms: int) -> None:
        """`request_id` is being offered to `instance_id`, where it will take `num_blocks` KV blocks."""
        self.discard(request_id)
        self._routed[request_id] = _Routed(instance_id, num_blocks, now_ms)
        counted = self._by_worker.setdefault(instance_id, _Counted())
        counted.num_requests += 1
        counted.num_blocks += num_blocks
        while len(self._routed) > self.max_requests:
            self.discard(next(iter(self._routed)))

    def accepted(self, request_id: str, now_ms: int) -> None:
        """The worker took it: its next heartbeat will show it."""
        routed = self._routed.get(request_id)
        if routed is not None:
            routed.accepted_ms = now_ms

    def discard(self, request_id: str) -> None:
        """It is not (or no longer) counted: refused, failed, or shown by its worker's entry."""
        routed = self._routed.pop(request_id, None)
        if routed is None:
            return
        counted = self._by_worker[routed.instance_id]
        counted.num_requests -= 1
        counted.num_blocks -= routed.num_blocks
        if not counted.num_requests:
            del self._by_worker[routed.instance_id]

    def settle(self, entries: list[ServiceInfo], now_ms: int) -> None:
        """Given fresh registry entries: stop counting what they show, what went to a worker that left,
        and anything older than `max_age_ms`."""
        heartbeats = {entry.instance_id: entry.heartbeat_ms for entry in entries}
        for request_id, routed in list(self._routed.items()):
            heartbeat_ms = heartbeats.get(routed.instance_id)
            shown = routed.accepted_ms and heartbeat_ms is not None and heartbeat_ms >= routed.accepted_ms
            if shown or heartbeat_ms is None or now_ms - routed.chosen_ms > self.max_age_ms:
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
