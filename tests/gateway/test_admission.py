"""Admission: tenants' limits (429 with Retry-After), turns given fairly, counters from usage."""

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from services.gateway.admission import Admission
from services.gateway.errors import RequestError
from services.gateway.streams import StreamError
from services.gateway.tenant_metrics import TenantMetrics
from services.common.tenant_keys import Tenant


def admission(max_dispatched=1, timeout_s=5.0, max_queued=16, clock=None):
    registry = CollectorRegistry()
    gate = Admission(TenantMetrics(registry, {"service": "gateway"}), max_dispatched, timeout_s, max_queued,
                     **({"clock": clock} if clock else {}))
    return gate, lambda name, **labels: registry.get_sample_value(name, {"model_name": "", "service": "gateway",
                                                                          **labels}) or 0


def test_past_max_in_flight_is_429_and_other_tenants_go_on():
    gate, sample = admission()
    limited = Tenant("a", max_in_flight=1)
    ticket = gate.enter(limited, 4, 8)
    with pytest.raises(RequestError) as raised:
        gate.enter(limited, 4, 8)
    error = raised.value
    assert error.status == 429 and error.headers["Retry-After"] == "1" and "max_in_flight" in error.message
    assert error.body()["error"]["code"] == "rate_limit_exceeded"
    gate.enter(Tenant("b"), 4, 8)  # another tenant: untouched
    ticket.finish("ok", (4, 3, 0))
    gate.enter(limited, 4, 8)
    assert sample("splitserve_tenant_rejected_total", tenant="a", reason="max_in_flight") == 1
    assert sample("splitserve_tenant_tokens_total", tenant="a", kind="completion") == 3
    assert sample("splitserve_tenant_requests_in_flight", tenant="a") == 1


def test_a_tenants_limits_count_its_requests_to_every_model_and_its_series_name_each():
    gate, sample = admission()
    limited = Tenant("a", max_in_flight=1)
    ticket = gate.enter(limited, 4, 8, "model-a")
    with pytest.raises(RequestError):
        gate.enter(limited, 4, 8, "model-b")  # the tenant's one request in flight is model-a's
    ticket.finish("ok", (4, 3, 0))
    gate.enter(limited, 4, 8, "model-b")
    assert sample("splitserve_tenant_rejected_total", model_name="model-b", tenant="a", reason="max_in_flight") == 1
    assert sample("splitserve_tenant_tokens_total", model_name="model-a", tenant="a", kind="completion") == 3
    assert sample("splitserve_tenant_requests_in_flight", model_name="model-a", tenant="a") == 0
    assert sample("splitserve_tenant_requests_in_flight", model_name="model-b", tenant="a") == 1


def test_each_model_has_its_own_turns_a_flood_of_one_holds_none_of_anothers():
    async def run():
        gate, _ = admission(max_dispatched=1)
        held = gate.enter(Tenant("a"), 4, 8, "model-a")
        await gate.wait_turn(held)  # model-a's one turn
        flood = [gate.enter(Tenant("a"), 4, 8, "model-a") for _ in range(3)]
        waiting = [asyncio.create_task(gate.wait_turn(t)) for t in flood]
        await asyncio.sleep(0)
        assert gate.queued == 3 and gate.dispatched == 1
        other = gate.enter(Tenant("a"), 4, 8, "model-b")
        await asyncio.wait_for(gate.wait_turn(other), 1.0)  # at once: model-b's turns are its own
        assert other.holds_turn and gate.dispatched == 2 and gate.queued == 3
        other.finish("ok", (4, 1, 0))
        assert not any(t.holds_turn for t in flood)  # model-b's freed turn is not model-a's
        held.first_token()
        await asyncio.sleep(0)
        assert [t.done() for t in waiting] == [True, False, False] and gate.dispatched == 1
        for ticket, task in zip(flood, waiting):
            await task
            ticket.finish("ok", (4, 1, 0))
        held.finish("ok", (4, 1, 0))
        assert gate.dispatched == 0 and gate.queued == 0

    asyncio.run(run())


def test_tokens_per_minute_refuses_with_the_refill_time():
    now = [0.0]
    gate, sample = admission(clock=lambda: now[0])
    tenant = Tenant("a", tokens_per_minute=60)  # one token a second
    gate.enter(tenant, 50, 50).finish("ok", (50, 10, 0))  # 10 left after the prompt, 0 after the completion
    with pytest.raises(RequestError) as raised:
        gate.enter(tenant, 10, 10)
    assert raised.value.headers["Retry-After"] == "10" and "tokens_per_minute" in raised.value.message
    now[0] = 10.0
    gate.enter(tenant, 10, 10)
    assert sample("splitserve_tenant_rejected_total", tenant="a", reason="tokens_per_minute") == 1


def test_turns_go_to_the_quiet_tenant_ahead_of_a_noisy_backlog():
    async def run():
        gate, _ = admission(max_dispatched=2)
        order = []

        async def request(tenant: str, name: str):
            ticket = gate.enter(Tenant(tenant), 10, 10)
            await gate.wait_turn(ticket)
            order.append(name)
            return ticket

        heads = [gate.enter(Tenant("noisy"), 10, 10) for _ in range(2)]
        for head in heads:
            await gate.wait_turn(head)  # hold both turns
        tasks = [asyncio.create_task(request("noisy", f"n{i}")) for i in range(4)]
        await asyncio.sleep(0)
        assert gate.queued == 4
        quiet = asyncio.create_task(request("quiet", "q"))
        await asyncio.sleep(0)
        assert order == ["q"] and gate.dispatched == 3  # its share (2 over 2 tenants): at once, past the bound
        quiet_ticket = await quiet
        heads[0].first_token()  # 2 turns out again: none for noisy's backlog, which holds its share
        await asyncio.sleep(0)
        assert order == ["q"] and gate.queued == 4
        heads[1].first_token()  # fewer than 2 out: the next in line goes
        await asyncio.sleep(0)
        assert order == ["q", "n0"]
        quiet_ticket.first_token()
        await asyncio.sleep(0)
        assert order == ["q", "n0", "n1"]
        for task in tasks[2:]:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())


def test_a_tenant_past_its_share_waits_while_the_bound_is_reached():
    async def run():
        gate, _ = admission(max_dispatched=4)
        noisy = [gate.enter(Tenant("noisy"), 1, 1) for _ in range(4)]
        for ticket in noisy:
            await gate.wait_turn(ticket)
        quiet = [gate.enter(Tenant("quiet"), 1, 1) for _ in range(3)]
        await gate.wait_turn(quiet[0])
        await gate.wait_turn(quiet[1])  # a share of 4 over 2 tenants
        third = asyncio.create_task(gate.wait_turn(quiet[2]))
        await asyncio.sleep(0)
        assert gate.dispatched == 6 and gate.queued == 1 and not third.done()
        for ticket in noisy[:3]:  # 3 out, under the bound: the quiet one waiting goes
            ticket.first_token()
        await asyncio.sleep(0)
        assert third.done() and gate.dispatched == 4
        await third

    asyncio.run(run())


def test_a_wait_past_its_deadline_is_429_and_a_cancelled_wait_leaves_the_queue():
    async def run():
        gate, sample = admission(max_dispatched=1, timeout_s=0.05)
        holder = gate.enter(Tenant("a"), 1, 1)
        await gate.wait_turn(holder)
        late = gate.enter(Tenant("a"), 1, 1)  # its tenant holds the one turn
        with pytest.raises(StreamError) as raised:
            await gate.wait_turn(late)
        assert raised.value.code == "queue_full" and gate.queued == 0
        assert sample("splitserve_tenant_rejected_total", tenant="a", reason="queue_timeout") == 1
        gone = asyncio.create_task(gate.wait_turn(gate.enter(Tenant("a"), 1, 1)))
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert gate.queued == 0
        holder.finish("cancelled", None)
        assert gate.dispatched == 0 and sample("splitserve_tenant_requests_total", tenant="a", status="cancelled") == 1

    asyncio.run(run())


def test_each_tenants_room_in_the_queue_is_bounded():
    async def run():
        gate, _ = admission(max_dispatched=1, max_queued=1)
        await gate.wait_turn(gate.enter(Tenant("a"), 1, 1))
        waiting = asyncio.create_task(gate.wait_turn(gate.enter(Tenant("a"), 1, 1)))
        await asyncio.sleep(0)
        with pytest.raises(StreamError):  # a tenant's room is full
            await gate.wait_turn(gate.enter(Tenant("a"), 1, 1))
        await gate.wait_turn(gate.enter(Tenant("b"), 1, 1))  # another's share: at once
        other = asyncio.create_task(gate.wait_turn(gate.enter(Tenant("b"), 1, 1)))  # and its room is its own
        await asyncio.sleep(0)
        assert gate.queued == 2
        for task in (waiting, other):
            task.cancel()
        await asyncio.gather(waiting, other, return_exceptions=True)

    asyncio.run(run())
