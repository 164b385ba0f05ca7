"""`BlockSlice`: chosen blocks of a paged tensor, as a view rather than a copy.

A request's KV lives in scattered blocks of a runner's paged cache. Copying
it out into one contiguous tensor (to ship it) and then into the receiver's
blocks moves every byte twice; a `BlockSlice` names the blocks instead, so
the one copy that is needed can go straight from source blocks to
destination blocks. The side channel sends one as a descriptor when the
source lives in shared memory (the receiver copies out of it), and gathers
it into a buffer otherwise.

Logically a `BlockSlice` is `source.index_select(block_dim, block_ids)`: its
`shape` is the source's with `block_dim` resized to `len(block_ids)`. The
source must be contiguous (a paged cache, or a leading-dimension slice of one).
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class BlockSlice:
    source: torch.Tensor
    block_ids: tuple[int, ...]
    block_dim: int = 2

    def __post_init__(self):
        if not isinstance(self.source, torch.Tensor):
            raise TypeError(f"a BlockSlice's source is a tensor, got {type(self.source).__name__}")
        if not 0 <= self.block_dim < self.source.dim():
            raise ValueError(f"block_dim {self.block_dim} is not a dimension of a {self.source.dim()}-d tensor")
        if not self.source.is_contiguous():
            raise ValueError("a BlockSlice's source must be contiguous")
        num_blocks = self.source.shape[self.block_dim]
        ids = tuple(self.block_ids)
        if any(not isinstance(b, int) or not 0 <= b < num_blocks for b in ids):
            raise ValueError(f"block ids must be integers in [0, {num_blocks})")
        object.__setattr__(self, "block_ids", ids)

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.source.shape)
        shape[self.block_dim] = len(self.block_ids)
        return tuple(shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.source.dtype

    @property
    def device(self) -> torch.device:
        return self.source.device

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.source.element_size()

    def narrow(self, start: int, end: int) -> "BlockSlice":
        """The same blocks of leading-dimension entries [start, end) (layers, for a KV cache)."""
        if self.block_dim == 0:
            raise ValueError("cannot narrow along the block dimension")
        return BlockSlice(self.source[start:end], self.block_ids, self.block_dim)

    def runs(self) -> list[tuple[int, int, int]]:
        """Maximal runs of consecutive source blocks: (position in block_ids, first source block, count)."""
        return contiguous_runs(self.block_ids)

    def gather(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks copied into one contiguous tensor of `shape` (into `out` when given)."""
        index = torch.tensor(self.block_ids, dtype=torch.long, device=self.source.device)
        if out is None:
            return self.source.index_select(self.block_dim, index)
        return torch.index_select(self.source, self.block_dim, index, out=out)

    def copy_into(self, destination: torch.Tensor, block_ids: list[int] | tuple[int, ...]) -> None:
        """Copy the slice's blocks into `destination`'s blocks `block_ids` (same block_dim): one pass, by runs."""
        if len(block_ids) != len(self.block_ids):
            raise ValueError(f"{len(self.block_ids)} blocks cannot go into {len(block_ids)}")
        expected = list(self.source.shape)
        expected[self.block_dim] = destination.shape[self.block_dim]
        if list(destination.shape) != expected:
            raise ValueError(f"a destination of shape {tuple(destination.shape)} does not take blocks of a "
                             f"source of shape {tuple(self.source.shape)}")
        source = self.source  # copy_ converts dtype and device per run, if they differ
        for src_first, dst_first, count in paired_runs(self.block_ids, block_ids):
            destination.narrow(self.block_dim, dst_first, count).copy_(source.narrow(self.block_dim, src_first, count))


def contiguous_runs(block_ids) -> list[tuple[int, int, int]]:
    """(position, first id, count) for each maximal run of consecutive ids."""
    runs = []
    position = 0
    while position < len(block_ids):
        count = 1
        while position + count < len(block_ids) and block_ids[position + count] == block_ids[position] + count:
            count += 1
        runs.append((position, block_ids[position], count))
        position += count
    return runs


def paired_runs(source_ids, destination_ids) -> list[tuple[int, int, int]]:
    """(first source id, first destination id, count) for each maximal run consecutive on both sides."""
    runs = []
    position = 0
    while position < len(source_ids):
        count = 1
        while (position + count < len(source_ids)
               and source_ids[position + count] == source_ids[position] + count
               and destination_ids[position + count] == destination_ids[position] + count):
            count += 1
        runs.append((source_ids[position], destination_ids[position], count))
        position += count
    return runs
