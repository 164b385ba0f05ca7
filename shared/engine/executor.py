"""Runs a step on one runner, or on a chain of layer-range runners in order."""

import torch

from shared.engine.block_slice import BlockSlice
from shared.engine.kv_cache import KVLayout, dtype_name
from shared.engine.model_runner import ModelRunner
from shared.engine.step_batch import StepBatch


class ChainExecutor:
    """Hidden states flow from each range's runner to the next; the last returns logits."""

    def __init__(self, runners: list[ModelRunner]):
        if not runners:
            raise ValueError("at least one runner is needed")
        for before, after in zip(runners, runners[1:]):
            if before.loaded.layer_range.end != after.loaded.layer_range.start:
                raise ValueError("layer ranges must be contiguous")
        self.runners = runners

    def execute(self, batch: StepBatch, after_layer=None) -> torch.Tensor:
        hidden = None
        for runner in self.runners:
            hidden = runner.execute(batch, hidden, after_layer)
        return hidden

    def resize_kv(self, num_blocks: int) -> None:
        for runner in self.runners:
            runner.resize_kv(num_blocks)

    def kv_layout(self, layer_start: int, layer_end: int, num_blocks: int, num_tokens: int) -> KVLayout:
        """How these runners' caches lay out `num_blocks` blocks of those layers' KV for `num_tokens` tokens."""
        cache = self.runners[0].kv_cache
        return KVLayout(layer_start, layer_end, num_blocks, cache.block_size, cache.num_kv_heads, cache.head_dim,
                        dtype_name(cache.dtype), num_tokens)

    def kv_tensors(self) -> list[torch.Tensor]:
        """Each runner's whole KV cache tensor (to tell where the caches live: in a shared-memory region?)."""
        return [runner.kv_cache.tensor for runner in self.runners]

    def export_kv(self, block_ids: list[int], num_tokens: int, layer_start: int, layer_end: int) -> tuple[torch.Tensor, KVLayout]:
        parts = []
        for runner in self.runners:
            cache = runner.kv_cache
            start, end = max(layer_start, cache.layer_start), min(layer_end, cache.layer_end)
            if start < end:
                parts.append(cache.export_blocks(block_ids, num_tokens, start, end))
        layout = parts[0][1]
        data = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        return data, KVLayout(
            layer_start, layer_end, layout.num_blocks, layout.block_size,
            layout.num_kv_heads, layout.head_dim, layout.dtype, num_tokens,
        )

    def view_kv(self, block_ids: list[int], num_tokens: int, layer_start: int, layer_end: int) -> tuple[BlockSlice, KVLayout]:
        """The blocks of layers [layer_start, layer_end), in place; the layers must lie in one runner."""
        for runner in self.runners:
            cache = runner.kv_cache
            if cache.layer_start <= layer_start and layer_end <= cache.layer_end:
                return cache.view_blocks(block_ids, num_tokens, layer_start, layer_end)
        raise ValueError(f"layers [{layer_start}, {layer_end}) span more than one layer range")

    def import_kv(self, block_ids: list[int], data: "torch.Tensor | BlockSlice", layout: KVLayout) -> None:
        for runner in self.runners:
            cache = runner.kv_cache
            start, end = max(layout.layer_start, cache.layer_start), min(layout.layer_end, cache.layer_end)
            if start < end:
                first, last = start - layout.layer_start, end - layout.layer_start
                part = data.narrow(first, last) if isinstance(data, BlockSlice) else data[first:last]
                sub = KVLayout(start, end, layout.num_blocks, layout.block_size,
                               layout.num_kv_heads, layout.head_dim, layout.dtype, layout.num_tokens)
                cache.import_blocks(block_ids, part, sub)
