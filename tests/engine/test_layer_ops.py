"""The compiled layer ops compute what transformers' modules do, in float32 and bfloat16."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from shared.engine.kernels import native_library
from shared.engine.layer_ops import NativeLayerOps, TorchLayerOps
from support.kernels import needs_native

pytestmark = needs_native("layer_ops")

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


@pytest.fixture
def native():
    return NativeLayerOps(native_library("layer_ops"))


def _randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_transformers_rmsnorm_of_the_sum(native, dtype):
    x, residual = _randn(5, 96, dtype=dtype), _randn(5, 96, dtype=dtype, seed=1)
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    norm.weight.data = _randn(96, dtype=dtype, seed=2)
    expected_residual = residual + x
    expected = norm(expected_residual)
    out, new_residual = native.add_rms_norm(x.clone(), residual.clone(), norm.weight, 1e-5)
    torch.testing.assert_close(new_residual, expected_residual, rtol=0, atol=0)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def test_first_layer_norm_leaves_its_input_alone(native):
    x, weight = _randn(3, 64, dtype=torch.float32), _randn(64, dtype=torch.float32, seed=1)
    before = x.clone()
    out, residual = native.add_rms_norm(x, None, weight, 1e-6)
    torch.testing.assert_close(x, before, rtol=0, atol=0)
    torch.testing.assert_close(residual, before, rtol=0, atol=0)
    torch.testing.assert_close(out, TorchLayerOps().add_rms_norm(before, None, weight, 1e-6)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_transformers_rotary_on_a_strided_view(native, dtype):
    tokens, heads, kv_heads, head_dim = 4, 6, 2, 32
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    cos, sin = _randn(tokens, head_dim, dtype=dtype, seed=1), _randn(tokens, head_dim, dtype=dtype, seed=2)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    # transformers: (batch, heads, T, head_dim) with cos/sin (batch, T, head_dim)
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    qk = native.rotary(qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim), cos, sin)
    torch.testing.assert_close(qk[:, :heads], q_ref[0].transpose(0, 1), **TOLERANCE[dtype])
    torch.testing.assert_close(qk[:, heads:], k_ref[0].transpose(0, 1), **TOLERANCE[dtype])
    torch.testing.assert_close(qkv[:, (heads + kv_heads) * head_dim :], _randn(
        tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)[:, (heads + kv_heads) * head_dim :], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(native, dtype):
    gate_up = _randn(7, 2 * 40, dtype=dtype) * 8  # large enough to reach silu's saturated ends
    torch.testing.assert_close(native.silu_and_mul(gate_up), TorchLayerOps().silu_and_mul(gate_up), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_split_over_threads_give_the_same_bits(native, dtype, monkeypatch):
    """A prompt's rows run on several threads, a decode step's few on one: the results must not differ."""
    import shared.engine.layer_ops as layer_ops

    rows, hidden, heads, head_dim = 37, 96, 5, 32  # rows not a multiple of the thread count
    x, residual, weight = _randn(rows, hidden, dtype=dtype), _randn(rows, hidden, dtype=dtype, seed=1), _randn(
        hidden, dtype=dtype, seed=2)
    qk, cos, sin = (_randn(rows, heads, head_dim, dtype=dtype, seed=3), _randn(rows, head_dim, dtype=dtype, seed=4),
                    _randn(rows, head_dim, dtype=dtype, seed=5))
    gate_up = _randn(rows, 2 * hidden, dtype=dtype, seed=6) * 8

    def run_all():
        normed, summed = native.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
        first, _ = native.add_rms_norm(x, None, weight, 1e-5)
        return normed, summed, first, native.rotary(qk.clone(), cos, sin), native.silu_and_mul(gate_up)

    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = run_all()
        torch.set_num_threads(3)
        monkeypatch.setattr(layer_ops, "ELEMENTS_TO_SPLIT", 1)
        assert layer_ops.layer_op_threads(rows * hidden, torch.get_num_threads()) == 3
        split = run_all()
    finally:
        torch.set_num_threads(previous)
    for a, b in zip(alone, split):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_layer_op_threads_follow_the_work():
    from shared.engine.layer_ops import ELEMENTS_TO_SPLIT, layer_op_threads

    assert layer_op_threads(16 * 576, 2) == 1  # a decode step's rows: one thread
    assert layer_op_threads(2048 * 576, 2) == 2  # a prompt's: every thread
    assert layer_op_threads(ELEMENTS_TO_SPLIT, 16) == 16  # every one or one, never some
    assert layer_op_threads(0, 4) == 1
