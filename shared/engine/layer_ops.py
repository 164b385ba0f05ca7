"""A decoder layer's small ops: residual add + RMSNorm, rotary embedding, SiLU-and-multiply.

`NativeLayerOps` runs each as one pass of compiled C (`kernels/layer_ops.c`),
where torch needs several kernels and their dispatch: on a 135M model's
decode step that is ~15 fewer ops a layer. `TorchLayerOps` is the same math in
torch, for other devices and dtypes and where no compiler is found.
"""

import ctypes

import torch
import torch.nn.functional as F

from shared.engine.kernels import all_threads_or_one, bf16_flag, native_library_for


class TorchLayerOps:
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, residual): `residual + x` (or `x` alone when `residual` is None), and its weighted RMSNorm."""
        residual = x if residual is None else residual + x
        return torch.rms_norm(residual, (residual.shape[-1],), weight, eps), residual

    def rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`qk` (T, heads, head_dim) rotated by `cos`/`sin` (T, head_dim)."""
        half = qk.shape[-1] // 2
        rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
        return qk * cos[:, None, :] + rotated * sin[:, None, :]

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        half = gate_up.shape[-1] // 2
        return F.silu(gate_up[:, :half]) * gate_up[:, half:]


# From this many values a native layer op is split over every thread torch computes with (a prompt's rows);
# below it, waking the others costs more than it saves (a decode step's few rows run on one thread).
ELEMENTS_TO_SPLIT = 1 << 16


def layer_op_threads(elements: int, max_threads: int) -> int:
    """Threads (of torch's OpenMP pool) for a native layer op over `elements` values: one or all of them."""
    return all_threads_or_one(elements >= ELEMENTS_TO_SPLIT, max_threads)


class NativeLayerOps(TorchLayerOps):
    """In place where the torch ops allocate; inputs must be contiguous CPU float32 or bfloat16."""

    def __init__(self, library: ctypes.CDLL):
        self.lib = library

    def add_rms_norm(self, x, residual, weight, eps):
        add_residual = int(residual is not None)
        if residual is None:  # the first layer: its input starts the residual stream (copied: it is the caller's)
            residual, x = x.clone(), torch.empty_like(x)
        self.lib.add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), residual.shape[0],
                              residual.shape[1], eps, add_residual, bf16_flag(x), _threads(residual))
        return x, residual

    def rotary(self, qk, cos, sin):
        tokens, heads, head_dim = qk.shape
        self.lib.rotary(qk.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, heads, head_dim, qk.stride(0),
                        bf16_flag(qk), _threads(qk))
        return qk

    def silu_and_mul(self, gate_up):
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        self.lib.silu_and_mul(gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1], bf16_flag(gate_up),
                              _threads(gate_up))
        return out


def _threads(tensor: torch.Tensor) -> int:
    return layer_op_threads(tensor.numel(), torch.get_num_threads())


def layer_ops_for(device: torch.device, dtype: torch.dtype) -> TorchLayerOps:
    """The native ops where they run (CPU, float32 or bfloat16, a compiler found), else torch's."""
    library = native_library_for("layer_ops", device, dtype)
    return NativeLayerOps(library) if library is not None else TorchLayerOps()
