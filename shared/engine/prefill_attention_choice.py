"""Which kernel attends a fresh prompt chunk (one with no cached prefix): the native paged kernel or torch's SDPA.

A chunk that continues a cached prefix needs its keys from the paged cache, which the native prefill kernel
reads in place; a fresh chunk's keys are the step's own, contiguous, so torch's flash SDPA can attend them
directly. Which is faster depends on the CPU: measured on one Intel Xeon with AMX, 1,600-token prompts of
SmolLM2-135M on 2 threads, bfloat16 0.38 s a prefill with SDPA (its kernel runs on AMX tiles) against 0.70 s
native, float32 1.55-1.83 s either way. On an AMD EPYC the native kernel won in float32 (a 1,600-token prompt's attention
0.96 -> 0.74-0.81 s). So each worker times both at start-up on its own shapes and dtype.
"""

from __future__ import annotations

import ctypes
import os
import time

import torch
import torch.nn.functional as F

FRESH_PREFILL_ENV = "SPLITSERVE_FRESH_PREFILL_ATTENTION"  # "native" or "sdpa": no timing
TIMING_TOKENS = 512  # one chunk of this many tokens per try: long enough that the kernels' own speed shows
TIMING_TRIES = 3  # the fastest of these counts
SDPA_MARGIN = 0.95  # SDPA must be this much faster to be chosen: a tie keeps the native kernel


def sdpa_serves_fresh_chunks(native_s: float, sdpa_s: float, margin: float = SDPA_MARGIN) -> bool:
    """The choice, given the fastest time of each on the same chunk."""
    return sdpa_s <= margin * native_s


def choose_fresh_prefill_attention(library: ctypes.CDLL | None, *, num_heads: int, num_kv_heads: int,
                                   head_dim: int, block_size: int, dtype: torch.dtype, device: torch.device,
                                   windowed: bool) -> bool:
    """True when fresh prompt chunks should go to SDPA (timed here unless `FRESH_PREFILL_ENV` says)."""
    if library is None:
        return True  # no native kernel: SDPA does every chunk anyway
    if windowed:
        return False  # a sliding window needs SDPA's explicit mask, which leaves its flash path
    forced = os.environ.get(FRESH_PREFILL_ENV, "").strip().lower()
    if forced:
        if forced not in ("native", "sdpa"):
            raise ValueError(f"{FRESH_PREFILL_ENV} must be 'native' or 'sdpa', not {forced!r}")
        return forced == "sdpa"
    native_s, sdpa_s = time_fresh_chunk(library, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                        block_size=block_size, dtype=dtype, device=device)
    return sdpa_serves_fresh_chunks(native_s, sdpa_s)


def time_fresh_chunk(library: ctypes.CDLL, *, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                     dtype: torch.dtype, device: torch.device, tokens: int = TIMING_TOKENS) -> tuple[float, float]:
    """(native, SDPA) seconds for one fresh chunk's causal attention, the fastest of `TIMING_TRIES` each."""
    from shared.engine.paged_attention import PrefillGroup, _native_prefill

    gen = torch.Generator(device="cpu").manual_seed(0)
    query = torch.randn(tokens, num_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    key = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    value = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    blocks = -(-tokens // block_size)
    key_cache = key.new_zeros(blocks * block_size, num_kv_heads, head_dim)
    value_cache = torch.zeros_like(key_cache)
    key_cache[:tokens], value_cache[:tokens] = key, value
    key_cache, value_cache = (c.view(blocks, block_size, num_kv_heads, head_dim) for c in (key_cache, value_cache))
    column = lambda v: torch.tensor([v], dtype=torch.long, device=device)  # noqa: E731
    group = PrefillGroup(query_starts=column(0), query_lens=column(tokens), context_lens=column(tokens),
                         block_tables=torch.arange(blocks, device=device)[None], num_query_tokens=tokens)
    scaling = head_dim ** -0.5
    out = torch.empty_like(query)
    q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))

    def native() -> None:
        _native_prefill(library, group, query, key_cache, value_cache, scaling, None, out)

    def sdpa() -> None:
        out.copy_(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)[0]
                  .transpose(0, 1))

    return _fastest(native), _fastest(sdpa)


def _fastest(fn) -> float:
    fn()  # first call: page faults, lazy initialisation
    best = float("inf")
    for _ in range(TIMING_TRIES):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
