"""Attention over the paged KV cache, plugged into transformers' attention registry.

transformers' attention modules compute q/k/v projections, q/k norms and
rotary embeddings, then call the registered attention function. Ours writes
the new keys/values into the paged cache and attends over each sequence's
blocks. The batch is flattened: `query` is `(1, heads, total_tokens, head_dim)`
holding every scheduled token of every sequence, back to back.

This is the plain-torch CPU path (SDPA per prefill span, one padded SDPA for
all single-token decodes); a GPU kernel can replace `paged_attention_forward`
without touching anything else.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from shared.engine.kv_cache import PagedKVCache

ATTENTION_IMPLEMENTATION = "splitserve_paged"


@dataclass(slots=True)
class PrefillSpan:
    """A sequence computing several tokens this step (a prompt chunk)."""

    query_start: int
    query_len: int
    context_len: int  # tokens with KV after this step, including the new ones
    block_ids: torch.Tensor | None  # None when the span is the whole context (attend to fresh k/v)


@dataclass(slots=True)
class PagedAttentionMetadata:
    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor  # (total_tokens,) flat slot = block_id * block_size + offset
    prefills: list[PrefillSpan]
    decode_token_index: torch.Tensor  # (num_decodes,) position of each decode token in the flat batch
    decode_block_tables: torch.Tensor  # (num_decodes, max_blocks), padded with block 0
    decode_context_lens: torch.Tensor  # (num_decodes,)
    masks: dict = field(default_factory=dict)  # memo of boolean masks, shared by every layer of a step


def _causal_mask(query_len: int, context_len: int, window: int | None, device) -> torch.Tensor:
    """(query_len, context_len) bool: query i sits at absolute position context_len - query_len + i."""
    q_pos = torch.arange(context_len - query_len, context_len, device=device)[:, None]
    k_pos = torch.arange(context_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def _decode_mask(meta: PagedAttentionMetadata, num_slots: int, window: int | None) -> torch.Tensor:
    key = ("decode", window)
    if key not in meta.masks:
        k_pos = torch.arange(num_slots, device=meta.decode_context_lens.device)[None, :]
        lens = meta.decode_context_lens[:, None]
        mask = k_pos < lens
        if window is not None:
            mask &= k_pos >= lens - window
        meta.masks[key] = mask[:, None, None, :]  # (decodes, 1, 1, slots)
    return meta.masks[key]


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # (1, heads, T, head_dim)
    key: torch.Tensor,  # (1, kv_heads, T, head_dim)
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    meta: PagedAttentionMetadata = kwargs["paged_attention"]
    key_cache, value_cache = meta.kv_cache.layer(module.layer_idx)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    total_tokens = query.shape[2]

    # 1. Store this step's keys and values in their slots.
    new_keys = key[0].transpose(0, 1)  # (T, kv_heads, head_dim)
    new_values = value[0].transpose(0, 1)
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, new_keys)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, new_values)

    out = query.new_empty(total_tokens, query.shape[1], head_dim)  # (T, heads, head_dim)

    # 2. Prompt chunks: one causal SDPA per sequence.
    for span in meta.prefills:
        q = query[:, :, span.query_start : span.query_start + span.query_len]  # (1, heads, q_len, d)
        if span.block_ids is None:
            k = key[:, :, span.query_start : span.query_start + span.query_len]
            v = value[:, :, span.query_start : span.query_start + span.query_len]
        else:
            # (blocks, block_size, kv_heads, d) -> (1, kv_heads, context_len, d)
            k = key_cache[span.block_ids].flatten(0, 1)[: span.context_len].transpose(0, 1)[None]
            v = value_cache[span.block_ids].flatten(0, 1)[: span.context_len].transpose(0, 1)[None]
        if span.block_ids is None and sliding_window is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
        else:
            mask_key = (span.query_start, sliding_window)
            if mask_key not in meta.masks:
                meta.masks[mask_key] = _causal_mask(span.query_len, span.context_len, sliding_window, q.device)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.masks[mask_key], scale=scaling, enable_gqa=True)
        out[span.query_start : span.query_start + span.query_len] = o[0].transpose(0, 1)

    # 3. Single-token decodes: one SDPA over every decode's blocks, padded and masked.
    num_decodes = meta.decode_token_index.numel()
    if num_decodes:
        q = query[0, :, meta.decode_token_index].transpose(0, 1)[:, :, None]  # (decodes, heads, 1, d)
        tables = meta.decode_block_tables
        # (decodes, max_blocks, block_size, kv_heads, d) -> (decodes, kv_heads, slots, d)
        k = key_cache[tables].flatten(1, 2).transpose(1, 2)
        v = value_cache[tables].flatten(1, 2).transpose(1, 2)
        if num_decodes == 1 and sliding_window is None:
            context_len = int(meta.decode_context_lens[0])
            o = F.scaled_dot_product_attention(
                q, k[:, :, :context_len], v[:, :, :context_len], scale=scaling, enable_gqa=True
            )
        else:
            mask = _decode_mask(meta, k.shape[2], sliding_window)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
        out[meta.decode_token_index] = o[:, :, 0]

    return out[None], None  # (1, T, heads, head_dim), no attention weights


AttentionInterface.register(ATTENTION_IMPLEMENTATION, paged_attention_forward)
