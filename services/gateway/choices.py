"""A request's `n` completions, as sub-requests on the bus: one per choice.

The first is submitted alone; the others once its first token is out (in the background: the first choice streams
on meanwhile). Its prompt is computed and cached by then, so they find the prompt's blocks in that worker's prefix
cache (the KV router sends them where the prefix is) and share them instead of computing the prompt n times.
`merged()` yields every choice's chunks as they come, (index, chunk); `release()` lets every sub-request go
(cancelling those still running).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from contracts import TokenChunk
from services.gateway.streams import RequestStream

_QUEUED_CHUNKS = 64  # chunks waiting for the client across the choices; past it the choices wait (backpressure)


class Choices:
    def __init__(self, request_bus, first: RequestStream, n: int = 1,
                 submit_rest: Callable[[], Awaitable[list[RequestStream]]] | None = None):
        self.request_bus = request_bus
        self.streams = [first]
        self.n = n
        self._submit_rest = submit_rest

    async def merged(self) -> AsyncIterator[tuple[int, TokenChunk]]:
        if self.n == 1:
            async for chunk in self.request_bus.chunks(self.streams[0]):
                yield 0, chunk
            return
        # (index, chunk, error): a chunk; (index, None, None): that choice ended; (None, count, None): the other
        # choices started, `count` of them; an error ends them all. `left` counts the ends still to come, the
        # start of the others too once it is under way (the first choice may end before they are submitted).
        queue: asyncio.Queue = asyncio.Queue(_QUEUED_CHUNKS)
        tasks = [self._pump(queue, 0, self.streams[0])]
        try:
            left = 1
            while left:
                index, chunk, error = await queue.get()
                if error is not None:
                    raise error
                if index is None:
                    left += chunk - 1  # their ends instead of the start's
                    continue
                if chunk is None:
                    left -= 1
                    continue
                if index == 0 and len(tasks) == 1:  # the prompt is computed: the others may start
                    tasks.append(asyncio.create_task(self._start_rest(queue, tasks)))
                    left += 1
                yield index, chunk
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _start_rest(self, queue: asyncio.Queue, tasks: list[asyncio.Task]) -> None:
        try:
            started = await self._submit_rest()
        except Exception as exc:
            await queue.put((None, None, exc))
            return
        self.streams.extend(started)
        tasks += [self._pump(queue, i, stream) for i, stream in enumerate(started, 1)]
        await queue.put((None, len(started), None))

    def _pump(self, queue: asyncio.Queue, index: int, stream: RequestStream) -> asyncio.Task:
        async def pump():
            try:
                async for chunk in self.request_bus.chunks(stream):
                    await queue.put((index, chunk, None))
                await queue.put((index, None, None))
            except Exception as exc:  # (a StreamError: the request failed) the consumer raises it
                await queue.put((index, None, exc))
        return asyncio.create_task(pump())

    async def release(self) -> None:
        await asyncio.gather(*(self.request_bus.release(stream) for stream in self.streams))


async def submit_all(submit: Callable[[int], Awaitable[RequestStream]], indices: range, release
                     ) -> list[RequestStream]:
    """`submit(i)` for every index at once. If one fails, or this is cancelled, the ones that started are released
    (and those still submitting cancelled) before it raises."""
    tasks = [asyncio.create_task(submit(i)) for i in indices]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        started = [task.result() for task in tasks if not task.cancelled() and task.exception() is None]
        await asyncio.gather(*(release(stream) for stream in started), return_exceptions=True)
        raise
