"""The two bounded waits the bus uses everywhere.

On Python 3.11 a cancellation that lands just as an inner `asyncio.wait_for` completes is swallowed (and
nats-py waits that way), so a task cancelled once may run on: `cancel_and_wait` cancels until the task is
really gone, and `within` runs an awaitable as its own task so that its deadline holds whatever happens inside.
"""

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from shared.telemetry.logging import get_logger

log = get_logger(__name__)

T = TypeVar("T")


async def cancel_and_wait(*tasks: asyncio.Future, timeout_s: float = 5.0) -> bool:
    """Cancel `tasks` (again every 0.1 s) until they end; False if some still run after `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    pending = {t for t in tasks if not t.done()}
    cancelled = set(pending)
    while pending and loop.time() < deadline:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=min(0.1, max(0.0, deadline - loop.time())))
    for task in cancelled - pending:
        if not task.cancelled() and task.exception() is not None:  # retrieved, so asyncio does not warn
            log.debug("task failed while being cancelled", task=task_name(task), error=repr(task.exception()))
    for task in pending:
        log.error("task ignored cancellation", task=task_name(task), timeout_s=timeout_s)
    return not pending


async def within(timeout_s: float, awaitable: Awaitable[T]) -> T:
    """Await `awaitable` for at most `timeout_s`, else cancel it and raise `TimeoutError`."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        await cancel_and_wait(task, timeout_s=1.0)
        raise
    if not done:
        await cancel_and_wait(task, timeout_s=1.0)
        raise TimeoutError(f"no result within {timeout_s:g}s")
    return task.result()


def task_name(task: asyncio.Future) -> str:
    return task.get_name() if isinstance(task, asyncio.Task) else repr(task)
