"""The compiled decode attention kernel agrees with the torch path on the same paged cache."""

import random
from types import SimpleNamespace

import pytest
import torch

from shared.engine.kv_cache import PagedKVCache
from shared.engine.paged_attention import DecodeGroup, PagedAttentionMetadata, native_decode_library, paged_attention
from support.kernels import needs_native


def _decode_step(dtype, num_heads, num_kv_heads, head_dim, context_lens, window, native: bool, seed: int = 0,
                 portable: bool = False):
    gen = torch.Generator().manual_seed(seed)
    block_size, num_blocks = 16, 64
    cache = PagedKVCache(0, 1, num_blocks, block_size, num_kv_heads, head_dim, dtype, "cpu")
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=gen).to(dtype))
    rng = random.Random(seed)
    tables = [rng.sample(range(num_blocks), -(-n // block_size)) for n in context_lens]
    width = max(len(t) for t in tables)
    tokens = len(context_lens)
    # Every decode writes its new key/value into the slot of its last position.
    slots = [t[(n - 1) // block_size] * block_size + (n - 1) % block_size for t, n in zip(tables, context_lens)]
    qk = torch.randn(tokens, num_heads + num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    group = DecodeGroup(token_index=torch.arange(tokens),
                        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                        context_lens=torch.tensor(context_lens), num_context_tokens=sum(context_lens))
    library = native_decode_library(cache) if native else None
    if portable:  # the kernel's plain C implementation, which serves where AVX-512 does not
        library = SimpleNamespace(paged_decode_attention=library.paged_decode_attention_portable)
    meta = PagedAttentionMetadata(cache, torch.tensor(slots), [], [group], native_decode=library)
    return paged_attention(meta, 0, qk[:, :num_heads], qk[:, num_heads:], value, head_dim ** -0.5, window)


needs_kernel = needs_native("paged_decode")


# Head counts and sizes that reach every register blocking of the AVX-512 path (head_dim 32/64/128/256, query
# groups that leave a remainder of heads) and the portable fallback (head_dim 16 and 48).
SHAPES = [(8, 2, 32), (18, 2, 32), (9, 3, 64), (14, 2, 64), (10, 2, 128), (5, 1, 128), (3, 1, 256), (4, 4, 16),
          (6, 2, 48)]


@needs_kernel
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("portable", [False, True], ids=["fastest", "portable"])
@pytest.mark.parametrize("torch_threads", [1, 2], indirect=True)
def test_kernel_matches_torch_in_float32(num_heads, num_kv_heads, head_dim, window, portable, torch_threads):
    lens = [1, 2, 15, 16, 17, 100, 333, 64]
    native = _decode_step(torch.float32, num_heads, num_kv_heads, head_dim, lens, window, native=True,
                          portable=portable)
    reference = _decode_step(torch.float32, num_heads, num_kv_heads, head_dim, lens, window, native=False)
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("portable", [False, True], ids=["fastest", "portable"])
@pytest.mark.parametrize("torch_threads", [1, 2], indirect=True)
def test_kernel_matches_torch_in_bfloat16(portable, torch_threads):
    lens = [5, 40, 200]
    native = _decode_step(torch.bfloat16, 8, 2, 64, lens, None, native=True, portable=portable)
    reference = _decode_step(torch.bfloat16, 8, 2, 64, lens, None, native=False)
    torch.testing.assert_close(native.float(), reference.float(), rtol=2e-2, atol=2e-2)


def test_disabled_kernel_falls_back(monkeypatch):
    from shared.engine import kernels
    kernels.native_library.cache_clear()
    monkeypatch.setenv("SPLITSERVE_NATIVE_KERNELS", "0")
    try:
        assert native_decode_library(PagedKVCache(0, 1, 1, 16, 1, 8, torch.float32, "cpu")) is None
    finally:
        kernels.native_library.cache_clear()


def test_loading_the_kernels_leaves_the_process_floating_point_state_alone():
    # Linked with -ffast-math, a library would switch on flush-to-zero for the whole process that loads it, and
    # torch's own arithmetic would lose its subnormals. A fresh process, so no earlier load hides it.
    import subprocess
    import sys

    from support.processes import ROOT, service_env

    code = ("import torch\nfrom shared.engine.kernels import native_library\n"
            "assert all(native_library(name) is not None for name in ('paged_decode', 'paged_prefill', 'layer_ops'))\n"
            "print((torch.tensor([1e-39]) * 1.0).item())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=service_env(),
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.split()[-1]) > 0


@needs_kernel
def test_more_threads_than_work_items_leave_some_threads_without_work():
    """Every thread of torch's team is asked for, even where (sequence, KV head) items are fewer."""
    before = torch.get_num_threads()
    torch.set_num_threads(5)
    try:
        lens = [300, 290]  # 2 sequences x 1 KV head: 2 items for 5 threads
        native = _decode_step(torch.float32, 4, 1, 64, lens, None, native=True)
    finally:
        torch.set_num_threads(before)
    reference = _decode_step(torch.float32, 4, 1, 64, lens, None, native=False)
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-5)
