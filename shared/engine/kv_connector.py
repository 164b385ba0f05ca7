"""`KVConnector`: how a service moves KV in and out of the engine without the engine knowing the service.

The engine calls a connector's hooks (vLLM v1's `KVConnectorBase_V1` plays this part there) on its own
thread, inside the call that caused them; each default does nothing, so a connector overrides only what
it needs. A hook must not block: work that waits (network, disk) goes to another thread or event loop.
`KVConnectors` is the engine's set of them, called in the order they were connected.

Loading a prefix from outside, as the engine sees it:

    admitted -> external_prefix: None (ask again next step) | 0 (compute it) | n tokens
    n -> blocks allocated -> start_load -> ... -> finished_loads: ok (n tokens computed) | failed (compute)

A load from a cache tier (the kv-store) brings whole blocks of the prefix, counted as that tier's hits. A
load that continues work done elsewhere (a remote prefill) may bring every prompt token, and with them the
tokens sampled there (`LoadEnd.continuation`).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.engine.block_slice import BlockSlice
from shared.engine.continuation import Continuation
from shared.engine.kv_cache import KVLayout

# export(indices) -> the KV of those of the handed blocks, [n, layers, 2, block_size, kv_heads, head_dim]
BlockExport = Callable[[list[int]], torch.Tensor]


@dataclass(slots=True, frozen=True)
class LoadEnd:
    """How a connector's load for a request ended: `ok` when all of its KV was written. `continuation` (its
    output tokens, detokenizer, cached tokens and origin; never KV) says how the request goes on from work done
    elsewhere, whether the load succeeded or not. `request_over`: the request ended outside the engine (the
    first token sampled elsewhere was its last): the engine drops it."""

    request_id: str
    ok: bool
    continuation: Continuation | None = None
    request_over: bool = False


class KVConnector:
    name: str | None = None  # a cache tier's name for the prefix-cache counts (None: its loads are not cache hits)

    def external_prefix(self, request_id: str, token_ids: list[int], num_local_tokens: int) -> int | None:
        """How many tokens after the `num_local_tokens` the engine's own prefix cache holds this connector can
        load into the request's blocks (0: none; None: not known yet, so the request waits and is asked again
        at the next step); asked when a request is first admitted. Short of all the request's tokens, the
        engine loads whole blocks only, and may load fewer."""
        return 0

    def start_load(self, request_id: str, block_ids: list[int], first_token: int, num_tokens: int) -> None:
        """Write the KV of tokens [first_token, first_token + num_tokens) of the request into `block_ids` (its
        blocks from the one holding `first_token`), from any thread, then report it in `finished_loads`: until
        then the blocks are the load's, even if the request is aborted meanwhile."""

    def finished_loads(self) -> list[LoadEnd]:
        """The loads that ended since the last call (asked every step while any is loading); a failed load's
        tokens are computed instead."""
        return []

    def request_finished(self, request_id: str) -> None:
        """The request is over (finished, aborted or refused): forget it, and end a load still running for it
        soon (it must still be reported)."""

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


_HOOKS = ("block_stored", "block_removed", "cache_listed", "blocks_computed", "prompt_layer_computed",
          "external_prefix", "start_load", "finished_loads", "request_finished")


def _overrides(connector: KVConnector, hook: str) -> bool:
    return getattr(type(connector), hook) is not getattr(KVConnector, hook)


class KVConnectors(KVConnector):
    """The connectors of one engine, each hook called on every connector that overrides it; of those that can
    load a prefix, the first to offer one loads it."""

    def __init__(self) -> None:
        self._connected: list[KVConnector] = []
        self._by_hook: dict[str, list[KVConnector]] = {}
        self._loader: dict[str, KVConnector] = {}  # request id -> the connector whose offer stands

    def connect(self, connector: KVConnector) -> None:
        self._connected.append(connector)
        self._index()

    def disconnect(self, connector: KVConnector) -> None:
        """No more hooks to `connector` (a worker's role that ended, its requests all over)."""
        self._connected = [c for c in self._connected if c is not connector]
        self._loader = {rid: c for rid, c in self._loader.items() if c is not connector}
        self._index()

    def _index(self) -> None:
        # Replaced whole: the engine thread reads the old one meanwhile.
        self._by_hook = {hook: [c for c in self._connected if _overrides(c, hook)] for hook in _HOOKS}

    @property
    def loader_names(self) -> list[str]:
        """The cache tiers among the connectors that load prefixes."""
        return [c.name for c in self._by_hook.get("external_prefix", ()) if c.name is not None]

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

    def external_prefix(self, request_id: str, token_ids: list[int], num_local_tokens: int) -> int | None:
        self._loader.pop(request_id, None)
        for connector in self._by_hook.get("external_prefix", ()):
            offer = connector.external_prefix(request_id, token_ids, num_local_tokens)
            if offer is None:
                return None  # an earlier connector's answer decides: wait for it
            if offer > 0:
                self._loader[request_id] = connector
                return offer
        return 0

    def start_load(self, request_id: str, block_ids: list[int], first_token: int, num_tokens: int) -> None:
        self._loader[request_id].start_load(request_id, block_ids, first_token, num_tokens)

    def loader_of(self, request_id: str) -> KVConnector | None:
        return self._loader.get(request_id)

    def finished_loads(self) -> list[LoadEnd]:
        return [done for connector in self._by_hook.get("finished_loads", ()) for done in connector.finished_loads()]

    def request_finished(self, request_id: str) -> None:
        self._loader.pop(request_id, None)
        for connector in self._by_hook.get("request_finished", ()):
            connector.request_finished(request_id)
