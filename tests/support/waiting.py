"""Waiting on a condition with a deadline: `eventually()` in asyncio tests, `wait_until()` in plain ones, `became()`
where a miss is not yet a failure."""

import asyncio
import inspect
import time


async def eventually(predicate, timeout_s: float = 5.0, what: str = "the condition", poll_s: float = 0.02):
    """The first truthy value of `predicate()` (plain or async), polled until `timeout_s`; fails naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(poll_s)


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.3):
    """The first truthy value of `predicate()`, polled until `timeout_s`; fails with `what` (what did not happen)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} (waited {timeout_s} s)"
        time.sleep(poll_s)


def became(predicate, timeout_s: float, poll_s: float = 0.3) -> bool:
    """Whether `predicate()` turned true within `timeout_s` (a fault tried again when it missed, say)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


async def server_has(nc) -> None:
    """Until the server has handled everything `nc` sent so far, a subscription just made included. One `flush()`
    is not enough: nats-py 2.16 writes its PING straight to the socket, ahead of commands still queued for its
    flusher task, so the PONG can come before a SUB sent just before it; the second PING follows them."""
    await nc.flush()
    await nc.flush()
