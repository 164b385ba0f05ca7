"""Runs one step of one layer range over the paged KV cache."""

from collections.abc import Callable

import torch

from shared.engine.decoder_stack import DecoderStack
from shared.engine.kv_cache import KVAllocator, PagedKVCache
from shared.engine.model_loader import LoadedModel
from shared.engine.packed_linear import PackedLinear, tune_linear_layouts
from shared.engine.paged_attention import (DecodeGroup, PagedAttentionMetadata, PrefillGroup, PrefillSpan,
                                           group_decodes_by_length, native_decode_library, native_prefill_library)
from shared.engine.prefill_attention_choice import choose_fresh_prefill_attention
from shared.engine.step_batch import StepBatch


class ModelRunner:
    """Owns a loaded layer range and its KV cache.

    The first range embeds token ids; others take the previous range's hidden
    states. The last range applies the final norm and LM head and returns
    float32 logits of the sampled positions; others return hidden states.
    """

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, kv_allocator: KVAllocator | None = None):
        self.loaded = loaded
        self.device = loaded.device
        self.block_size = block_size
        self._kv_allocator = kv_allocator
        self.kv_cache = self._new_kv_cache(num_blocks)
        self.native_decode = native_decode_library(self.kv_cache)
        self.native_prefill = native_prefill_library(self.kv_cache)
        decoder = loaded.decoder
        self.embed_tokens = decoder.embed_tokens
        self.rotary_emb = decoder.rotary_emb
        self.stack = DecoderStack(loaded.config, loaded.layers, loaded.layer_range.start, loaded.device, loaded.dtype)
        for index in range(loaded.layer_range.start, loaded.layer_range.end):
            decoder.layers[index] = torch.nn.Module()  # its weights live in the stack now
        self.norm = decoder.norm
        self.lm_head = PackedLinear(loaded.model.lm_head.weight, loaded.model.lm_head.bias) if loaded.is_last else None
        # Float32 on CPU: which kernel serves how many rows, timed here (see packed_linear).
        self.linear_layouts = tune_linear_layouts(self._linears())
        # Fresh prompt chunks (no cached prefix): SDPA on the step's own keys where that is faster here.
        self.sdpa_fresh_prefills = choose_fresh_prefill_attention(
            self.native_prefill, num_heads=self.stack.num_heads, num_kv_heads=self.stack.num_kv_heads,
            head_dim=self.stack.head_dim, block_size=block_size, dtype=loaded.dtype, device=loaded.device,
            windowed=any(w.sliding_window for w in self.stack.layers))

    def _new_kv_cache(self, num_blocks: int) -> PagedKVCache:
        loaded = self.loaded
        return PagedKVCache(loaded.layer_range.start, loaded.layer_range.end, num_blocks, self.block_size,
                            loaded.num_kv_heads, loaded.head_dim, loaded.dtype, loaded.device, self._kv_allocator)

    def resize_kv(self, num_blocks: int) -> None:
        """A new, empty KV cache of `num_blocks` blocks in place of the old one, which is let go first."""
        self.kv_cache = None
        self.kv_cache = self._new_kv_cache(num_blocks)

    def _linears(self) -> list[PackedLinear]:
        layers = [lin for w in self.stack.layers for lin in (w.qkv, w.o_proj, w.gate_up, w.down)]
        return layers + ([self.lm_head] if self.lm_head is not None else [])

    @torch.inference_mode()
    def execute(self, batch: StepBatch, hidden_states: torch.Tensor | None = None,
                after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Logits `(num_samples + len(batch.extra_logit_indices), vocab)` for the last range (the sampled
        tokens', then the extra ones'), else hidden states `(tokens, hidden)`.

        `after_layer(absolute_layer_index)` runs as soon as a layer's KV for this
        step is in the cache (layer-wise KV streaming hooks in here).
        """
        positions = torch.tensor(batch.positions, dtype=torch.long, device=self.device)[None]  # (1, T)
        if self.loaded.is_first:
            token_ids = torch.tensor(batch.token_ids, dtype=torch.long, device=self.device)[None]
            hidden = self.embed_tokens(token_ids)  # (1, T, hidden)
        else:
            hidden = hidden_states.to(device=self.device, dtype=self.loaded.dtype)[None]
        cos, sin = self.rotary_emb(hidden, positions)  # (1, T, head_dim) each
        hidden = self.stack.forward(hidden[0], cos[0], sin[0], self._attention_metadata(batch), after_layer)  # (T, hidden)
        if self.lm_head is None:
            return hidden
        last_token = torch.tensor(batch.query_lens, device=self.device).cumsum(0) - 1  # (seqs,)
        rows = last_token[batch.sample_indices]
        if batch.extra_logit_indices:
            rows = torch.cat([rows, torch.tensor(batch.extra_logit_indices, dtype=torch.long, device=self.device)])
        return self.lm_head(self.norm(hidden[rows])).float()

    def _attention_metadata(self, batch: StepBatch) -> PagedAttentionMetadata:
        device, block_size = self.device, self.block_size
        slots: list[int] = []
        prefills: list[PrefillSpan] = []
        decode_index: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        native_spans: list[PrefillSpan] = []  # for the native kernel, the rest (`prefills`) for SDPA
        native_tables: list[list[int]] = []
        query_start = 0
        for query_len, context_len, table in zip(batch.query_lens, batch.context_lens, batch.block_tables):
            for pos in range(context_len - query_len, context_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
            if query_len == 1 and context_len > 1:
                decode_index.append(query_start)
                decode_tables.append(table)
                decode_lens.append(context_len)
            elif self.native_prefill and not (self.sdpa_fresh_prefills and context_len == query_len):
                native_spans.append(PrefillSpan(query_start, query_len, context_len, None))
                native_tables.append(table)
            else:
                block_ids = None
                if context_len > query_len:  # a continued chunk: its keys are gathered from the cache
                    block_ids = torch.tensor(table, dtype=torch.long, device=device)
                prefills.append(PrefillSpan(query_start, query_len, context_len, block_ids))
            query_start += query_len
        # The native kernel reads each sequence's own blocks, so one group holds every decode.
        groups = [list(range(len(decode_lens)))] if self.native_decode and decode_lens else group_decodes_by_length(decode_lens)
        return PagedAttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            prefills=prefills,
            decode_groups=[
                self._decode_group([decode_index[i] for i in members], [decode_tables[i] for i in members],
                                   [decode_lens[i] for i in members])
                for members in groups
            ],
            native_decode=self.native_decode,
            prefill_group=self._prefill_group(native_spans, native_tables) if native_spans else None,
            native_prefill=self.native_prefill,
        )

    def _padded(self, tables: list[list[int]]) -> torch.Tensor:
        """Block tables as one (n, longest) tensor, padded with block 0 (never read: context lengths bound it)."""
        width = max(len(t) for t in tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=self.device)

    def _prefill_group(self, spans: list[PrefillSpan], tables: list[list[int]]) -> PrefillGroup:
        def column(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        return PrefillGroup(
            query_starts=column([s.query_start for s in spans]),
            query_lens=column([s.query_len for s in spans]),
            context_lens=column([s.context_len for s in spans]),
            block_tables=self._padded(tables),
            num_query_tokens=sum(s.query_len for s in spans),
        )

    def _decode_group(self, token_index: list[int], tables: list[list[int]], context_lens: list[int]) -> DecodeGroup:
        return DecodeGroup(
            token_index=torch.tensor(token_index, dtype=torch.long, device=self.device),
            block_tables=self._padded(tables),
            context_lens=torch.tensor(context_lens, dtype=torch.long, device=self.device),
            num_context_tokens=sum(context_lens),
        )
