"""How one engine's batch is shared between tenants: which waiting request takes a place next, and which running
one gives up its place to a waiting one.

A request claims a place as (tenant, priority): the gateway's, from its API key (`SamplingParams.tenant`,
`.priority`); requests without one are all the tenant "". The next admitted is the earliest waiting request of
the highest priority, then of the tenant holding the fewest places (running or loading); a tenant's own requests
keep their order. When the batch has no free place (`max_num_seqs`), a waiting claimant takes one from a running
request (which is preempted and recomputed later, as on a shortage of blocks): the newest of the lowest priority
below the claimant's; else, at its priority, the newest of the tenant holding the most places, if that tenant
holds at least two more than the claimant's (after the swap it holds no fewer: places never go back and forth).
When blocks run out (`shortage_victim`), the request preempted is the newest of the lowest priority and, at it,
of the tenant holding the most places: one tenant's long generations do not push another's out.
A waiting request that `goes_ahead` (of a higher priority than one running, or of a tenant holding at least two
places fewer than another) has its short prompt computed in a step of its own, before the running requests' next
tokens: its first token does not wait for a step that carries the whole batch's decodes.
With one tenant and one priority, this is first come first served and nothing is preempted for a place; on a
shortage the newest running request is preempted.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Claim:
    tenant: str
    priority: int = 0


def next_waiting(waiting: Sequence[Claim], held: Mapping[str, int]) -> int:
    """Index into `waiting` (in arrival order) of the request admitted next."""
    return min(range(len(waiting)), key=lambda i: (-waiting[i].priority, held.get(waiting[i].tenant, 0), i))


def victim(claimant: Claim, running: Sequence[Claim], held: Mapping[str, int]) -> int | None:
    """Index into `running` (oldest first) of the request that gives its place to `claimant`; None: it waits."""
    if not running:
        return None
    lowest = min(c.priority for c in running)
    if lowest < claimant.priority:
        return max(i for i, c in enumerate(running) if c.priority == lowest)
    peers = {c.tenant for c in running if c.priority == claimant.priority and c.tenant != claimant.tenant}
    if not peers:
        return None
    richest = max(sorted(peers), key=lambda t: held.get(t, 0))
    if held.get(richest, 0) < held.get(claimant.tenant, 0) + 2:
        return None
    return max(i for i, c in enumerate(running) if c.tenant == richest and c.priority == claimant.priority)


def goes_ahead(claimant: Claim, running: Sequence[Claim], held: Mapping[str, int]) -> bool:
    """Whether a waiting request's prompt is computed before the running requests' next tokens: it is of a higher
    priority than one of them, or its tenant holds at least two places fewer than another at its priority (the
    measure `victim` takes a place by)."""
    if not running:
        return False
    if claimant.priority > min(c.priority for c in running):
        return True
    mine = held.get(claimant.tenant, 0)
    return any(held.get(c.tenant, 0) >= mine + 2 for c in running
               if c.priority == claimant.priority and c.tenant != claimant.tenant)


def shortage_victim(running: Sequence[Claim], held: Mapping[str, int]) -> int:
    """Index into `running` (oldest first, not empty) of the request preempted when the KV blocks run out."""
    lowest = min(c.priority for c in running)
    at_lowest = [i for i, c in enumerate(running) if c.priority == lowest]
    most = max(held.get(running[i].tenant, 0) for i in at_lowest)
    return max(i for i in at_lowest if held.get(running[i].tenant, 0) == most)


def places_to_give(waiting: Sequence[Claim], running: Sequence[Claim], held: Mapping[str, int],
                   free_places: int) -> list[int]:
    """Indexes into `running` of the requests to preempt now, so that the waiting requests admitted next (in
    `next_waiting`'s order, `free_places` of them into free places) each find one."""
    held, waiting, left = dict(held), list(waiting), list(enumerate(running))
    given: list[int] = []
    while waiting:
        claimant = waiting.pop(next_waiting(waiting, held))
        if free_places > 0:
            free_places -= 1
        else:
            chosen = victim(claimant, [c for _, c in left], held)
            if chosen is None:
                break
            index, taken = left.pop(chosen)
            given.append(index)
            held[taken.tenant] -= 1
        held[claimant.tenant] = held.get(claimant.tenant, 0) + 1
    return given
