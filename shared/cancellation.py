"""A cancel that a library swallowed, raised again.

Python 3.11's `asyncio.wait_for` returns the awaited result when it arrives
together with a cancel of the waiting task, and forgets the cancel. Libraries
wait that way (nats-py's request, hence a JetStream publish), so a task
cancelled while one of them returns goes on as if nothing had been asked of
it. The task still counts the cancel (`Task.cancelling()`): after such a call,
`raise_if_cancelled()` turns it back into a CancelledError before the task
acts on the result.
"""

import asyncio


def raise_if_cancelled() -> None:
    """Raise CancelledError if the running task has been asked to cancel and has not given the cancel up
    (`Task.uncancel`, as `asyncio.timeout` does for its own)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError()
