"""Admission at the gateway: each tenant's limits, then its turn in the fair queue.

`enter` lets a request in or refuses it with 429 (past its tenant's `max_in_flight`, or its tokens-per-minute
bucket short of its prompt), Retry-After saying when to come back; nothing of another tenant's changes.
`wait_turn` then holds it until fewer than `max_dispatched` requests sent on to its model have no first token
yet, or its tenant has fewer than its share of those (`max_dispatched` over the tenants sending to the model,
rounded up): what waits without a first token waits in the workers' queues, so keeping it few leaves the order
to the fair queue here (`fair_queue`), and each tenant's share keeps one tenant's backlog there from holding
another's requests here (the workers share their batches between tenants: `shared.engine.batch_share`). So at
most `max_dispatched` plus a share for each further tenant are out at once. A turn waits at most `timeout_s`
(then 429), and at most `max_queued` of each tenant wait for one model (one tenant's flood takes no other's room).
The `Ticket` frees the turn at the first token and the rest when the request ends, charging its usage.
A tenant's limits (in flight, tokens per minute) are its own across every model the gateway serves; the turns
and their queues are each model's, as its workers are: a flood of one model's requests holds no turn of
another's.
"""

import asyncio
import math
import time
from collections import Counter

from services.gateway import token_bucket
from services.gateway.errors import RequestError, retry_after_header
from services.gateway.fair_queue import FairQueue
from services.gateway.streams import StreamError
from services.gateway.tenant_metrics import TenantMetrics
from services.common.tenant_keys import Tenant

_UNBOUNDED_QUEUE = 10_000  # with --max-waiting-requests 0, still a bound


def limit_error(tenant: Tenant, limit: str, retry_after_s: float) -> RequestError:
    """The 429 of a request past one of its tenant's limits, OpenAI-shaped, naming the limit."""
    value = tenant.max_in_flight if limit == "max_in_flight" else tenant.tokens_per_minute
    what = "requests in flight" if limit == "max_in_flight" else "tokens per minute"
    return RequestError(f"Rate limit reached for tenant {tenant.name!r} on {what} ({limit}): limit {value}. "
                        f"Try again in {retry_after_s:.2f}s.", status=429, code="rate_limit_exceeded",
                        type="requests" if limit == "max_in_flight" else "tokens",
                        headers=retry_after_header(retry_after_s))


class Ticket:
    """One admitted request's hold on its tenant's in-flight count and, once given, a turn."""

    def __init__(self, admission: "Admission", tenant: Tenant, cost: int, model: str = ""):
        self.admission, self.tenant, self.cost, self.model = admission, tenant, cost, model
        self.holds_turn = False
        self.turn: asyncio.Future | None = None
        self.done = False

    def first_token(self) -> None:
        self.admission.release_turn(self)

    def finish(self, status: str, usage: tuple[int, int, int] | None) -> None:
        """The request ended (once): its usage, as its response reports it, is its tenant's."""
        if not self.done:
            self.done = True
            self.admission.finished(self, status, usage or (0, 0, 0))


class _Turns:
    """One model's turns: how many are given and not yet freed, and who waits for one."""

    def __init__(self) -> None:
        self.dispatched = 0
        self.by_tenant: Counter[str] = Counter()  # turns given and not yet freed, each tenant's
        self.queue = FairQueue()

    def may_go(self, tenant: str, max_dispatched: int) -> bool:
        """Whether a request of `tenant` may be given a turn now (its own earlier ones aside)."""
        if self.dispatched < max_dispatched:
            return True
        sending = set(self.by_tenant) | self.queue.tenants() | {tenant}  # (a tenant with none out is not kept)
        return self.by_tenant[tenant] < math.ceil(max_dispatched / len(sending))


class Admission:
    def __init__(self, metrics: TenantMetrics, max_dispatched: int, timeout_s: float, max_queued: int,
                 clock=time.monotonic):
        self.metrics, self.max_dispatched, self.timeout_s, self.clock = metrics, max_dispatched, timeout_s, clock
        self.max_queued = max_queued or _UNBOUNDED_QUEUE
        self._turns: dict[str, _Turns] = {}  # by model
        self._in_flight: dict[str, int] = {}
        self._buckets: dict[str, token_bucket.Bucket] = {}

    @property
    def queued(self) -> int:
        """Requests waiting for a turn, over every model."""
        return sum(len(turns.queue) for turns in self._turns.values())

    @property
    def dispatched(self) -> int:
        """Turns given and not yet freed, over every model."""
        return sum(turns.dispatched for turns in self._turns.values())

    def _turns_of(self, model: str) -> _Turns:
        return self._turns.setdefault(model, _Turns())

    def in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)

    def enter(self, tenant: Tenant, prompt_tokens: int, cost: int, model: str = "") -> Ticket:
        """A ticket for the request (to `model`, which labels its tenant's series), or its 429 (`limit_error`). The
        limits count the tenant's requests to every model."""
        name = tenant.name
        if tenant.max_in_flight and self.in_flight(name) >= tenant.max_in_flight:
            self.metrics.rejected(model, name, "max_in_flight")
            raise limit_error(tenant, "max_in_flight", 1.0)
        if tenant.tokens_per_minute:
            now = self.clock()
            bucket = self._buckets.get(name) or token_bucket.full(tenant.tokens_per_minute, now)
            bucket, wait_s = token_bucket.admit(bucket, prompt_tokens, now)
            self._buckets[name] = bucket
            if wait_s is not None:
                self.metrics.rejected(model, name, "tokens_per_minute")
                raise limit_error(tenant, "tokens_per_minute", wait_s)
        self._in_flight[name] = self.in_flight(name) + 1
        self.metrics.admitted(model, name)
        return Ticket(self, tenant, cost, model)

    async def wait_turn(self, ticket: Ticket) -> None:
        """Until the request may be sent on; StreamError("queue_full") when too many wait or its wait runs out."""
        turns = self._turns_of(ticket.model)
        name = ticket.tenant.name
        if not self.max_dispatched or (not turns.queue.queued(name) and turns.may_go(name, self.max_dispatched)):
            self._give_turn(ticket, turns)
            return
        if turns.queue.queued(ticket.tenant.name) >= self.max_queued:
            self.metrics.rejected(ticket.model, ticket.tenant.name, "queue_full")
            raise StreamError("queue_full", f"{self.max_queued} requests of this tenant already wait at the gateway",
                              retry_after_s=1.0)
        ticket.turn = asyncio.get_running_loop().create_future()
        turns.queue.push(ticket.tenant.name, ticket, ticket.cost, ticket.tenant.priority)
        try:
            async with asyncio.timeout(self.timeout_s):
                await ticket.turn
        except TimeoutError:
            if ticket.holds_turn:  # given as the wait ran out: take it
                return
            turns.queue.remove(ticket.tenant.name, ticket)
            self.metrics.rejected(ticket.model, ticket.tenant.name, "queue_timeout")
            raise StreamError("queue_full", f"the request waited {self.timeout_s:g} s at the gateway for its turn; "
                                            "try again shortly", retry_after_s=1.0) from None
        except BaseException:  # cancelled: the client left
            turns.queue.remove(ticket.tenant.name, ticket)
            self.release_turn(ticket)
            raise

    @staticmethod
    def _give_turn(ticket: Ticket, turns: _Turns) -> None:
        ticket.holds_turn = True
        turns.dispatched += 1
        turns.by_tenant[ticket.tenant.name] += 1

    def release_turn(self, ticket: Ticket) -> None:
        if not ticket.holds_turn:
            return
        ticket.holds_turn = False
        turns = self._turns_of(ticket.model)
        turns.dispatched -= 1
        turns.by_tenant[ticket.tenant.name] -= 1
        if not turns.by_tenant[ticket.tenant.name]:
            del turns.by_tenant[ticket.tenant.name]
        while (given := turns.queue.pop(lambda t: not self.max_dispatched or turns.may_go(t, self.max_dispatched))):
            _, waiting = given
            self._give_turn(waiting, turns)
            waiting.turn.set_result(None)
        if not turns.dispatched and not turns.queue:
            del self._turns[ticket.model]  # a model's turns last as long as its requests

    def finished(self, ticket: Ticket, status: str, usage: tuple[int, int, int]) -> None:
        self.release_turn(ticket)
        name, (prompt, completion, _) = ticket.tenant.name, usage
        left = self.in_flight(name) - 1
        if left > 0:
            self._in_flight[name] = left
        else:
            self._in_flight.pop(name, None)
        if name in self._buckets:
            self._buckets[name] = token_bucket.charge(self._buckets[name], completion, self.clock())
        self.metrics.finished(ticket.model, name, status, prompt, completion)
