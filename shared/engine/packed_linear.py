"""`y = x @ W.T + b` with W laid out once, at load, for the fastest kernel the device has.

On CPUs with oneDNN, a pre-packed (blocked) weight beats the plain GEMM.
Measured here on a 135M model's 30 layers, 2 threads:
- bfloat16 (AVX512-BF16/AMX): 11-13 ms a step packed vs 17-22 ms plain, for 1 to 64 rows: packed only.
- float32: packed is faster from 4 rows (16 rows: 41 vs 51 ms a step) but slower for 1-2 rows (31 vs 21 ms),
  the single-stream decode users feel most. Float32 keeps both layouts and picks by the number of rows,
  at the cost of holding its linear weights twice.
"""

import torch

# oneDNN chooses its blocking for this many rows; the packed weight serves any number of rows.
PACK_ROWS_HINT = 64
# Float32: fewer rows than this use the plain layout.
FLOAT32_PACKED_MIN_ROWS = 4


def packs_on_cpu(dtype: torch.dtype) -> bool:
    """True when this CPU runs (some) `dtype` linears faster from a packed weight."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear:
    """A linear layer's weight (out_features, in_features) and optional bias, ready to apply."""

    __slots__ = ("plain", "packed", "bias", "packed_min_rows")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        packs = weight.device.type == "cpu" and packs_on_cpu(weight.dtype)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT) if packs else None
        # (in, out) view for mm/addmm straight (no linear -> t -> matmul layers); dropped when packed serves all rows.
        keep_plain = not packs or weight.dtype == torch.float32
        self.plain = weight.contiguous().t() if keep_plain else None
        self.packed_min_rows = FLOAT32_PACKED_MIN_ROWS if (packs and keep_plain) else 0
        self.bias = None if bias is None else bias.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (rows, in) -> (rows, out)
        if self.packed is not None and x.shape[0] >= self.packed_min_rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.bias is None:
            return torch.mm(x, self.plain)
        return torch.addmm(self.bias, x, self.plain)


def fuse(weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> PackedLinear:
    """One linear computing several that share an input (q/k/v, gate/up): outputs side by side."""
    weight = torch.cat(weights) if len(weights) > 1 else weights[0]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else weight.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])
    return PackedLinear(weight, bias)
