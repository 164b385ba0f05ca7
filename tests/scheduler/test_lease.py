"""A pulled request's lease: renewed while routing goes on, judged lapsed before the server redelivers it."""

import asyncio
import time

from services.scheduler.lease import Lease, lease_lapsed


def test_lapsed_before_the_ack_wait_runs_out():
    assert not lease_lapsed(renewed_at=100.0, now=107.0, ack_wait_s=10.0)
    assert lease_lapsed(renewed_at=100.0, now=108.0, ack_wait_s=10.0)  # the margin: before the server's 10 s
    assert lease_lapsed(renewed_at=100.0, now=130.0, ack_wait_s=10.0)


class _Message:
    def __init__(self):
        self.renewals = 0

    async def in_progress(self):
        self.renewals += 1


def test_routing_renews_the_lease_and_a_frozen_scheduler_finds_it_lapsed():
    async def scenario():
        msg = _Message()
        lease = Lease(msg, ack_wait_s=0.3)
        keeper = asyncio.create_task(lease.keep())
        await asyncio.sleep(0.5)  # longer than the ack wait: kept by renewals
        assert msg.renewals >= 3 and not lease.lapsed()
        keeper.cancel()
        time.sleep(0.3)  # the whole process frozen (no renewal can run)
        assert lease.lapsed()

    asyncio.run(scenario())
