"""`y = x @ W.T + b` with W laid out once, at load, for the fastest kernel the device has.

On CPUs with oneDNN, a pre-packed (blocked) weight beats the plain GEMM.
Measured on a 135M model's 30 layers, 2 threads:
- bfloat16 (AVX512-BF16/AMX): 11-13 ms a step packed vs 17-22 ms plain, for 1 to 64 rows: packed only.
- float32 depends on the CPU for the few rows that single-stream decode runs. On an Intel Sapphire Rapids,
  packed is faster from 4 rows (16 rows: 41 vs 51 ms a step) but slower for 1-2 rows (31 vs 21 ms); on an
  AMD EPYC (Zen 4) packed wins from 1 row (25.6 vs 47.9 ms; MKL's plain GEMM there barely uses a second
  thread). So float32 keeps both layouts, and `tune_float32_layouts` times both on the loaded weights at
  start-up and picks the fewest rows from which packed serves; where that is one row, the plain copy (the
  linear weights held twice) is dropped.
"""

import os
import time

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

    __slots__ = ("plain", "packed", "bias", "packed_min_rows", "in_features", "weight_bytes")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.in_features = weight.shape[1]
        self.weight_bytes = weight.numel() * weight.element_size()
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


PACKED_MIN_ROWS_ENV = "SPLITSERVE_FLOAT32_PACKED_MIN_ROWS"  # set: no timing, this many rows (1 drops the plain copy)
_TUNED_ROWS = (1, 2, 3)  # from FLOAT32_PACKED_MIN_ROWS rows on, packed wins everywhere measured
_TUNING_BYTES = 256 << 20  # time at least this much weight per try (or all of it): more than a CPU cache holds
_PACKED_MARGIN = 0.95  # packed must be this much faster to be chosen: a tie keeps the plain layout (and its copy)


def tune_float32_layouts(linears: list[PackedLinear]) -> int | None:
    """Choose, for `linears` (a model's float32 linears that keep both layouts), the fewest rows from which
    the packed layout serves, by timing both on this CPU; returns it (None: nothing to choose)."""
    linears = [lin for lin in linears if lin.packed is not None and lin.plain is not None]
    if not linears:
        return None
    forced = os.environ.get(PACKED_MIN_ROWS_ENV, "").strip()
    if forced and not (forced.isdigit() and int(forced) >= 1):
        raise ValueError(f"{PACKED_MIN_ROWS_ENV}={forced!r}: give a number of rows (1 or more)")
    min_rows = int(forced) if forced else _fastest_packed_min_rows(linears)
    for lin in linears:
        lin.packed_min_rows = min_rows
        if min_rows <= 1:
            lin.plain, lin.packed_min_rows = None, 0
    return min_rows


def _fastest_packed_min_rows(linears: list[PackedLinear]) -> int:
    timed, total = [], 0
    for lin in linears:  # enough weights that the timing reads them from memory, as a step does
        timed.append(lin)
        total += lin.weight_bytes
        if total >= _TUNING_BYTES:
            break
    for rows in _TUNED_ROWS:
        inputs = {n: torch.randn(rows, n, dtype=timed[0].plain.dtype) for n in {lin.in_features for lin in timed}}
        packed, plain = _best_time(timed, inputs, packed=True), _best_time(timed, inputs, packed=False)
        if packed < plain * _PACKED_MARGIN:
            return rows
    return FLOAT32_PACKED_MIN_ROWS


@torch.inference_mode()
def _best_time(linears: list[PackedLinear], inputs: dict[int, torch.Tensor], packed: bool, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass warms oneDNN's primitive cache
        started = time.perf_counter()
        for lin in linears:
            x = inputs[lin.in_features]
            if packed:
                torch.ops.mkldnn._linear_pointwise(x, lin.packed, lin.bias, "none", [], "")
            elif lin.bias is None:
                torch.mm(x, lin.plain)
            else:
                torch.addmm(lin.bias, x, lin.plain)
        best = min(best, time.perf_counter() - started)
    return best
