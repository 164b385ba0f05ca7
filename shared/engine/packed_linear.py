"""`y = x @ W.T + b` with W laid out once, at load, for the fastest kernel the device has.

On CPUs with oneDNN, a pre-packed (blocked) weight beats the plain GEMM.
Measured on a 135M model's 30 layers, 2 threads:
- bfloat16 (AVX512-BF16/AMX): 11-13 ms a step packed vs 17-22 ms plain, for 1 to 64 rows: packed only.
- float32 depends on the CPU for the few rows that single-stream decode runs. On an Intel Sapphire Rapids,
  packed is faster from 4 rows (16 rows: 41 vs 51 ms a step) but slower for 1-2 rows (31 vs 21 ms); on an
  AMD EPYC (Zen 4) packed wins from 1 row (25.6 vs 47.9 ms; MKL's plain GEMM there barely uses a second
  thread). So float32 keeps both layouts, and `tune_linear_layouts` times both on the loaded weights at
  start-up and picks the fewest rows from which packed serves; where that is one row, the plain copy (the
  linear weights held twice) is dropped.
- float32 with one to three rows is bound by reading the weights, and both GEMMs read them at about half of
  what a core streams. The native kernel (`kernels/small_linear.c`) reads the plain layout once, in order:
  on the Zen 4, one thread, 1-2 rows, 18 ms for 425 MB of linears against packed's 31-35 ms. The same
  timing at start-up gives it the row counts where it is faster (its rows keep the plain copy).
"""

import os
import time
from typing import NamedTuple

import torch

from shared.engine.kernels import all_threads_or_one, bf16_flag, native_library_for

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

    __slots__ = ("plain", "packed", "bias", "packed_min_rows", "native_max_rows", "native", "in_features",
                 "weight_bytes")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.in_features = weight.shape[1]
        self.weight_bytes = weight.numel() * weight.element_size()
        packs = weight.device.type == "cpu" and packs_on_cpu(weight.dtype)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT) if packs else None
        # (in, out) view for mm/addmm straight (no linear -> t -> matmul layers), and the native kernel's rows;
        # dropped by `tune_linear_layouts` when packed serves all rows. Bfloat16 keeps it only for the native kernel.
        native_candidate = packs and weight.dtype == torch.bfloat16 and _small_linear_kernels(weight) is not None
        keep_plain = not packs or weight.dtype == torch.float32 or native_candidate
        self.plain = weight.contiguous().t() if keep_plain else None
        self.packed_min_rows = FLOAT32_PACKED_MIN_ROWS if (packs and weight.dtype == torch.float32) else 0
        self.bias = None if bias is None else bias.contiguous()
        # Set by `tune_linear_layouts`: up to this many rows, the native kernel (`native`, the compiled library)
        # on the plain layout's rows.
        self.native_max_rows = 0
        self.native = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (rows, in) -> (rows, out)
        rows = x.shape[0]
        if 0 < rows <= self.native_max_rows and x.dtype == self.plain.dtype:  # the kernel reads x as W's type
            return self._native_linear(x)
        if self.packed is not None and rows >= self.packed_min_rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.bias is None:
            return torch.mm(x, self.plain)
        return torch.addmm(self.bias, x, self.plain)

    def _native_linear(self, x: torch.Tensor, library=None) -> torch.Tensor:
        """The native kernel's product (`library`: the compiled kernels, if not yet this linear's own)."""
        x = x.contiguous()
        out_features = self.plain.shape[1]
        y = x.new_empty(x.shape[0], out_features)
        (library or self.native).small_linear(x.data_ptr(), x.shape[0], self.in_features, self.plain.data_ptr(),
                                              None if self.bias is None else self.bias.data_ptr(), y.data_ptr(),
                                              out_features, bf16_flag(x),
                                              all_threads_or_one(True, torch.get_num_threads()))
        return y


def _small_linear_kernels(weight: torch.Tensor):
    """The compiled small-rows kernels where they can serve `weight` (a CPU float32 or bfloat16 one), else None."""
    return native_library_for("small_linear", weight.device, weight.dtype)


def fuse(weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> PackedLinear:
    """One linear computing several that share an input (q/k/v, gate/up): outputs side by side."""
    weight = torch.cat(weights) if len(weights) > 1 else weights[0]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else weight.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])
    return PackedLinear(weight, bias)


PACKED_MIN_ROWS_ENV = "SPLITSERVE_FLOAT32_PACKED_MIN_ROWS"  # set: no timing, this many rows (1 drops the plain copy)
NATIVE_MAX_ROWS_ENV = "SPLITSERVE_NATIVE_LINEAR_MAX_ROWS"  # set: no timing, the native kernel up to this many rows
_TUNED_ROWS = (1, 2, 3)  # from FLOAT32_PACKED_MIN_ROWS rows on, packed wins everywhere measured
_NATIVE_TUNED_ROWS = (1, 2, 3, 4, 6, 8)  # with more rows it is bound by its multiplies (a float32 one from ~4)
_TUNING_BYTES = 256 << 20  # time at least this much weight per try (or all of it): more than a CPU cache holds
_PACKED_MARGIN = 0.95  # packed must be this much faster to be chosen: a tie keeps the plain layout (and its copy)
_NATIVE_MARGIN = 0.95  # the native kernel too: a tie keeps the GEMM


class LinearLayouts(NamedTuple):
    """Which kernel serves a linear by its number of rows: the native kernel up to `native_max_rows` (0: none),
    the packed layout from `packed_min_rows`, the plain GEMM between (float32 only: in bfloat16 packed serves
    every row the native kernel does not)."""

    native_max_rows: int
    packed_min_rows: int


def tune_linear_layouts(linears: list[PackedLinear]) -> LinearLayouts | None:
    """Choose, for `linears` (a model's linears that keep both layouts: float32, and bfloat16 where the native
    kernel may serve), which kernel serves each number of rows, by timing them on this CPU; returns the choice
    (None: nothing to choose)."""
    linears = [lin for lin in linears if lin.packed is not None and lin.plain is not None]
    if not linears:
        return None
    dtype = linears[0].plain.dtype
    forced_packed = _forced_rows(PACKED_MIN_ROWS_ENV, minimum=1)
    forced_native = _forced_rows(NATIVE_MAX_ROWS_ENV, minimum=0)
    native = _small_linear_kernels(linears[0].plain)
    timed = _timing_sample(linears)
    native_max_rows = 0
    if native is not None:
        native_max_rows = forced_native if forced_native is not None else _fastest_native_max_rows(timed, native)
    if dtype != torch.float32:  # bfloat16: packed serves every other row count
        min_rows = native_max_rows + 1
    else:
        min_rows = forced_packed if forced_packed is not None else _fastest_packed_min_rows(timed, native_max_rows)
    for lin in linears:
        lin.packed_min_rows = min_rows
        lin.native_max_rows, lin.native = (native_max_rows, native) if native_max_rows else (0, None)
        if min_rows <= 1 and not native_max_rows:  # the plain rows serve nothing
            lin.plain, lin.packed_min_rows = None, 0
    return LinearLayouts(native_max_rows, min_rows)


def _forced_rows(variable: str, minimum: int) -> int | None:
    forced = os.environ.get(variable, "").strip()
    if not forced:
        return None
    if not (forced.isdigit() and int(forced) >= minimum):
        raise ValueError(f"{variable}={forced!r}: give a number of rows ({minimum} or more)")
    return int(forced)


def _timing_sample(linears: list[PackedLinear]) -> list[PackedLinear]:
    """Enough of `linears` that a timing reads their weights from memory, as a step does."""
    timed, total = [], 0
    for lin in linears:
        timed.append(lin)
        total += lin.weight_bytes
        if total >= _TUNING_BYTES:
            break
    return timed


def _inputs(linears: list[PackedLinear], rows: int) -> dict[int, torch.Tensor]:
    return {n: torch.randn(rows, n, dtype=linears[0].plain.dtype) for n in {lin.in_features for lin in linears}}


def _fastest_native_max_rows(linears: list[PackedLinear], native) -> int:
    """The most rows up to which the native kernel beats both GEMMs at every count (0: at none)."""
    best = 0
    for rows in _NATIVE_TUNED_ROWS:
        inputs = _inputs(linears, rows)
        gemm = _best_time(linears, inputs, "packed")
        if linears[0].plain.dtype == torch.float32:
            gemm = min(gemm, _best_time(linears, inputs, "plain"))
        if _best_time(linears, inputs, "native", native=native) >= gemm * _NATIVE_MARGIN:
            break
        best = rows
    return best


def _fastest_packed_min_rows(linears: list[PackedLinear], native_max_rows: int = 0) -> int:
    """The fewest rows (past those the native kernel serves) from which packed beats the plain GEMM."""
    for rows in _TUNED_ROWS:
        if rows <= native_max_rows:
            continue
        inputs = _inputs(linears, rows)
        if _best_time(linears, inputs, "packed") < _best_time(linears, inputs, "plain") * _PACKED_MARGIN:
            return rows
    return max(FLOAT32_PACKED_MIN_ROWS, native_max_rows + 1)


@torch.inference_mode()
def _best_time(linears: list[PackedLinear], inputs: dict[int, torch.Tensor], layout: str, repeats: int = 3,
               native=None) -> float:
    """The fastest of `repeats` passes over `linears` in `layout` ("packed", "plain" or "native")."""
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass warms oneDNN's primitive cache
        started = time.perf_counter()
        for lin in linears:
            x = inputs[lin.in_features]
            if layout == "packed":
                torch.ops.mkldnn._linear_pointwise(x, lin.packed, lin.bias, "none", [], "")
            elif layout == "native":
                lin._native_linear(x, native)
            elif lin.bias is None:
                torch.mm(x, lin.plain)
            else:
                torch.addmm(lin.bias, x, lin.plain)
        best = min(best, time.perf_counter() - started)
    return best
