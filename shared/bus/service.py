"""A service's main loop: run its tasks until a shutdown signal, or until one of them dies.

Also the two bounded waits the bus uses everywhere. On Python 3.11 a
cancellation that lands just as an inner `asyncio.wait_for` completes is
swallowed (and nats-py waits that way), so a task cancelled once may run on;
`cancel_and_wait` cancels until the task is really gone, and `within` runs an
awaitable as its own task so that its deadline holds whatever happens inside.
"""

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from shared.telemetry.logging import get_logger

if TYPE_CHECKING:
    from shared.bus.connection import ShutdownSignal

log = get_logger(__name__)

EXIT_OK = 0
EXIT_SOFTWARE = 70  # sysexits.h EX_SOFTWARE: an internal error; the supervisor restarts the service

T = TypeVar("T")


async def run_until_stopped(*tasks: Awaitable, shutdown: "ShutdownSignal", cancel_timeout_s: float = 5.0,
                            on_shutdown: Callable[[], Awaitable] | None = None) -> int:
    """Wait for `shutdown` or for any task to end; cancel the rest; return the process exit code.

    On `shutdown` with every task still running, `on_shutdown()` runs first, while they go on (a worker's drain
    needs the loop that streams its outputs). A task ending with an exception (a crashed actor or loop) or
    cancelled by someone else gives 70; a shutdown signal, or a task that simply returned, 0.
    """
    running = [asyncio.ensure_future(t) for t in tasks]
    stop_waiter = asyncio.ensure_future(shutdown.wait())
    try:
        done, _ = await asyncio.wait([*running, stop_waiter], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop_waiter.cancel()
    exit_code = EXIT_OK
    for task in running:
        if not task.done():
            continue
        if task.cancelled():
            log.error("task was cancelled unexpectedly", task=_name(task))
            exit_code = EXIT_SOFTWARE
        elif task.exception() is not None:
            log.error("task failed; stopping the service", task=_name(task), exc_info=task.exception())
            exit_code = EXIT_SOFTWARE
        else:
            log.info("task finished; stopping the service", task=_name(task))
    if stop_waiter in done:
        log.info("shutting down")
        if on_shutdown is not None and not any(task.done() for task in running):
            await on_shutdown()
    await cancel_and_wait(*running, timeout_s=cancel_timeout_s)
    return exit_code


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
            log.debug("task failed while being cancelled", task=_name(task), error=repr(task.exception()))
    for task in pending:
        log.error("task ignored cancellation", task=_name(task), timeout_s=timeout_s)
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


def _name(task: asyncio.Future) -> str:
    return task.get_name() if isinstance(task, asyncio.Task) else repr(task)
