"""The one thread of a worker process that runs torch's parallel work.

torch's CPU ops run on an OpenMP team belonging to the thread that calls them:
libgomp keeps a team per thread that ever started parallel work, and keeps its
threads after. Two threads with teams of their own give libgomp more threads
than the cores it may use; then it stops letting idle team members spin
between parallel regions, so every one of a decode step's hundreds of regions
(several GEMMs and kernels per layer) waits for its workers to wake up.
Measured on 2 cores: 60 small GEMMs take 12.3 ms from a thread alone and 19.3
ms once another thread of the process has run one large matmul; a served
SmolLM2 bf16 step took 35 ms where the engine alone takes 23.

So a worker builds its model, and then runs every step, on one `EngineThread`,
with the process's torch thread count; every other thread (the event loop and
threads started later) runs torch ops on one thread, without a team. Create it
before the process runs any torch op elsewhere.
"""

import asyncio
import functools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch


def _use_threads(threads: int) -> None:
    # torch sets a thread's count lazily, on its first parallel op, from the count set last in any thread;
    # reading the count first does that now, so the set below is not undone by the `set_num_threads(1)` after it.
    torch.get_num_threads()
    torch.set_num_threads(threads)


class EngineThread:
    def __init__(self, name: str = "engine"):
        threads = torch.get_num_threads()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        # A daemon: a process exiting on a signal does not wait for a step in progress (or a loop still held).
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        self.submit(_use_threads, threads).result()
        torch.set_num_threads(1)  # this thread, and the threads started from now on

    def _serve(self) -> None:
        while True:
            future, fn = self._calls.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # the caller's to handle
                    future.set_exception(exc)

    def submit(self, fn: Callable, *args: Any, **kwargs: Any) -> Future:
        """Run `fn(*args, **kwargs)` on the engine thread, after what was submitted before it."""
        future: Future = Future()
        self._calls.put((future, functools.partial(fn, *args, **kwargs)))
        return future

    async def run(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """`submit`, awaited."""
        return await asyncio.wrap_future(self.submit(fn, *args, **kwargs))
