"""The paged KV cache tensors of one runner, and block export/import.

Storage is one tensor per runner, indexed
`[layer, k_or_v, block, slot_in_block, kv_head, head_dim]`, holding only the
runner's own layers. Export copies chosen blocks of chosen layers into one
contiguous tensor in the same order; import writes such a tensor back into
(possibly different) block ids. PD transfer, pipeline stages and the kv-store
move exactly these tensors plus their `KVLayout`.
"""

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from shared.engine.block_slice import BlockSlice
from shared.engine.errors import EngineError

# Makes a cache's storage: (shape, dtype, device) -> a zeroed tensor. The default is `torch.zeros`; a
# prefill worker passes one that puts the cache in shared memory, so the side channel can read blocks in place.
KVAllocator = Callable[[tuple[int, ...], torch.dtype, torch.device | str], torch.Tensor]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(slots=True, frozen=True)
class KVLayout:
    """What an exported KV tensor holds: shape `[layers, 2, blocks, block_size, kv_heads, head_dim]`."""

    layer_start: int  # absolute decoder-layer index of the first layer in the tensor
    layer_end: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_tokens: int  # tokens with valid KV, counted from the first exported block
    block_start: int = 0  # index, in the sequence's block table, of the first exported block

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.layer_end - self.layer_start, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def num_bytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * DTYPES[self.dtype].itemsize

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "KVLayout":
        return cls(**data)


class PagedKVCache:
    def __init__(
        self,
        layer_start: int,
        layer_end: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        allocator: KVAllocator | None = None,
    ):
        self.layer_start = layer_start
        self.layer_end = layer_end
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        num_layers = layer_end - layer_start
        # (layers, 2, blocks, block_size, kv_heads, head_dim)
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        if allocator is None:
            self.tensor = torch.zeros(shape, dtype=dtype, device=device)
        else:
            self.tensor = allocator(shape, dtype, device)
            if tuple(self.tensor.shape) != shape or self.tensor.dtype != dtype or not self.tensor.is_contiguous():
                raise EngineError(f"the KV allocator returned a {self.tensor.dtype} tensor of shape "
                                  f"{tuple(self.tensor.shape)}; expected a contiguous {dtype} one of shape {shape}")

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize

    def layer(self, absolute_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache) of one layer, each `[blocks, block_size, kv_heads, head_dim]`."""
        kv = self.tensor[absolute_layer - self.layer_start]
        return kv[0], kv[1]

    def _layer_slice(self, layer_start: int | None, layer_end: int | None) -> tuple[int, int]:
        start = self.layer_start if layer_start is None else layer_start
        end = self.layer_end if layer_end is None else layer_end
        if not self.layer_start <= start < end <= self.layer_end:
            raise EngineError(
                f"layers [{start}, {end}) are not within this cache's layers [{self.layer_start}, {self.layer_end})"
            )
        return start, end

    def export_blocks(
        self, block_ids: list[int], num_tokens: int, layer_start: int | None = None, layer_end: int | None = None
    ) -> tuple[torch.Tensor, KVLayout]:
        start, end = self._layer_slice(layer_start, layer_end)
        index = torch.tensor(block_ids, dtype=torch.long, device=self.tensor.device)
        local = self.tensor[start - self.layer_start : end - self.layer_start]
        data = local.index_select(2, index).contiguous()
        layout = KVLayout(
            start, end, len(block_ids), self.block_size, self.num_kv_heads, self.head_dim, dtype_name(self.dtype), num_tokens
        )
        return data, layout

    def view_blocks(
        self, block_ids: list[int], num_tokens: int, layer_start: int | None = None, layer_end: int | None = None
    ) -> tuple[BlockSlice, KVLayout]:
        """Like `export_blocks`, without copying: valid while the blocks are not reused."""
        start, end = self._layer_slice(layer_start, layer_end)
        local = self.tensor[start - self.layer_start : end - self.layer_start]
        layout = KVLayout(
            start, end, len(block_ids), self.block_size, self.num_kv_heads, self.head_dim, dtype_name(self.dtype), num_tokens
        )
        return BlockSlice(local, tuple(block_ids), 2), layout

    def import_blocks(self, block_ids: list[int], data: "torch.Tensor | BlockSlice", layout: KVLayout) -> None:
        start, end = self._layer_slice(layout.layer_start, layout.layer_end)
        expected = (end - start, 2, len(block_ids), self.block_size, self.num_kv_heads, self.head_dim)
        if layout.num_blocks != len(block_ids) or tuple(data.shape) != expected:
            raise EngineError(f"KV data of shape {tuple(data.shape)} does not fit {len(block_ids)} blocks {expected}")
        if (layout.num_kv_heads, layout.head_dim) != (self.num_kv_heads, self.head_dim):
            raise EngineError(
                f"KV layout ({layout.num_kv_heads} heads of {layout.head_dim}) does not match this cache "
                f"({self.num_kv_heads} heads of {self.head_dim})"
            )
        if dtype_name(data.dtype) != layout.dtype:
            raise EngineError(f"KV data is {dtype_name(data.dtype)} but its layout says {layout.dtype}")
        if layout.block_size != self.block_size or layout.dtype != dtype_name(self.dtype):
            raise EngineError(
                f"KV layout (block_size {layout.block_size}, {layout.dtype}) does not match this cache "
                f"(block_size {self.block_size}, {dtype_name(self.dtype)})"
            )
        local = self.tensor[start - self.layer_start : end - self.layer_start]
        if isinstance(data, BlockSlice):
            data.copy_into(local, block_ids)  # straight from the source's blocks: one copy
            return
        index = torch.tensor(block_ids, dtype=torch.long, device=self.tensor.device)
        local.index_copy_(2, index, data.to(device=self.tensor.device, dtype=self.dtype))
