"""A service's main loop: run its tasks until a shutdown signal, or until one of them dies."""

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from shared.bus.waits import cancel_and_wait, task_name
from shared.telemetry.logging import get_logger

if TYPE_CHECKING:
    from shared.bus.connection import ShutdownSignal

log = get_logger(__name__)

EXIT_OK = 0
EXIT_SOFTWARE = 70  # sysexits.h EX_SOFTWARE: an internal error; the supervisor restarts the service


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
            log.error("task was cancelled unexpectedly", task=task_name(task))
            exit_code = EXIT_SOFTWARE
        elif task.exception() is not None:
            log.error("task failed; stopping the service", task=task_name(task), exc_info=task.exception())
            exit_code = EXIT_SOFTWARE
        else:
            log.info("task finished; stopping the service", task=task_name(task))
    if stop_waiter in done:
        log.info("shutting down")
        if on_shutdown is not None and not any(task.done() for task in running):
            await on_shutdown()
    await cancel_and_wait(*running, timeout_s=cancel_timeout_s)
    return exit_code

