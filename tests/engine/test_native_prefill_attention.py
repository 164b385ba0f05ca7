"""The compiled prefill attention kernel agrees with the torch path (one SDPA per prompt chunk) on the same
paged cache: whole prompts, chunks that continue a cached prefix, several at once, windows, GQA groups."""

import random
from types import SimpleNamespace

import pytest
import torch

from shared.engine.kv_cache import PagedKVCache
from shared.engine.paged_attention import (PagedAttentionMetadata, PrefillGroup, PrefillSpan, native_prefill_library,
                                           paged_attention)
from support.kernels import needs_native

needs_kernel = needs_native("paged_prefill")


def _prefill_step(dtype, num_heads, num_kv_heads, head_dim, spans, window, native: bool, seed: int = 0,
                  implementation: str = "fastest", native_only: list[int] | None = None):
    """`spans`: (query_len, context_len) per sequence; context_len > query_len continues a cached prefix.
    With `native`, the kernel attends every span, or only those of `native_only` (SDPA the rest), with its
    `implementation`: the fastest the build has, or the one named (`simd_float`, `portable`)."""
    gen = torch.Generator().manual_seed(seed)
    block_size = 16
    tables_needed = [-(-ctx // block_size) for _, ctx in spans]
    num_blocks = sum(tables_needed) + 4
    cache = PagedKVCache(0, 1, num_blocks, block_size, num_kv_heads, head_dim, dtype, "cpu")
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=gen).to(dtype))
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in tables_needed]
    tokens = sum(q for q, _ in spans)
    qk = torch.randn(tokens, num_heads + num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    on_kernel = set(range(len(spans)) if native_only is None else native_only) if native else set()
    slots, sdpa_spans, kernel_spans, kernel_tables, start = [], [], [], [], 0
    for i, ((query_len, context_len), table) in enumerate(zip(spans, tables)):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(context_len - query_len, context_len)]
        if i in on_kernel:
            kernel_spans.append(PrefillSpan(start, query_len, context_len, None))
            kernel_tables.append(table)
        else:
            block_ids = torch.tensor(table) if context_len > query_len else None
            sdpa_spans.append(PrefillSpan(start, query_len, context_len, block_ids))
        start += query_len
    group = library = None
    if kernel_spans:
        width = max(len(t) for t in kernel_tables)
        group = PrefillGroup(query_starts=torch.tensor([s.query_start for s in kernel_spans]),
                             query_lens=torch.tensor([s.query_len for s in kernel_spans]),
                             context_lens=torch.tensor([s.context_len for s in kernel_spans]),
                             block_tables=torch.tensor([t + [0] * (width - len(t)) for t in kernel_tables]),
                             num_query_tokens=sum(s.query_len for s in kernel_spans))
        library = native_prefill_library(cache)
        if implementation != "fastest":  # what serves where AVX512-BF16 (simd_float) or AVX-512 (portable) does not
            library = SimpleNamespace(
                paged_prefill_attention=getattr(library, f"paged_prefill_attention_{implementation}"))
    # Each chunk goes to one path: the kernel's group, or SDPA's list.
    meta = PagedAttentionMetadata(cache, torch.tensor(slots), sdpa_spans, [], prefill_group=group,
                                  native_prefill=library)
    return paged_attention(meta, 0, qk[:, :num_heads], qk[:, num_heads:], value, head_dim ** -0.5, window)


# Every register blocking of the AVX-512 path (head_dim 16..128 in steps of 16, and 256; query groups of 1 to
# 7) and the portable path (head_dim 8 and 48 on it; 40, not a multiple of 16, on both).
SHAPES = [(8, 2, 32), (9, 3, 64), (14, 2, 64), (7, 7, 16), (7, 1, 48), (10, 2, 128), (4, 1, 256), (6, 2, 80),
          (6, 3, 96), (4, 2, 112), (2, 2, 40), (4, 4, 8)]
# A 1-token prompt, prompts around the row block (16) and key chunk (64) sizes, a long one, and chunks that
# continue a cached prefix (one of them a single token after a long prefix).
SPANS = [(1, 1), (15, 15), (16, 16), (17, 17), (63, 63), (64, 64), (65, 65), (200, 200), (30, 100), (64, 130),
         (2, 300)]


@needs_kernel
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("window", [None, 20, 70])
@pytest.mark.parametrize("implementation", ["fastest", "portable"])
@pytest.mark.parametrize("torch_threads", [1, 2, 5], indirect=True)
def test_kernel_matches_torch_in_float32(num_heads, num_kv_heads, head_dim, window, implementation, torch_threads):
    native = _prefill_step(torch.float32, num_heads, num_kv_heads, head_dim, SPANS, window, native=True,
                           implementation=implementation)
    reference = _prefill_step(torch.float32, num_heads, num_kv_heads, head_dim, SPANS, window, native=False)
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-5)


# bfloat16's shapes: the pair dot products serve head_dim 32, 64, 96, 128 and 256 (a multiple of 32); 80 and 48
# take the float paths even where the pair dot products exist.
BF16_SHAPES = [(8, 2, 64), (9, 3, 64), (4, 4, 32), (6, 3, 96), (4, 1, 128), (2, 2, 256), (6, 2, 80), (7, 1, 48)]


@needs_kernel
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", BF16_SHAPES)
@pytest.mark.parametrize("window", [None, 70])
@pytest.mark.parametrize("implementation", ["fastest", "simd_float", "portable"])
@pytest.mark.parametrize("torch_threads", [1, 2], indirect=True)
def test_kernel_matches_torch_in_bfloat16(num_heads, num_kv_heads, head_dim, window, implementation, torch_threads):
    native = _prefill_step(torch.bfloat16, num_heads, num_kv_heads, head_dim, SPANS, window, native=True,
                           implementation=implementation)
    reference = _prefill_step(torch.bfloat16, num_heads, num_kv_heads, head_dim, SPANS, window, native=False)
    torch.testing.assert_close(native.float(), reference.float(), rtol=2e-2, atol=2e-2)


@needs_kernel
def test_bfloat16s_implementations_agree_closer_than_with_torch():
    """Every implementation does the same arithmetic up to summation order: the probabilities rounded to bfloat16
    before they weight the values (without that rounding on one side they differ by a bfloat16 step, 8e-3)."""
    spans = [(300, 300), (17, 17), (64, 130)]
    runs = {name: _prefill_step(torch.bfloat16, 9, 3, 64, spans, None, native=True, implementation=name).float()
            for name in ("fastest", "simd_float", "portable")}
    for name in ("fastest", "simd_float"):
        torch.testing.assert_close(runs[name], runs["portable"], rtol=2e-3, atol=2e-3)


@needs_kernel
def test_a_long_prompt_matches_torch():
    native = _prefill_step(torch.float32, 9, 3, 64, [(1000, 1000)], None, native=True)
    reference = _prefill_step(torch.float32, 9, 3, 64, [(1000, 1000)], None, native=False)
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-5)


def test_the_fresh_prompt_attention_choice_is_timed_forced_or_implied(monkeypatch):
    from shared.engine.prefill_attention_choice import (FRESH_PREFILL_ENV, choose_fresh_prefill_attention,
                                                        sdpa_serves_fresh_chunks, time_fresh_chunk)

    assert sdpa_serves_fresh_chunks(native_s=1.0, sdpa_s=0.5)
    assert not sdpa_serves_fresh_chunks(native_s=1.0, sdpa_s=0.97)  # a tie keeps the native kernel
    shape = dict(num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, device="cpu")
    assert choose_fresh_prefill_attention(None, windowed=False, **shape)  # no kernel: SDPA does everything
    library = native_prefill_library(PagedKVCache(0, 1, 4, 16, 2, 32, torch.float32, "cpu"))
    if library is None:
        return
    assert not choose_fresh_prefill_attention(library, windowed=True, **shape)  # SDPA's mask path: never
    monkeypatch.setenv(FRESH_PREFILL_ENV, "sdpa")
    assert choose_fresh_prefill_attention(library, windowed=False, **shape)
    monkeypatch.setenv(FRESH_PREFILL_ENV, "native")
    assert not choose_fresh_prefill_attention(library, windowed=False, **shape)
    monkeypatch.setenv(FRESH_PREFILL_ENV, "fastest")
    with pytest.raises(ValueError, match="native' or 'sdpa"):
        choose_fresh_prefill_attention(library, windowed=False, **shape)
    monkeypatch.delenv(FRESH_PREFILL_ENV)
    native_s, sdpa_s = time_fresh_chunk(library, tokens=64, **shape)
    assert native_s > 0 and sdpa_s > 0  # each path was timed (how fast they are is the benchmarks' business)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_chunks_on_sdpa_beside_continued_ones_on_the_kernel_match_torch(dtype):
    """The split a runner makes when SDPA serves fresh chunks: one step, both paths, each chunk once."""
    spans = [(40, 40), (30, 100), (17, 17), (2, 300)]
    continued = [i for i, (q, c) in enumerate(spans) if c > q]
    native = _prefill_step(dtype, 9, 3, 64, spans, None, native=True, native_only=continued)
    reference = _prefill_step(dtype, 9, 3, 64, spans, None, native=False)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(native, reference, atol=tolerance, rtol=tolerance)
