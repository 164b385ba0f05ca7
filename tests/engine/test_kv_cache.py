"""PagedKVCache export/import, KVLayout, and build_step_batch: small CPU tensors, no model."""

import dataclasses

import msgspec
import pytest
import torch

from shared.engine.errors import EngineError
from shared.engine.kv_cache import KVLayout, PagedKVCache, dtype_name
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import ScheduledSequence, SchedulerOutput
from shared.engine.sequence import Sequence
from shared.engine.step_batch import StepBatch, build_step_batch

BLOCK_SIZE, HEADS, HEAD_DIM = 2, 2, 3


def make_cache(layer_start=0, layer_end=4, num_blocks=6, block_size=BLOCK_SIZE, heads=HEADS, head_dim=HEAD_DIM,
               dtype=torch.float32) -> PagedKVCache:
    return PagedKVCache(layer_start, layer_end, num_blocks, block_size, heads, head_dim, dtype, "cpu")


def filled_cache(**kwargs) -> PagedKVCache:
    cache = make_cache(**kwargs)
    cache.tensor.copy_(torch.arange(cache.tensor.numel(), dtype=torch.float32).reshape(cache.tensor.shape) + 1)
    return cache


def test_cache_shape_and_layer_views():
    cache = filled_cache(layer_start=2, layer_end=5)
    assert cache.tensor.shape == (3, 2, 6, BLOCK_SIZE, HEADS, HEAD_DIM)
    k, v = cache.layer(3)
    assert k.shape == (6, BLOCK_SIZE, HEADS, HEAD_DIM)
    assert torch.equal(k, cache.tensor[1, 0]) and torch.equal(v, cache.tensor[1, 1])
    k[0, 0, 0, 0] = -1.0  # a view, not a copy
    assert cache.tensor[1, 0, 0, 0, 0, 0] == -1.0
    assert PagedKVCache.bytes_per_block(3, BLOCK_SIZE, HEADS, HEAD_DIM, torch.float32) == (
        cache.tensor[:, :, 0].numel() * 4
    )


def test_layout_shape_bytes_and_dict_round_trip():
    layout = KVLayout(1, 3, 5, 16, 2, 64, "bfloat16", 70)
    assert layout.shape == (2, 2, 5, 16, 2, 64)
    assert layout.num_bytes == 2 * 2 * 5 * 16 * 2 * 64 * 2
    assert KVLayout(0, 4, 1, 4, 1, 8, "float32", 3).num_bytes == 4 * 2 * 4 * 8 * 4
    assert KVLayout.from_dict(layout.to_dict()) == layout
    assert dtype_name(torch.float16) == "float16" and dtype_name(torch.bfloat16) == "bfloat16"


def test_export_import_round_trip_with_other_block_ids_and_layer_subrange():
    src = filled_cache(layer_start=0, layer_end=4, num_blocks=6)
    data, layout = src.export_blocks([4, 1, 5], num_tokens=5, layer_start=1, layer_end=3)
    assert layout == KVLayout(1, 3, 3, BLOCK_SIZE, HEADS, HEAD_DIM, "float32", 5)
    assert tuple(data.shape) == layout.shape and data.is_contiguous()
    assert data.numel() * data.element_size() == layout.num_bytes
    expected = src.tensor[1:3][:, :, [4, 1, 5]]
    assert torch.equal(data, expected)
    # Export is a copy: later writes to the cache do not change it.
    src.tensor.zero_()
    assert torch.equal(data, expected)

    # A stage holding exactly layers [1, 3), with different block ids.
    stage = make_cache(layer_start=1, layer_end=3, num_blocks=5)
    stage.import_blocks([0, 3, 2], data, layout)
    assert torch.equal(stage.tensor[:, :, [0, 3, 2]], expected)
    assert torch.count_nonzero(stage.tensor[:, :, [1, 4]]) == 0
    back, back_layout = stage.export_blocks([0, 3, 2], 5)
    assert back_layout == layout and torch.equal(back, data)

    # A full cache importing only the layer sub-range leaves other layers untouched.
    full = make_cache(layer_start=0, layer_end=4, num_blocks=7)
    full.import_blocks([6, 0, 2], data, layout)
    assert torch.equal(full.tensor[1:3][:, :, [6, 0, 2]], expected)
    assert torch.count_nonzero(full.tensor[0]) == 0 and torch.count_nonzero(full.tensor[3]) == 0
    assert torch.count_nonzero(full.tensor[1:3][:, :, [1, 3, 4, 5]]) == 0


def test_export_defaults_to_all_layers_and_layout_survives_dict():
    src = filled_cache(layer_start=2, layer_end=4)
    data, layout = src.export_blocks([3], num_tokens=1)
    assert (layout.layer_start, layout.layer_end) == (2, 4)
    dst = make_cache(layer_start=2, layer_end=4)
    dst.import_blocks([5], data.clone(), KVLayout.from_dict(layout.to_dict()))
    assert torch.equal(dst.tensor[:, :, 5], src.tensor[:, :, 3])


def test_import_casts_to_cache_device_and_dtype_when_layout_matches():
    src = filled_cache(dtype=torch.float16)
    data, layout = src.export_blocks([2], 2)
    assert layout.dtype == "float16" and data.dtype == torch.float16
    dst = make_cache(dtype=torch.float16)
    dst.import_blocks([0], data, layout)
    assert torch.equal(dst.tensor[:, :, 0], src.tensor[:, :, 2])


@pytest.mark.parametrize(
    "dst_kwargs",
    [
        dict(dtype=torch.float16),  # dtype
        dict(dtype=torch.bfloat16),
        dict(block_size=4),  # block size
        dict(heads=1),  # shape
        dict(head_dim=4),
        dict(layer_start=2, layer_end=4),  # layers [1, 3) not within [2, 4)
        dict(layer_start=0, layer_end=2),  # layers [1, 3) not within [0, 2)
    ],
    ids=["dtype-f16", "dtype-bf16", "block_size", "kv_heads", "head_dim", "layers-above", "layers-below"],
)
def test_import_mismatch_raises(dst_kwargs):
    src = filled_cache()
    data, layout = src.export_blocks([1, 2], 4, layer_start=1, layer_end=3)
    dst = make_cache(**dst_kwargs)
    before = dst.tensor.clone()
    with pytest.raises(EngineError):
        dst.import_blocks([0, 1], data, layout)
    assert torch.equal(dst.tensor, before)


def test_import_mismatched_layout_fields_raise():
    src = filled_cache()
    data, layout = src.export_blocks([1, 2], 4)
    dst = make_cache()
    cases = [
        ([0], data, layout),  # fewer block ids than blocks
        ([0, 1, 2], data, layout),  # more block ids than blocks
        ([0, 1], data[:, :, :1], layout),  # data shorter than the layout says
        ([0], data[:, :, :1], layout),  # data matches block ids, layout.num_blocks does not
        ([0, 1], data, dataclasses.replace(layout, dtype="float16")),
        ([0, 1], data, dataclasses.replace(layout, block_size=4)),
        ([0, 1], data, dataclasses.replace(layout, layer_end=5)),  # beyond the cache
        ([0, 1], data, dataclasses.replace(layout, layer_start=2)),  # data has 4 layers, layout 2
        ([0, 1], data, dataclasses.replace(layout, layer_start=2, layer_end=2)),  # empty range
    ]
    for block_ids, d, lay in cases:
        with pytest.raises(EngineError):
            dst.import_blocks(block_ids, d, lay)
    assert torch.count_nonzero(dst.tensor) == 0


@pytest.mark.parametrize("layers", [(0, 5), (-1, 2), (2, 2), (3, 1)])
def test_export_layers_outside_cache_raise(layers):
    src = filled_cache(layer_start=0, layer_end=4)
    with pytest.raises(EngineError):
        src.export_blocks([0], 1, layer_start=layers[0], layer_end=layers[1])


# ---- build_step_batch -------------------------------------------------------------


def make_seq(tokens, rid, computed, block_table) -> Sequence:
    return Sequence(
        request_id=rid,
        token_ids=list(tokens),
        num_prompt_tokens=len(tokens),
        params=SamplingParams(),
        seed=0,
        max_total_tokens=1000,
        arrival_index=0,
        num_computed_tokens=computed,
        block_table=list(block_table),
    )


def slots(batch: StepBatch) -> list[int]:
    """Cache slot of every token, as the runner derives it from the batch."""
    out, offset = [], 0
    for table, qlen, ctx in zip(batch.block_tables, batch.query_lens, batch.context_lens):
        for pos in batch.positions[offset : offset + qlen]:
            assert pos < ctx
            out.append(table[pos // batch.block_size] * batch.block_size + pos % batch.block_size)
        offset += qlen
    return out


def test_build_step_batch_mixed_batch():
    bs = 4
    decode = make_seq(range(100, 109), "decode", 8, [5, 2, 7])  # 9 tokens, 8 computed
    chunk = make_seq(range(200, 210), "chunk", 0, [1, 3, 4])  # first chunk of a 10-token prompt
    last = make_seq(range(300, 307), "last", 4, [0, 6])  # last chunk of a 7-token prompt
    out = SchedulerOutput(
        [ScheduledSequence(decode, 1), ScheduledSequence(chunk, 6), ScheduledSequence(last, 3)]
    )
    batch = build_step_batch(out, bs)
    assert batch.request_ids == ["decode", "chunk", "last"]
    assert batch.token_ids == [108, 200, 201, 202, 203, 204, 205, 304, 305, 306]
    assert batch.positions == [8, 0, 1, 2, 3, 4, 5, 4, 5, 6]
    assert batch.query_lens == [1, 6, 3]
    assert batch.context_lens == [9, 6, 7]
    assert batch.block_tables == [[5, 2, 7], [1, 3], [0, 6]]  # only blocks the context reaches
    assert batch.sample_indices == [0, 2]  # the mid-prompt chunk is not sampled
    assert batch.num_tokens == 10 == out.num_batched_tokens
    assert batch.block_size == bs
    assert slots(batch) == [28, 4, 5, 6, 7, 12, 13, 24, 25, 26]  # block * block_size + offset
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=StepBatch) == batch
    # build_step_batch reads but never changes the sequences.
    assert decode.num_computed_tokens == 8 and chunk.num_computed_tokens == 0 and last.num_computed_tokens == 4


def test_build_step_batch_empty_and_prefix_hit():
    assert build_step_batch(SchedulerOutput(), 4).num_tokens == 0
    # A sequence admitted with a 2-block prefix hit computes from position 8.
    hit = make_seq(range(11), "hit", 8, [9, 4, 5])
    batch = build_step_batch(SchedulerOutput([ScheduledSequence(hit, 3)]), 4)
    assert batch.positions == [8, 9, 10] and batch.token_ids == [8, 9, 10]
    assert batch.context_lens == [11] and batch.sample_indices == [0]
    assert slots(batch) == [20, 21, 22]
