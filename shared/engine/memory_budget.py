"""How much of a GPU's memory the KV cache may take: vLLM's `--gpu-memory-utilization`.

A worker may use `utilization` of its GPU's total memory. Its weights and the peak of one full step of fresh
prompts (the whole token budget, over as many sequences as a step holds, each sampled) are measured once at
start-up, on a small KV cache; the KV cache then takes the rest. The measure is torch's caching allocator's peak
(`max_memory_reserved`): the CUDA context and other memory outside torch (a few hundred MiB) are not in it, which
is why a share below 1 is the norm.

Not in the measure: what attention gathers for long contexts where no native kernel reads the blocks in place (on
a GPU today: decodes' keys and values padded per group, and a continued prompt chunk's). Those grow with the
contexts served, so leave room for them in the share until the GPU has a paged attention kernel.
"""

from __future__ import annotations

from typing import Protocol

import torch


class DeviceMemory(Protocol):
    def total_bytes(self) -> int: ...

    def reset_peak(self) -> None: ...

    def peak_bytes(self) -> int: ...


class CudaMemory:
    """A CUDA device's memory, as torch's allocator sees it."""

    def __init__(self, device: torch.device):
        self.device = device

    def total_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.device)[1]

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_reserved(self.device)


def memory_of(device: torch.device) -> DeviceMemory:
    if device.type != "cuda":
        raise ValueError(f"--gpu-memory-utilization shares out a GPU's memory; this worker runs on {device.type} "
                         "(size its KV cache with --kv-cache-bytes)")
    return CudaMemory(device)


def kv_cache_bytes_within(total_bytes: int, utilization: float, used_bytes: int) -> int:
    """What is left for the KV cache of `utilization` * `total_bytes` once `used_bytes` (weights and a full step's
    peak) are set aside; ValueError when nothing is."""
    if not 0 < utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization is a share of the GPU's memory in (0, 1], got {utilization}")
    budget = int(total_bytes * utilization)
    if budget <= used_bytes:
        raise ValueError(f"--gpu-memory-utilization {utilization:g} gives this worker {_gib(budget)} of the GPU's "
                         f"{_gib(total_bytes)}, and its weights and a full step already take {_gib(used_bytes)}: "
                         "nothing is left for the KV cache (raise the share, or lower --max-num-batched-tokens)")
    return budget - used_bytes


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
