"""Which waiting request the gateway sends on next: per-tenant queues, by priority, then fair shares of tokens.

Start-time fair queuing: a request of `cost` tokens (its prompt and the most it may generate) is tagged on
arrival with a virtual start, the later of the queue's virtual time and its tenant's previous request's virtual
finish, and a finish `cost` after it. The next request sent is the head, among the tenants of the highest
priority waiting, with the earliest start (ties: the earlier arrival); sending it moves the virtual time to its
start. A tenant sending many requests pushes only its own tags ahead; a quiet one's next request starts at the
virtual time, ahead of the noisy one's backlog. An idle tenant banks no credit: its next start is at least now's.
The policy is the pure functions; `FairQueue` holds the queues.
"""

from collections import deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, order=True)
class Tag:
    """A queued request's place: compared by (-priority, start, seq), the least goes first."""
    rank: int  # -priority
    start: float
    seq: int


def tag(vtime: float, tenant_finish: float, cost: float) -> tuple[float, float]:
    """A new request's (virtual start, virtual finish)."""
    start = max(vtime, tenant_finish)
    return start, start + max(cost, 1.0)


def first(heads: Mapping[Hashable, Tag]) -> Hashable | None:
    """The tenant whose head request goes next (None: nothing waits)."""
    return min(heads, key=heads.__getitem__, default=None)


class FairQueue:
    """Per-tenant FIFO queues of items, taken by `first`; bounded by the caller (see `Admission`)."""

    def __init__(self):
        self._queues: dict[Hashable, deque[tuple[Tag, object]]] = {}
        self._finish: dict[Hashable, float] = {}  # each tenant's latest virtual finish
        self.vtime = 0.0
        self._seq = 0

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def queued(self, tenant: Hashable) -> int:
        return len(self._queues.get(tenant, ()))

    def push(self, tenant: Hashable, item: object, cost: float, priority: int = 0) -> None:
        start, finish = tag(self.vtime, self._finish.get(tenant, 0.0), cost)
        self._finish[tenant] = finish
        self._seq += 1
        self._queues.setdefault(tenant, deque()).append((Tag(-priority, start, self._seq), item))

    def tenants(self) -> set[Hashable]:
        """The tenants with a request waiting."""
        return set(self._queues)

    def pop(self, eligible: Callable[[Hashable], bool] = lambda tenant: True) -> tuple[Hashable, object] | None:
        """The next request of the tenants `eligible` says may go (None: none of them waits)."""
        tenant = first({t: q[0][0] for t, q in self._queues.items() if eligible(t)})
        if tenant is None:
            return None
        queue = self._queues[tenant]
        head, item = queue.popleft()
        if not queue:
            del self._queues[tenant]
        self.vtime = max(self.vtime, head.start)
        self._forget_idle()
        return tenant, item

    def remove(self, tenant: Hashable, item: object) -> bool:
        """Take out a request that stopped waiting (its client left, its deadline passed)."""
        queue = self._queues.get(tenant)
        for entry in queue or ():
            if entry[1] is item:
                queue.remove(entry)
                if not queue:
                    del self._queues[tenant]
                return True
        return False

    def _forget_idle(self) -> None:
        """Finishes at or behind the virtual time say nothing more than the virtual time: dropped (bounded)."""
        for tenant in [t for t, f in self._finish.items() if f <= self.vtime and t not in self._queues]:
            del self._finish[tenant]
