"""A cancel that arrives together with what it cancels: nothing it started is left behind.

Python 3.11's `asyncio.wait_for` (nats-py's request, so a JetStream publish) returns a result that arrives with
a cancel and forgets the cancel. A submit cancelled just as its publish was acked went on, and the request it
made was held at the gateway for good, with nobody to read it (the 1,000-clients chaos test saw it).
"""

import asyncio

import pytest
from starlette.requests import Request

from services.gateway.app import _unless_disconnected
from shared.cancellation import raise_if_cancelled


def test_a_cancel_that_came_with_a_wait_fors_result_is_raised_again():
    async def scenario() -> None:
        acked = asyncio.get_running_loop().create_future()
        went_on = []

        async def publish_then_wait() -> None:
            await asyncio.wait_for(acked, 10)  # where 3.11 may return the result and forget the cancel
            went_on.append("past the publish")
            raise_if_cancelled()
            went_on.append("waited for the assignment")

        task = asyncio.create_task(publish_then_wait())
        await asyncio.sleep(0)
        acked.set_result("ack")  # the ack and the cancel, in one turn of the loop
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert "waited for the assignment" not in went_on

    asyncio.run(scenario())


def test_raise_if_cancelled_is_quiet_without_a_cancel_and_after_a_timeout_gave_its_own_up():
    async def scenario() -> None:
        raise_if_cancelled()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.01):
                await asyncio.sleep(1)
        raise_if_cancelled()  # asyncio.timeout uncancels the cancel it made

    asyncio.run(scenario())


def _request_whose_client_leaves(gone: asyncio.Event) -> Request:
    async def receive() -> dict:
        await gone.wait()
        return {"type": "http.disconnect"}
    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


@pytest.mark.parametrize("how", ["client_leaves", "caller_cancelled"])
def test_what_a_cancelled_call_returns_all_the_same_goes_to_discard(how):
    async def scenario() -> None:
        gone, started = asyncio.Event(), asyncio.Event()
        discarded = []

        async def submit_that_swallows_its_cancel() -> str:
            started.set()
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                await asyncio.sleep(0.01)  # as a library that returns what arrived with the cancel
            return "stream"

        async def discard(stream: str) -> None:
            discarded.append(stream)

        call = asyncio.create_task(_unless_disconnected(_request_whose_client_leaves(gone),
                                                        submit_that_swallows_its_cancel(), discard=discard))
        await started.wait()
        if how == "client_leaves":
            gone.set()
            assert await call is None
        else:
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
        assert discarded == ["stream"]

    asyncio.run(scenario())


def test_a_result_that_came_first_is_handed_over_not_discarded():
    async def scenario() -> None:
        discarded = []

        async def submit() -> str:
            return "stream"

        async def discard(stream: str) -> None:
            discarded.append(stream)

        assert await _unless_disconnected(_request_whose_client_leaves(asyncio.Event()), submit(), discard) == "stream"
        assert discarded == []

    asyncio.run(scenario())
