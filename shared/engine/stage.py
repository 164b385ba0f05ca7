"""`StageRunner`: a pipeline stage after the head, its layers' weights and KV cache and nothing else.

It keeps no request state: the head's `StepBatch` says which tokens, positions
and blocks each step touches (block ids are the head's, so every stage's cache
has the head's number of blocks). Steps must run in the order the head
started them; the last stage returns the logits of the sampled positions.
"""

import torch

from shared.engine.defaults import DEFAULT_DEVICE, DEFAULT_DTYPE, DEFAULT_KV_CACHE_BYTES
from shared.engine.kv_cache import KVAllocator, PagedKVCache
from shared.engine.model_loader import LayerRange, load_model
from shared.engine.model_runner import ModelRunner
from shared.engine.step_batch import StepBatch


class StageRunner:
    def __init__(self, model_dir: str, layer_range: LayerRange, *, dtype: str = DEFAULT_DTYPE,
                 device: str = DEFAULT_DEVICE, block_size: int, num_blocks: int | None = None,
                 kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES, kv_allocator: KVAllocator | None = None):
        """`num_blocks` (default: as many as `kv_cache_bytes` holds for this stage's layers) must be at
        least the head's: steps name the head's block ids."""
        if layer_range.start == 0:
            raise ValueError("layers from 0 belong to the pipeline head, which embeds the tokens")
        self.loaded = load_model(model_dir, dtype, device, layer_range)
        if num_blocks is None:
            per_block = PagedKVCache.bytes_per_block(layer_range.num_layers, block_size, self.loaded.num_kv_heads,
                                                     self.loaded.head_dim, self.loaded.dtype)
            num_blocks = max(1, kv_cache_bytes // per_block)
        self.runner = ModelRunner(self.loaded, num_blocks, block_size, kv_allocator)
        self.layer_range = layer_range
        self.num_blocks = num_blocks
        self.block_size = block_size

    @property
    def is_last(self) -> bool:
        return self.loaded.is_last

    @property
    def hidden_size(self) -> int:
        return self.loaded.config.hidden_size

    @property
    def parameter_bytes(self) -> int:
        return self.loaded.parameter_bytes

    def view_kv(self, block_ids: list[int], num_tokens: int, layer: int):
        """One of this stage's layers' KV of `block_ids`, in place: (BlockSlice, KVLayout)."""
        if any(b >= self.num_blocks or b < 0 for b in block_ids):
            raise ValueError(f"blocks outside this stage's {self.num_blocks}")
        return self.runner.kv_cache.view_blocks(block_ids, num_tokens, layer, layer + 1)

    def execute(self, batch: StepBatch, hidden: torch.Tensor, after_layer=None) -> torch.Tensor:
        """Hidden states `(tokens, hidden)` in; hidden states out, or logits `(samples, vocab)` on the last stage.
        `after_layer(layer)` runs as each layer's KV is in the cache (to ship a prompt's KV layer by layer)."""
        if batch.block_size != self.block_size:
            raise ValueError(f"a step of block size {batch.block_size} reached a stage of block size {self.block_size}")
        if hidden.dim() != 2 or hidden.shape != (batch.num_tokens, self.hidden_size):
            raise ValueError(f"hidden states of shape {tuple(hidden.shape)} for a step of {batch.num_tokens} tokens "
                             f"(hidden size {self.hidden_size})")
        if any(b >= self.num_blocks or b < 0 for table in batch.block_tables for b in table):
            raise ValueError(f"a step names blocks outside this stage's {self.num_blocks}")
        return self.runner.execute(batch, hidden, after_layer)
