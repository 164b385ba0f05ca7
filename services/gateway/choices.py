"""A request's `n` completions, as sub-requests on the bus: one per choice.

The first is submitted alone; the others once its first token is out. Its prompt is computed and cached by then,
so they find the prompt's blocks in that worker's prefix cache (the KV router sends them where the prefix is) and
share them instead of computing the prompt n times. `merged()` yields every choice's chunks as they come,
(index, chunk); `release()` lets every sub-request go (cancelling those still running).
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
        queue: asyncio.Queue = asyncio.Queue(_QUEUED_CHUNKS)
        pumps = [self._pump(queue, 0, self.streams[0])]
        try:
            left = 1
            while left:
                index, chunk, error = await queue.get()
                if error is not None:
                    raise error
                if chunk is None:
                    left -= 1
                    continue
                if index == 0 and len(self.streams) == 1:  # the prompt is computed: the others may start
                    self.streams.extend(await self._submit_rest())
                    pumps += [self._pump(queue, i, stream) for i, stream in enumerate(self.streams[1:], 1)]
                    left += len(self.streams) - 1
                yield index, chunk
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

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
    """`submit(i)` for every index at once; if one fails, the ones that started are released and it raises."""
    results = await asyncio.gather(*(submit(i) for i in indices), return_exceptions=True)
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        await asyncio.gather(*(release(r) for r in results if not isinstance(r, BaseException)))
        raise failed
    return list(results)
