"""A service's main loop: run its tasks until a shutdown signal, or until one of them dies."""

import asyncio
from collections.abc import Awaitable

from shared.bus.connection import ShutdownSignal
from shared.telemetry.logging import get_logger

log = get_logger(__name__)

EXIT_OK = 0
EXIT_SOFTWARE = 70  # sysexits.h EX_SOFTWARE: an internal error; the supervisor restarts the service


async def run_until_stopped(*tasks: Awaitable, shutdown: ShutdownSignal, cancel_timeout_s: float = 5.0) -> int:
    """Wait for `shutdown` or for any task to end; cancel the rest; return the process exit code.

    A task ending with an exception (a crashed actor or loop) or cancelled by
    someone else gives 70; a shutdown signal, or a task that simply returned, 0.
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
            exc = task.exception()
            log.error("task failed; stopping the service", task=_name(task), exc_info=exc)
            exit_code = EXIT_SOFTWARE
        else:
            log.info("task finished; stopping the service", task=_name(task))
    if stop_waiter in done:
        log.info("shutting down")
    await _cancel_all(running, cancel_timeout_s)
    return exit_code


async def _cancel_all(tasks: list[asyncio.Future], timeout_s: float) -> None:
    pending = [t for t in tasks if not t.done()]
    for task in pending:
        task.cancel()
    if not pending:
        return
    stopped, still_running = await asyncio.wait(pending, timeout=timeout_s)
    for task in stopped:
        if not task.cancelled() and task.exception() is not None:
            log.warning("task failed while being cancelled", task=_name(task), exc_info=task.exception())
    for task in still_running:
        log.error("task ignored cancellation", task=_name(task), timeout_s=timeout_s)


def _name(task: asyncio.Future) -> str:
    return task.get_name() if isinstance(task, asyncio.Task) else repr(task)
