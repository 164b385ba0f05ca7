"""Attention over the paged KV cache.

Each layer writes its new keys/values into the paged cache and attends over
each sequence's blocks. The batch is flattened: `query` is `(total_tokens,
heads, head_dim)` holding every scheduled token of every sequence, back to
back.

On CPUs with a C compiler, compiled kernels read the paged cache in place: one
for every prompt chunk of a step (`kernels/paged_prefill.c`), one for every
single-token decode (`kernels/paged_decode.c`). Elsewhere the plain-torch path
runs: SDPA per prefill span, one padded SDPA per group of single-token decodes
of similar length. A GPU kernel can replace `paged_attention` without touching
anything else.
"""

import ctypes
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from shared.engine.kernels import all_threads_or_one, bf16_flag, native_library_for
from shared.engine.kv_cache import PagedKVCache

@dataclass(slots=True)
class PrefillSpan:
    """A sequence computing several tokens this step (a prompt chunk)."""

    query_start: int
    query_len: int
    context_len: int  # tokens with KV after this step, including the new ones
    block_ids: torch.Tensor | None  # for the torch path; None when the span is the whole context (fresh k/v)


@dataclass(slots=True)
class DecodeGroup:
    """Single-token decodes of similar context length, attended in one padded SDPA."""

    token_index: torch.Tensor  # (n,) position of each decode token in the flat batch
    block_tables: torch.Tensor  # (n, max_blocks), padded with block 0
    context_lens: torch.Tensor  # (n,)
    masks: dict = field(default_factory=dict)  # sliding window -> (n, 1, 1, slots) bool, built once per step
    num_context_tokens: int = 0  # sum of context_lens: the native kernel's work


# Keys (context tokens x KV heads) per thread of the native decode kernel. It runs on torch's own OpenMP
# workers, awake after the step's matrix multiplies, so a second thread costs a few microseconds and pays off
# from a few hundred keys (measured on 2 cores, SmolLM2's 3 KV heads, 30 layers' caches: 1 sequence of 128
# tokens 12.5 -> 11.5 us, 16 of 200 tokens 506 -> 276 us per layer; 32 tokens, no gain).
KEYS_PER_KERNEL_THREAD = 128


def decode_kernel_threads(num_keys: int, max_threads: int) -> int:
    """Threads for the native decode kernel on a step attending `num_keys` (tokens x KV heads): all of torch's
    once there are keys for two, else one."""
    return all_threads_or_one(num_keys >= 2 * KEYS_PER_KERNEL_THREAD, max_threads)


@dataclass(slots=True)
class PrefillGroup:
    """Every prompt chunk of a step, for the native prefill kernel (which reads their keys from the cache)."""

    query_starts: torch.Tensor  # (n,) int64
    query_lens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor  # (n, max_blocks), padded with block 0
    num_query_tokens: int


@dataclass(slots=True)
class PagedAttentionMetadata:
    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor  # (total_tokens,) flat slot = block_id * block_size + offset
    prefills: list[PrefillSpan]  # prompt chunks for SDPA (those of `prefill_group` are not among them)
    decode_groups: list[DecodeGroup]
    masks: dict = field(default_factory=dict)  # prefill masks, shared by every layer of a step
    native_decode: ctypes.CDLL | None = None  # the compiled decode kernel, when it serves this cache
    prefill_group: PrefillGroup | None = None  # the prompt chunks the compiled prefill kernel attends
    native_prefill: ctypes.CDLL | None = None


def native_decode_library(kv_cache: PagedKVCache) -> ctypes.CDLL | None:
    """The compiled decode attention kernel if it can read `kv_cache` (CPU, float32 or bfloat16), else None."""
    return native_library_for("paged_decode", kv_cache.tensor.device, kv_cache.dtype)


def native_prefill_library(kv_cache: PagedKVCache) -> ctypes.CDLL | None:
    """The compiled prefill attention kernel if it can read `kv_cache` (CPU, float32 or bfloat16), else None."""
    return native_library_for("paged_prefill", kv_cache.tensor.device, kv_cache.dtype)


# Query tokens from which the prefill kernel splits its work over every thread torch computes with.
PREFILL_TOKENS_TO_SPLIT = 8


def _kernel_query(query: torch.Tensor) -> torch.Tensor:
    """`query` (tokens, heads, head_dim) as the native kernels read it: heads and elements packed, any row stride."""
    return query if query.stride(2) == 1 and query.stride(1) == query.shape[2] else query.contiguous()


def _native_prefill(library: ctypes.CDLL, group: PrefillGroup, query: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, scaling: float, sliding_window: int | None, out: torch.Tensor) -> None:
    query = _kernel_query(query)
    num_heads, head_dim, num_kv_heads = query.shape[1], query.shape[2], key_cache.shape[2]
    threads = all_threads_or_one(group.num_query_tokens >= PREFILL_TOKENS_TO_SPLIT, torch.get_num_threads())
    status = library.paged_prefill_attention(
        query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
        group.query_starts.data_ptr(), group.query_lens.data_ptr(), group.context_lens.data_ptr(),
        group.block_tables.data_ptr(), group.block_tables.shape[1], group.query_starts.numel(), key_cache.shape[1],
        num_kv_heads, num_heads // num_kv_heads, head_dim, sliding_window or 0, scaling, out.data_ptr(),
        bf16_flag(query), threads,
    )
    if status != 0:
        raise MemoryError("the prefill attention kernel could not allocate its scratch memory")


def _native_decode(library: ctypes.CDLL, group: DecodeGroup, query: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, scaling: float, sliding_window: int | None, out: torch.Tensor) -> None:
    query = _kernel_query(query)
    num_heads, head_dim, num_kv_heads = query.shape[1], query.shape[2], key_cache.shape[2]
    status = library.paged_decode_attention(
        query.data_ptr(), query.stride(0), group.token_index.data_ptr(),
        key_cache.data_ptr(), value_cache.data_ptr(),
        group.block_tables.data_ptr(), group.block_tables.shape[1], group.context_lens.data_ptr(),
        group.token_index.numel(), key_cache.shape[1], num_kv_heads, num_heads // num_kv_heads, head_dim,
        sliding_window or 0, scaling, out.data_ptr(), bf16_flag(query),
        decode_kernel_threads(group.num_context_tokens * num_kv_heads, torch.get_num_threads()),
    )
    if status != 0:
        raise MemoryError("the decode attention kernel could not allocate its scratch memory")


def group_decodes_by_length(context_lens: list[int], max_padding: float = 0.25, max_groups: int = 8,
                            min_padding_tokens: int = 256) -> list[list[int]]:
    """Split decodes (by index) into groups whose padded length wastes at most ~max_padding.

    Gathering KV is the CPU decode path's main cost at long contexts and padding to
    the longest context multiplies it, so similar lengths are attended together. At
    short contexts each group's fixed cost (a gather and an SDPA per layer) outweighs
    the padding, so lengths within `min_padding_tokens` of a group's longest always join it.
    """
    order = sorted(range(len(context_lens)), key=lambda i: -context_lens[i])
    groups: list[list[int]] = []
    for i in order:
        if groups:
            longest = context_lens[groups[-1][0]]
            slack = max(max_padding * longest, min_padding_tokens)
            if context_lens[i] >= longest - slack or len(groups) == max_groups:
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


def _causal_mask(query_len: int, context_len: int, window: int | None, device) -> torch.Tensor:
    """(query_len, context_len) bool: query i sits at absolute position context_len - query_len + i."""
    q_pos = torch.arange(context_len - query_len, context_len, device=device)[:, None]
    k_pos = torch.arange(context_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def _decode_mask(group: DecodeGroup, num_slots: int, window: int | None) -> torch.Tensor:
    if window not in group.masks:
        k_pos = torch.arange(num_slots, device=group.context_lens.device)[None, :]
        lens = group.context_lens[:, None]
        mask = k_pos < lens
        if window is not None:
            mask &= k_pos >= lens - window
        group.masks[window] = mask[:, None, None, :]  # (n, 1, 1, slots)
    return group.masks[window]


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache[block_ids] for a (blocks, ...) cache; index_select copies rows far faster than advanced indexing."""
    return cache.index_select(0, block_ids.flatten()).view(*block_ids.shape, *cache.shape[1:])


def paged_attention(
    meta: PagedAttentionMetadata,
    layer: int,
    query: torch.Tensor,  # (T, heads, head_dim)
    key: torch.Tensor,  # (T, kv_heads, head_dim)
    value: torch.Tensor,
    scaling: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """This step's attention output `(T, heads, head_dim)`; stores the step's keys and values first."""
    key_cache, value_cache = meta.kv_cache.layer(layer)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    total_tokens = query.shape[0]

    # 1. Store this step's keys and values in their slots.
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, value)

    out = query.new_empty(total_tokens, query.shape[1], head_dim)  # (T, heads, head_dim)

    # 2. Prompt chunks: the native kernel reads its chunks' keys from the cache in one call; the others get one
    # causal SDPA each (fresh chunks where SDPA is the faster here, every chunk without the kernel).
    if meta.prefill_group is not None:
        _native_prefill(meta.native_prefill, meta.prefill_group, query, key_cache, value_cache, scaling,
                        sliding_window, out)
    _sdpa_prefills(meta, query, key, value, key_cache, value_cache, scaling, sliding_window, out)

    # 3. Single-token decodes: the native kernel reads the blocks in place; else one SDPA per group of similar
    # lengths, padded and masked.
    for group in meta.decode_groups:
        if meta.native_decode is not None:
            _native_decode(meta.native_decode, group, query, key_cache, value_cache, scaling, sliding_window, out)
            continue
        q = query[group.token_index][:, :, None]  # (n, heads, 1, d)
        # (n, max_blocks, block_size, kv_heads, d) -> (n, kv_heads, slots, d)
        k = _gather(key_cache, group.block_tables).flatten(1, 2).transpose(1, 2)
        v = _gather(value_cache, group.block_tables).flatten(1, 2).transpose(1, 2)
        if group.token_index.numel() == 1 and sliding_window is None:
            context_len = int(group.context_lens[0])
            o = F.scaled_dot_product_attention(
                q, k[:, :, :context_len], v[:, :, :context_len], scale=scaling, enable_gqa=True
            )
        else:
            mask = _decode_mask(group, k.shape[2], sliding_window)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
        out[group.token_index] = o[:, :, 0]

    return out


def _sdpa_prefills(meta: PagedAttentionMetadata, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   key_cache: torch.Tensor, value_cache: torch.Tensor, scaling: float, sliding_window: int | None,
                   out: torch.Tensor) -> None:
    """Each prompt chunk's causal attention as one SDPA (keys gathered from the cache for a continued chunk)."""
    for span in meta.prefills:
        rows = slice(span.query_start, span.query_start + span.query_len)
        q = query[rows].transpose(0, 1)[None]  # (1, heads, q_len, d)
        if span.block_ids is None:
            k = key[rows].transpose(0, 1)[None]
            v = value[rows].transpose(0, 1)[None]
        else:
            # (blocks, block_size, kv_heads, d) -> (1, kv_heads, context_len, d)
            k = _gather(key_cache, span.block_ids).flatten(0, 1)[: span.context_len].transpose(0, 1)[None]
            v = _gather(value_cache, span.block_ids).flatten(0, 1)[: span.context_len].transpose(0, 1)[None]
        if span.block_ids is None and sliding_window is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
        else:
            mask_key = (span.query_start, sliding_window)
            if mask_key not in meta.masks:
                meta.masks[mask_key] = _causal_mask(span.query_len, span.context_len, sliding_window, q.device)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.masks[mask_key], scale=scaling, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
