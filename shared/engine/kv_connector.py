"""`KVConnector`: how a service moves KV in and out of the engine without the engine knowing the service.

The engine calls a connector's hooks (vLLM v1's `KVConnectorBase_V1` plays this part there) on its own
thread, inside the call that caused them; each default does nothing, so a connector overrides only what
it needs. A hook must not block: work that waits (network, disk) goes to another thread or event loop.
`KVConnectors` is the engine's set of them, called in the order they were connected.
"""

from collections.abc import Callable

import torch

from shared.engine.block_slice import BlockSlice
from shared.engine.kv_cache import KVLayout

# export(indices) -> the KV of those of the handed blocks, [n, layers, 2, block_size, kv_heads, head_dim]
BlockExport = Callable[[list[int]], torch.Tensor]


class KVConnector:
    def block_stored(self, block_hash: bytes) -> None:
        """A full block with this hash entered the prefix cache: requests can reuse it from now on."""

    def block_removed(self, block_hash: bytes) -> None:
        """The block with this hash left the prefix cache (evicted for another block, or the cache reset)."""

    def cache_listed(self) -> None:
        """The prefix cache's whole content was just read out: news of blocks stored or removed before it
        is covered by that list."""

    def blocks_computed(self, block_hashes: list[bytes], export: BlockExport) -> None:
        """A request has these full blocks computed that no connector was handed before (when its prompt is
        complete, every few blocks of decoding, and when it finishes); `export` copies them out, valid
        only during the call."""

    def prompt_layer_computed(self, request_id: str, data: BlockSlice, layout: KVLayout) -> None:
        """One layer of the prompt KV of a request added with `stream_prompt_kv`, during the step that
        completes its prompt, right after the layer ran (every local layer, in order); `data` views the
        cache's blocks (valid while they are: with `hold_kv`, until `release_held`), `data.gather()` copies."""


_HOOKS = ("block_stored", "block_removed", "cache_listed", "blocks_computed", "prompt_layer_computed")


def _overrides(connector: KVConnector, hook: str) -> bool:
    return getattr(type(connector), hook) is not getattr(KVConnector, hook)


class KVConnectors(KVConnector):
    """The connectors of one engine, each hook called on every connector that overrides it."""

    def __init__(self) -> None:
        self._connected: list[KVConnector] = []
        self._by_hook: dict[str, list[KVConnector]] = {}

    def connect(self, connector: KVConnector) -> None:
        self._connected.append(connector)
        self._by_hook = {hook: [c for c in self._connected if _overrides(c, hook)]
                         for hook in _HOOKS}

    def wants(self, hook: str) -> bool:
        """Whether any connector implements `hook` (the engine skips the work of a hook nobody takes)."""
        return bool(self._by_hook.get(hook))

    def block_stored(self, block_hash: bytes) -> None:
        for connector in self._by_hook.get("block_stored", ()):
            connector.block_stored(block_hash)

    def block_removed(self, block_hash: bytes) -> None:
        for connector in self._by_hook.get("block_removed", ()):
            connector.block_removed(block_hash)

    def cache_listed(self) -> None:
        for connector in self._by_hook.get("cache_listed", ()):
            connector.cache_listed()

    def blocks_computed(self, block_hashes: list[bytes], export: BlockExport) -> None:
        for connector in self._by_hook.get("blocks_computed", ()):
            connector.blocks_computed(block_hashes, export)

    def prompt_layer_computed(self, request_id: str, data: BlockSlice, layout: KVLayout) -> None:
        for connector in self._by_hook.get("prompt_layer_computed", ()):
            connector.prompt_layer_computed(request_id, data, layout)
