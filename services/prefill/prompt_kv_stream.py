"""`PromptKVStream`: the prefill worker's connector that hands each job's prompt KV, layer by layer, to the
coroutine shipping it.

The engine calls it on its own thread between two layers of the step that completes a prompt; each layer
goes onto the job's queue on the event loop, where the sender reads it while the next layers compute.
"""

import asyncio

from shared.engine import BlockSlice, KVConnector, KVLayout

# What a job's queue holds, per layer: (layer_start, layer_end, data), data a view of the cache's blocks.
LayerPart = tuple[int, int, BlockSlice]


class PromptKVStream(KVConnector):
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._queues: dict[str, asyncio.Queue[LayerPart]] = {}

    def open(self, request_id: str) -> asyncio.Queue[LayerPart]:
        """Where the request's layers will arrive (one entry per layer this engine computes)."""
        queue: asyncio.Queue[LayerPart] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        """The job is over: layers that still come for it are dropped."""
        self._queues.pop(request_id, None)

    def prompt_layer_computed(self, request_id: str, data: BlockSlice, layout: KVLayout) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            self._loop.call_soon_threadsafe(queue.put_nowait, (layout.layer_start, layout.layer_end, data))
