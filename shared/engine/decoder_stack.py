"""The decoder layers of one layer range as a few tensor ops each, over fused weights.

transformers' modules spend most of a small model's decode step in Python and
per-op dispatch (module calls, reshapes, a rotary helper, an attention
registry, ~90 ops a layer). Here each layer is ~10 ops: q/k/v in one linear,
gate/up in one linear, fused residual add + RMSNorm, rotary on q and k together,
and weights packed for the CPU's matrix units where that is faster
(`packed_linear`). Residual add + RMSNorm, rotary and SiLU-and-multiply run as one
compiled pass each where they can (`layer_ops`). The math is transformers'
(same operations per element, bfloat16 rounding included), so greedy float32
output stays token-identical; the modules' weights are moved here at build
time and the modules dropped.

Families: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm per head).
"""

from dataclasses import dataclass

import torch

from shared.engine.errors import ModelLoadError
from shared.engine.layer_ops import layer_ops_for
from shared.engine.packed_linear import PackedLinear, fuse
from shared.engine.paged_attention import PagedAttentionMetadata, paged_attention


@dataclass(slots=True)
class DecoderLayerWeights:
    index: int  # absolute decoder-layer index (its KV cache layer)
    input_norm: torch.Tensor  # (hidden,)
    qkv: PackedLinear  # hidden -> (heads + 2 * kv_heads) * head_dim
    q_norm: torch.Tensor | None  # (head_dim,), Qwen3
    k_norm: torch.Tensor | None
    o_proj: PackedLinear
    post_norm: torch.Tensor
    gate_up: PackedLinear  # hidden -> 2 * intermediate
    down: PackedLinear
    sliding_window: int | None
    scaling: float


def layer_sliding_window(config, layer_index: int) -> int | None:
    """The attention window of one layer (None: full causal attention), as the family's modules decide it."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return config.sliding_window if layer_types[layer_index] == "sliding_attention" else None
    if config.model_type == "mistral":
        return getattr(config, "sliding_window", None)
    return None


class DecoderStack:
    """Runs a range's decoder layers on a flat batch `(tokens, hidden)`."""

    def __init__(self, config, layers: list[torch.nn.Module], layer_start: int, device: torch.device,
                 dtype: torch.dtype):
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ModelLoadError(f"hidden_act {config.hidden_act!r} is not supported (silu only)")
        self.eps = config.rms_norm_eps
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.intermediate = config.intermediate_size
        self.layers = [self._take_weights(config, layer, index) for index, layer in enumerate(layers, start=layer_start)]
        self.ops = layer_ops_for(device, dtype)

    def _take_weights(self, config, layer: torch.nn.Module, index: int) -> DecoderLayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        q_norm = getattr(attn, "q_norm", None)
        k_norm = getattr(attn, "k_norm", None)
        return DecoderLayerWeights(
            index=index,
            input_norm=layer.input_layernorm.weight,
            qkv=fuse([p.weight for p in projections], [p.bias for p in projections]),
            q_norm=None if q_norm is None else q_norm.weight,
            k_norm=None if k_norm is None else k_norm.weight,
            o_proj=PackedLinear(attn.o_proj.weight, attn.o_proj.bias),
            post_norm=layer.post_attention_layernorm.weight,
            gate_up=fuse([mlp.gate_proj.weight, mlp.up_proj.weight], [mlp.gate_proj.bias, mlp.up_proj.bias]),
            down=PackedLinear(mlp.down_proj.weight, mlp.down_proj.bias),
            sliding_window=layer_sliding_window(config, index),
            scaling=attn.scaling,
        )

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, metadata: PagedAttentionMetadata,
                after_layer=None) -> torch.Tensor:
        """`hidden` (T, hidden); `cos`/`sin` (T, head_dim) for the tokens' positions."""
        tokens = hidden.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        ops, eps = self.ops, self.eps
        x, residual = hidden.contiguous(), None
        for w in self.layers:
            # Attention block: x = norm(residual += x), then q/k/v, rotary, paged attention, output projection.
            x, residual = ops.add_rms_norm(x, residual, w.input_norm, eps)
            qkv = w.qkv(x)  # (T, (heads + 2 kv_heads) * head_dim)
            qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
            v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
            if w.q_norm is not None:
                qk = torch.cat([torch.rms_norm(qk[:, :heads], (head_dim,), w.q_norm, eps),
                                torch.rms_norm(qk[:, heads:], (head_dim,), w.k_norm, eps)], dim=1)
            qk = ops.rotary(qk, cos, sin)  # q and k at once
            attn = paged_attention(metadata, w.index, qk[:, :heads], qk[:, heads:], v, w.scaling, w.sliding_window)
            x = w.o_proj(attn.view(tokens, heads * head_dim))
            # MLP block.
            x, residual = ops.add_rms_norm(x, residual, w.post_norm, eps)
            x = w.down(ops.silu_and_mul(w.gate_up(x)))
            if after_layer is not None:
                after_layer(w.index)
        return x if residual is None else residual + x
