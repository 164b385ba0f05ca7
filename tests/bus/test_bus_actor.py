import asyncio

import pytest

from shared.bus.actor import Actor, MailboxFull
from shared.bus.connection import ShutdownSignal
from shared.bus.service import cancel_and_wait, run_until_stopped, within

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


class Recorder(Actor):
    """Appends each message; a message "boom" crashes it; handling yields so overlap would show."""

    def __init__(self, mailbox_size: int = 8):
        super().__init__("recorder", mailbox_size)
        self.seen: list = []
        self.busy = False

    async def handle(self, msg) -> None:
        assert not self.busy, "two messages handled at once"
        self.busy = True
        await asyncio.sleep(0)
        if msg == "boom":
            raise ValueError("poison message")
        self.seen.append(msg)
        self.busy = False


async def test_messages_are_handled_one_at_a_time_in_order():
    actor = Recorder(mailbox_size=100)
    for i in range(50):
        actor.tell(i)
    task = asyncio.create_task(actor.run())
    await asyncio.wait_for(actor.mailbox.join(), timeout=2)
    assert actor.seen == list(range(50))
    assert actor.num_handled == 50
    task.cancel()


async def test_tell_raises_mailbox_full_without_waiting():
    actor = Recorder(mailbox_size=2)
    actor.tell("a")
    actor.tell("b")
    with pytest.raises(MailboxFull, match="recorder"):
        actor.tell("c")
    task = asyncio.create_task(actor.run())
    await asyncio.wait_for(actor.mailbox.join(), timeout=2)
    actor.tell("c")  # room again once drained
    await asyncio.wait_for(actor.mailbox.join(), timeout=2)
    assert actor.seen == ["a", "b", "c"]
    task.cancel()


async def test_a_crashed_actor_ends_the_service_with_exit_code_70():
    actor = Recorder()
    shutdown = ShutdownSignal()
    try:
        other = asyncio.create_task(asyncio.sleep(3600), name="other-loop")
        actor.tell("fine")
        actor.tell("boom")
        actor.tell("never handled")
        code = await asyncio.wait_for(run_until_stopped(asyncio.create_task(actor.run()), other, shutdown=shutdown), timeout=5)
    finally:
        shutdown.remove()
    assert code == 70
    assert actor.seen == ["fine"]
    assert other.cancelled()


async def test_shutdown_cancels_the_tasks_and_exits_0():
    shutdown = ShutdownSignal()
    try:
        loops = [asyncio.create_task(asyncio.sleep(3600)) for _ in range(3)]
        asyncio.get_running_loop().call_later(0.05, shutdown.set)
        code = await asyncio.wait_for(run_until_stopped(*loops, shutdown=shutdown), timeout=5)
    finally:
        shutdown.remove()
    assert code == 0
    assert all(t.cancelled() for t in loops)
    assert shutdown.is_set()


async def test_a_loop_that_returns_stops_the_service_with_0():
    shutdown = ShutdownSignal()
    try:
        forever = asyncio.create_task(asyncio.sleep(3600))
        code = await asyncio.wait_for(run_until_stopped(asyncio.sleep(0.01), forever, shutdown=shutdown), timeout=5)
    finally:
        shutdown.remove()
    assert code == 0
    assert forever.cancelled()


async def test_cancel_and_wait_gets_past_a_swallowed_cancellation():
    async def swallows_twice():
        for _ in range(2):
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass  # what Python 3.11's wait_for does when the cancel races its result
        await asyncio.sleep(10)

    released = False

    async def ignores_cancellation():
        while not released:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass

    stubborn = asyncio.create_task(swallows_twice())
    await asyncio.sleep(0)
    assert await cancel_and_wait(stubborn, timeout_s=2)
    assert stubborn.cancelled()

    hopeless = asyncio.create_task(ignores_cancellation())
    await asyncio.sleep(0)
    assert not await cancel_and_wait(hopeless, timeout_s=0.3)
    released = True
    assert await cancel_and_wait(hopeless, timeout_s=1)


async def test_within_bounds_a_wait_and_cancels_what_it_waited_for():
    assert await within(1.0, asyncio.sleep(0.01, result="done")) == "done"
    slow = asyncio.ensure_future(asyncio.sleep(10))
    with pytest.raises(TimeoutError, match="0.1s"):
        await within(0.1, slow)
    assert slow.cancelled()
