"""BlockSlice: a view of chosen blocks, its runs, chunks, gather and one-pass copy into other blocks."""

import pytest
import torch

from shared.engine.block_slice import BlockSlice, contiguous_runs, paired_runs
from shared.engine.kv_cache import PagedKVCache


def numbered(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape).to(dtype) + 1


def test_runs_split_where_either_side_jumps():
    assert contiguous_runs([]) == []
    assert contiguous_runs([3, 4, 5, 9, 2, 3]) == [(0, 3, 3), (3, 9, 1), (4, 2, 2)]
    assert paired_runs([3, 4, 5, 6], [0, 1, 7, 8]) == [(3, 0, 2), (5, 7, 2)]
    assert paired_runs([1, 2], [5, 4]) == [(1, 5, 1), (2, 4, 1)]


@pytest.mark.parametrize("ids", [(0,), (4, 1, 5), (1, 2, 3), (5, 4, 3, 2, 1, 0)])
def test_gather_and_copy_into_equal_index_select(ids):
    source = numbered(3, 2, 6, 2, 2, 3)
    view = BlockSlice(source, ids)
    expected = source.index_select(2, torch.tensor(ids))
    assert view.shape == tuple(expected.shape) and view.nbytes == expected.numel() * 4
    assert torch.equal(view.gather(), expected)
    out = torch.empty(view.shape)
    assert torch.equal(view.gather(out=out), expected) and torch.equal(out, expected)

    destination = torch.zeros(3, 2, 8, 2, 2, 3)
    targets = [7, 0, 1, 2, 3, 4][: len(ids)]
    view.copy_into(destination, targets)
    assert torch.equal(destination.index_select(2, torch.tensor(targets)), expected)
    untouched = [b for b in range(8) if b not in targets]
    assert not destination.index_select(2, torch.tensor(untouched)).any()


def test_copy_into_converts_dtype_and_checks_shapes():
    source = numbered(2, 2, 4, 2, 1, 2)
    destination = torch.zeros(2, 2, 5, 2, 1, 2, dtype=torch.bfloat16)
    BlockSlice(source, (2, 3)).copy_into(destination, [0, 1])
    assert torch.equal(destination[:, :, :2], source[:, :, 2:4].to(torch.bfloat16))
    with pytest.raises(ValueError, match="cannot go into"):
        BlockSlice(source, (2, 3)).copy_into(destination, [0])
    with pytest.raises(ValueError, match="does not take blocks"):
        BlockSlice(source, (2,)).copy_into(torch.zeros(2, 2, 5, 2, 2, 2), [0])


def test_narrow_keeps_the_blocks_of_fewer_layers():
    source = numbered(2, 2, 6, 2, 1, 2)
    view = BlockSlice(source, (1, 2, 5))
    narrowed = view.narrow(1, 2)
    assert narrowed.block_ids == view.block_ids and torch.equal(narrowed.gather(), view.gather()[1:2])


def test_bad_slices_are_refused():
    source = numbered(2, 2, 4, 2, 1, 2)
    with pytest.raises(ValueError, match="block ids"):
        BlockSlice(source, (4,))
    with pytest.raises(ValueError, match="block ids"):
        BlockSlice(source, (-1,))
    with pytest.raises(ValueError, match="contiguous"):
        BlockSlice(source.transpose(0, 1), (0,))
    with pytest.raises(ValueError, match="block_dim"):
        BlockSlice(source, (0,), block_dim=6)


def test_cache_view_is_live_and_imports_like_an_export():
    src = PagedKVCache(0, 4, 6, 2, 2, 3, torch.float32, "cpu")
    src.tensor.copy_(numbered(*src.tensor.shape))
    view, layout = src.view_blocks([4, 1, 5], num_tokens=5, layer_start=1, layer_end=3)
    exported, same_layout = src.export_blocks([4, 1, 5], num_tokens=5, layer_start=1, layer_end=3)
    assert layout == same_layout and torch.equal(view.gather(), exported)
    dst = PagedKVCache(0, 4, 7, 2, 2, 3, torch.float32, "cpu")
    dst.import_blocks([0, 6, 2], view, layout)
    assert torch.equal(dst.tensor[1:3][:, :, [0, 6, 2]], exported)
    src.tensor.zero_()  # a view, not a copy
    assert not view.gather().any()


def test_cache_allocator_is_used_and_checked():
    made = []

    def allocator(shape, dtype, device):
        made.append(torch.zeros(shape, dtype=dtype, device=device))
        return made[-1]

    cache = PagedKVCache(0, 2, 3, 2, 1, 4, torch.float32, "cpu", allocator)
    assert cache.tensor is made[0]
    from shared.engine.errors import EngineError
    with pytest.raises(EngineError, match="allocator"):
        PagedKVCache(0, 2, 3, 2, 1, 4, torch.float32, "cpu", lambda shape, dtype, device: torch.zeros(3))
