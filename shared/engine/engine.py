"""LLMEngine: add requests, step the continuous batch, get tokens and text out.

One `step()` is: schedule, run the model on the scheduled tokens, record the
computed KV, sample where a sequence has all its tokens computed, and turn the
new tokens into outputs (stop checks, incremental text). No I/O, no threads:
services drive `step()` from their own loop.
"""

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
import random
import time
from dataclasses import dataclass, field

import torch
from transformers import AutoTokenizer, GenerationConfig

from shared.engine.block_manager import BlockManager
from shared.engine.config import EngineConfig
from shared.engine.detokenizer import IncrementalDetokenizer
from shared.engine.errors import EngineError, EngineOverloadedError, InvalidRequestError, ModelLoadError
from shared.engine.executor import ChainExecutor
from shared.engine.block_slice import BlockSlice
from shared.engine.block_hash import cacheable_block_hashes
from shared.engine.continuation import Continuation, FirstToken, KVOrigin
from shared.engine.kv_connector import KVConnector, KVConnectors
from shared.engine.kv_cache import KVAllocator, KVLayout, PagedKVCache
from shared.engine.memory_budget import DeviceMemory, kv_cache_bytes_within, memory_of
from shared.engine.model_loader import LayerRange, load_model, read_config, resolve_dtype
from shared.engine.model_runner import ModelRunner
from shared.engine.prefill_pacer import PrefillPacer
from shared.engine.sampler import SamplingRow, TokenLogprobs, sample
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from shared.engine.sequence import Sequence, SequenceStatus
from shared.engine.step_batch import StepBatch, build_step_batch
from shared.engine.structured_output import StructuredOutputs

WRITE_BACK_BLOCKS = 8  # while decoding, full blocks are written back this many at a time (and the rest at the end)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (then `error` says why)
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None  # with the first output: prompt tokens 1.. (params.prompt_logprobs)


@dataclass(slots=True)
class CompletedRequest:
    """Everything a finished request produced (see `LLMEngine.generate`)."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprobs]
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass(slots=True)
class PlannedStep:
    """One scheduled step of one virtual engine, between `plan_step` and `complete_step`."""

    scheduled: SchedulerOutput
    batch: StepBatch
    virtual_engine: int
    grammar_masks: Future | None = None  # the constrained rows' masks, filled while the step runs
    # (sequence, first position, count): whose prompt positions' logits follow the sampled ones (prompt logprobs)
    prompt_rows: list = field(default_factory=list)


class LLMEngine:
    """The model runner's front: requests in, tokens out, one `step()` at a time.

    With `config.layer_ranges` ending before the model's last layer, this is a
    pipeline head: it runs the first layers and the rest run in stage
    processes; a subclass (`PipelineHeadEngine`) drives the steps then. With
    `num_virtual_engines` > 1, requests are spread over that many schedulers
    sharing one block pool, each scheduling its own steps: micro-batches that
    can be in flight in a pipeline at once.
    """

    def __init__(self, config: EngineConfig, load_tokenizer: bool = True, kv_allocator: KVAllocator | None = None,
                 num_virtual_engines: int = 1, device_memory: DeviceMemory | None = None):
        """`device_memory`: how `config.gpu_memory_utilization` measures the device (default: its GPU's)."""
        self.config = config
        model_config = read_config(config.model)
        self.model_config = model_config
        dtype = resolve_dtype(config.dtype, model_config)
        num_layers = model_config.num_hidden_layers
        ranges = config.layer_ranges or [LayerRange(0, num_layers)]
        if ranges[0].start != 0 or ranges[-1].end > num_layers:
            raise ModelLoadError(f"layer ranges must start at layer 0 and end by layer {num_layers}")
        if num_virtual_engines < 1:
            raise ValueError("num_virtual_engines must be positive")
        self.local_layers_end = ranges[-1].end  # layers from here on run elsewhere (a pipeline's stages)

        loaded = [load_model(config.model, config.dtype, config.device, r) for r in ranges]
        first = loaded[0]
        self.max_model_len = min(config.max_model_len or 1 << 62, getattr(model_config, "max_position_embeddings", 1 << 62))
        per_block = PagedKVCache.bytes_per_block(self.local_layers_end, config.block_size, first.num_kv_heads,
                                                 first.head_dim, dtype)
        num_blocks = config.num_kv_blocks or max(1, config.kv_cache_bytes // per_block)
        by_memory = config.gpu_memory_utilization is not None and config.num_kv_blocks is None
        if by_memory:  # a small cache for the measure first, then what the memory left holds
            device_memory = device_memory or memory_of(first.device)
            device_memory.reset_peak()
            profile = _profile_batch(min(config.max_num_batched_tokens, self.max_model_len), config.max_num_seqs,
                                     config.block_size)
            num_blocks = sum(len(table) for table in profile.block_tables)
        self.executor = ChainExecutor([ModelRunner(m, num_blocks, config.block_size, kv_allocator) for m in loaded])
        self.memory_sizing: dict | None = None  # how --gpu-memory-utilization sized the KV cache, where it did
        if by_memory:
            self.executor.execute(profile)
            used = device_memory.peak_bytes() - num_blocks * per_block  # weights and the step, not its small cache
            kv_bytes = kv_cache_bytes_within(device_memory.total_bytes(), config.gpu_memory_utilization, used)
            num_blocks = max(1, kv_bytes // per_block)
            self.executor.resize_kv(num_blocks)
            self.memory_sizing = {"utilization": config.gpu_memory_utilization, "used_bytes": used,
                                  "kv_cache_bytes": num_blocks * per_block}
        self.fingerprint = first.fingerprint
        self.connectors = KVConnectors()  # services' hooks into the KV (see `connect`)
        self.block_manager = BlockManager(num_blocks, config.block_size, self.fingerprint, config.enable_prefix_caching,
                                          self.connectors)
        per_engine_seqs = -(-config.max_num_seqs // num_virtual_engines)
        self.schedulers = [
            Scheduler(SchedulerConfig(per_engine_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill,
                                      config.scheduling_policy), self.block_manager, self.connectors)
            for _ in range(num_virtual_engines)
        ]
        self.scheduler = self.schedulers[0]
        self.prefill_pacer = (PrefillPacer(config.prefill_beside_decodes_ms / 1000)
                              if config.prefill_beside_decodes_ms else None)
        self.vocab_size = model_config.vocab_size
        self.tokenizer = AutoTokenizer.from_pretrained(config.model) if load_tokenizer else None
        self.eos_token_ids = _eos_token_ids(config.model, model_config, self.tokenizer)
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._sequences: dict[str, Sequence] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._held: dict[str, Sequence] = {}  # finished hold_kv requests whose blocks are kept
        self._arrivals = 0
        self._rng = random.Random()
        self.num_prompt_tokens_computed = 0  # prompt tokens run through the model (misses, and preempted ones again)
        self.external_hit_tokens: Counter[str] = Counter()  # prompt tokens loaded by connectors, by connector name
        self.stalled = False  # the last step ran nothing though requests are unfinished (loads, or blocks held)

    def connect(self, connector: KVConnector) -> None:
        """Call `connector`'s hooks from now on: prefixes to load when a request is admitted; prefix-cache
        changes; computed blocks (when a prompt's KV is complete, every WRITE_BACK_BLOCKS blocks that decoding
        fills, and when a request finishes); the prompt KV, layer by layer, of requests added with
        `stream_prompt_kv`; and the end of every request."""
        self.connectors.connect(connector)

    def disconnect(self, connector: KVConnector) -> None:
        """Stop calling `connector`'s hooks (see `connect`)."""
        self.connectors.disconnect(connector)

    # ---- requests -----------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    continuation: Continuation | None = None, *, hold_kv: bool = False,
                    stream_prompt_kv: bool = False, read_prefix_cache: bool = True, grammar=None) -> None:
        """Queue a request, from its start or from a `continuation`.

        With `hold_kv`, the request's blocks outlive it until `release_held` (a prefill worker ships them).
        With `stream_prompt_kv`, the connectors get the prompt's KV one layer at a time during the step that
        completes the prompt (`prompt_layer_computed`). Without `read_prefix_cache`, its prefix is not looked
        up here: a connector is to load all of it (if none does, or its load fails, the request computes as
        any other). A continuation's tokens are computed again here, after the prompt. `grammar`: its constraint
        as `structured.compile` compiled it (else it is compiled here, on this thread).
        """
        continuation = continuation or Continuation()
        in_use = request_id in self._sequences or any(request_id in s.abandoned for s in self.schedulers)
        try:
            if in_use:
                raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
            self._add_request(request_id, prompt_token_ids, params, continuation, hold_kv, stream_prompt_kv,
                              read_prefix_cache, grammar)
        except BaseException:
            if not in_use:
                self.connectors.request_finished(request_id)
            raise

    def _add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     continuation: Continuation, hold_kv: bool, stream_prompt_kv: bool,
                     read_prefix_cache: bool, grammar) -> None:
        output_token_ids = continuation.output_token_ids
        if self.num_waiting + self.num_loading >= self.config.max_waiting_requests:
            raise EngineOverloadedError(f"{self.num_waiting + self.num_loading} requests are already waiting")
        self._validate(prompt_token_ids, list(output_token_ids), params)
        prompt_len = len(prompt_token_ids)
        if params.max_tokens is not None and len(output_token_ids) >= params.max_tokens:
            raise InvalidRequestError(
                f"the request already has {len(output_token_ids)} output tokens; max_tokens is {params.max_tokens}",
                "max_tokens",
            )
        max_total = self.max_total_tokens(prompt_len, params)
        needed_blocks = self.block_manager.blocks_needed(max_total)
        if needed_blocks > self.block_manager.num_blocks:
            raise InvalidRequestError(
                f"the request needs up to {max_total} tokens ({needed_blocks} KV blocks) but the KV cache "
                f"holds {self.block_manager.num_blocks} blocks of {self.config.block_size} tokens",
                "max_tokens",
            )
        detok = continuation.detokenizer or self._replayed_detokenizer(prompt_token_ids, output_token_ids, params)
        seq = Sequence(
            request_id=request_id,
            token_ids=list(prompt_token_ids) + list(output_token_ids),
            num_prompt_tokens=prompt_len,
            params=params,
            seed=params.seed if params.seed is not None else self._rng.getrandbits(63),
            max_total_tokens=max_total,
            arrival_index=self._arrivals,
            hold_kv=hold_kv,
            stream_prompt_kv=stream_prompt_kv,
            read_prefix_cache=read_prefix_cache,
            virtual_engine=min(range(len(self.schedulers)), key=lambda i: self._load_of(i)),
        )
        if params.structured_kind:
            self.structured.add(request_id, params.structured_kind, params.structured_spec, output_token_ids,
                                grammar)
        self._arrivals += 1
        self._sequences[request_id] = seq
        if detok is not None:
            self._detokenizers[request_id] = detok
        self.schedulers[seq.virtual_engine].add(seq)

    def abort_request(self, request_id: str) -> bool:
        """Drop a request at once (running, waiting or held); its blocks are free when this returns."""
        if self.release_held(request_id):
            return True
        seq = self._sequences.pop(request_id, None)
        if seq is None:
            return False
        self._detokenizers.pop(request_id, None)
        self.structured.drop(request_id)
        self.schedulers[seq.virtual_engine].finish(seq)
        self.connectors.request_finished(request_id)
        return True

    def release_held(self, request_id: str) -> bool:
        """Free the blocks a finished `hold_kv` request kept."""
        seq = self._held.pop(request_id, None)
        if seq is None:
            return False
        self.block_manager.free(seq)
        return True

    @property
    def num_held(self) -> int:
        return len(self._held)

    def has_unfinished_requests(self) -> bool:
        return any(s.has_unfinished() for s in self.schedulers)

    @property
    def num_running(self) -> int:
        return sum(len(s.running) for s in self.schedulers)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a place in the batch (not those whose KV is loading)."""
        return sum(len(s.waiting) for s in self.schedulers)

    @property
    def num_loading(self) -> int:
        """Requests out of the batch while a connector loads their KV (a remote prefill, a kv-store fetch)."""
        return sum(len(s.loading) for s in self.schedulers)

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.schedulers)

    def preemption_counts(self) -> dict[str, int]:
        """Sequences preempted (to be recomputed), by why: blocks ran short, or their place went to another
        tenant's or a higher priority's request (`batch_share`). Plain ints: safe to read from another thread."""
        shared = sum(s.num_share_preemptions for s in self.schedulers)
        return {"kv_blocks": self.num_preemptions - shared, "batch_share": shared}

    def _load_of(self, virtual_engine: int) -> int:
        scheduler = self.schedulers[virtual_engine]
        return len(scheduler.running) + len(scheduler.waiting)

    def prefix_cache_counts(self) -> dict:
        """Prompt tokens looked up in the prefix caches (this engine's own, at a request's first scheduling, or
        the kv-store's, for a request started from its blocks), found per tier, and prompt tokens computed
        (plain ints: safe to read from another thread)."""
        return {"query_tokens": sum(s.prefix_query_tokens for s in self.schedulers),
                "hit_tokens": {"local": sum(s.prefix_hit_tokens for s in self.schedulers),
                               **{name: self.external_hit_tokens[name] for name in self.connectors.loader_names}},
                "prompt_tokens_computed": self.num_prompt_tokens_computed}

    def get_sequence(self, request_id: str) -> Sequence | None:
        return self._sequences.get(request_id)

    # ---- the step -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.local_layers_end != self.model_config.num_hidden_layers:
            raise EngineError("this engine runs only the first layers of a pipeline; a pipeline head drives it")
        self.collect_loads()
        outputs = []
        ran = False
        pacer = self.prefill_pacer
        threads = torch.get_num_threads()  # a worker borrowing a CPU runs some steps on more
        for virtual_engine in range(len(self.schedulers)):
            if pacer is not None:
                self.schedulers[virtual_engine].prefill_cap = pacer.cap(threads)
            planned = self.plan_step(virtual_engine)
            if planned is not None:
                ran = True
                started = time.perf_counter()
                logits = self.executor.execute(planned.batch, self._layer_streamer(planned.scheduled))
                if pacer is not None:
                    pacer.observe(time.perf_counter() - started, _prompt_tokens(planned.scheduled),
                                  _decodes(planned.scheduled), threads)
                outputs += self.complete_step(planned, logits)
        self.stalled = not ran
        return outputs

    def collect_loads(self) -> None:
        """Take the connectors' finished loads: loaded requests run from where their KV ends, failed ones
        compute it (called at the start of every step)."""
        if not any(s.loading or s.abandoned for s in self.schedulers):
            return
        for end in self.connectors.finished_loads():
            seq = self._sequences.get(end.request_id)
            loading = seq is not None and seq.status is SequenceStatus.LOADING
            if loading and end.request_over:
                self.abort_request(end.request_id)  # its blocks are freed just below
            elif loading and end.continuation is not None:
                self._continue_after_load(seq, end.continuation)
            loader = self.connectors.loader_of(end.request_id)
            for scheduler in self.schedulers:
                loaded = scheduler.load_finished(end.request_id, end.ok)
                if loaded is not None:
                    break
            if not loaded:
                continue
            if end.continuation is not None:  # computed elsewhere: what it says, not this engine's hits
                seq.num_cached_tokens = end.continuation.num_cached_tokens
                if end.continuation.kv_origin is KVOrigin.WRITTEN_BACK:
                    seq.num_written_back = seq.num_computed_tokens // self.config.block_size
            elif loader is not None and loader.name is not None:
                self.external_hit_tokens[loader.name] += loaded

    def _continue_after_load(self, seq: Sequence, continuation: Continuation) -> None:
        """The tokens a loaded request brought from where its prompt was computed (sampled there, and streamed)."""
        seq.token_ids.extend(continuation.output_token_ids)
        with contextlib.suppress(InvalidRequestError):  # its next token reports it (the matcher stays broken)
            self.structured.advance(seq.request_id, continuation.output_token_ids)
        if continuation.detokenizer is not None:
            self._detokenizers[seq.request_id] = continuation.detokenizer

    def plan_step(self, virtual_engine: int = 0) -> PlannedStep | None:
        """Schedule one step of a virtual engine (None: nothing to run). Until `complete_step`, schedule
        nothing else on that virtual engine."""
        scheduled = self.schedulers[virtual_engine].schedule()
        if not scheduled.scheduled:
            return None
        batch = build_step_batch(scheduled, self.config.block_size)
        prompt_rows = _want_prompt_logits(scheduled, batch)
        masks = None
        if len(self.structured):
            masks = self.structured.start_masks([scheduled.scheduled[i].seq.request_id
                                                 for i in batch.sample_indices])
        return PlannedStep(scheduled, batch, virtual_engine, masks, prompt_rows)

    def complete_step(self, planned: PlannedStep, logits: torch.Tensor) -> list[RequestOutput]:
        """Account a step's computed tokens and sample from its logits. Requests aborted while the
        step ran are skipped (their blocks may already hold another request's KV)."""
        scheduled, batch = planned.scheduled, planned.batch
        for item in scheduled.scheduled:
            seq = item.seq
            if self._sequences.get(seq.request_id) is seq:
                before = seq.num_computed_tokens
                seq.num_computed_tokens += item.num_new_tokens
                self.num_prompt_tokens_computed += (min(seq.num_computed_tokens, seq.num_prompt_tokens)
                                                    - min(before, seq.num_prompt_tokens))
                self.block_manager.cache_full_blocks(seq)
                prompt_done = before < seq.num_prompt_tokens <= seq.num_computed_tokens
                if self._writes_back and (prompt_done or self._full_blocks(seq) - seq.num_written_back >= WRITE_BACK_BLOCKS):
                    self._write_back(seq)

        if planned.prompt_rows:
            self._record_prompt_logprobs(planned.prompt_rows, logits[len(batch.sample_indices):])
        logits = logits[:len(batch.sample_indices)]
        rows, to_sample = [], []
        for position, index in enumerate(batch.sample_indices):
            seq = scheduled.scheduled[index].seq
            if self._sequences.get(seq.request_id) is seq:
                to_sample.append((position, seq))
        masks = planned.grammar_masks.result() if planned.grammar_masks is not None else None
        if not to_sample:
            return []
        logits = logits[[position for position, _ in to_sample]] if len(to_sample) != len(batch.sample_indices) else logits
        rows = [SamplingRow(s.params, s.seed, s.prompt_token_ids, s.output_token_ids,
                            s.params.suppressed_token_ids(len(s.output_token_ids), self.eos_token_ids),
                            masks[position] if masks is not None and s.request_id in self.structured else None)
                for position, s in to_sample]
        sampled = sample(logits, rows)
        outputs = []
        for (_, seq), token_id, logprobs in zip(to_sample, sampled.token_ids, sampled.logprobs):
            outputs.append(self._append_token(seq, token_id, logprobs))
        return outputs

    def _record_prompt_logprobs(self, prompt_rows: list, logits: torch.Tensor) -> None:
        """The logprobs of the prompt tokens whose predecessors' logits these are (see `_want_prompt_logits`)."""
        row = 0
        for seq, first, count in prompt_rows:
            chunk, row = logits[row:row + count], row + count
            if self._sequences.get(seq.request_id) is not seq:
                continue  # aborted while the step ran
            logprobs = torch.log_softmax(chunk.float(), dim=-1)
            targets = torch.tensor(seq.token_ids[first + 1:first + 1 + count], dtype=torch.long,
                                   device=logprobs.device)
            chosen = logprobs.gather(1, targets[:, None])[:, 0]
            ranks = ((logprobs > chosen[:, None]).sum(dim=1) + 1).tolist()
            k = min(seq.params.prompt_logprobs, logprobs.shape[1])
            top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
            for target, value, rank, ids, values in zip(targets.tolist(), chosen.tolist(), ranks,
                                                        top_ids.tolist(), top_values.tolist()):
                seq.prompt_logprobs.append(TokenLogprobs(target, value, list(zip(ids, values)), rank=rank))

    def _completing_streams(self, scheduled) -> list[Sequence]:
        """Requests whose prompt completes this step and that asked for their KV layer by layer."""
        return [item.seq for item in scheduled.scheduled
                if item.seq.stream_prompt_kv
                and item.seq.num_computed_tokens + item.num_new_tokens >= item.seq.num_prompt_tokens]

    def _layer_streamer(self, scheduled) -> Callable[[int], None] | None:
        """For requests whose prompt completes this step and asked for their KV layer by layer:
        after each of this engine's layers, hand that layer's prompt KV to the connectors (still inside
        the step). A pipeline head streams only its own layers; its stages stream theirs."""
        completing = self._completing_streams(scheduled)
        if not completing:
            return None

        def after_layer(layer: int) -> None:
            for seq in completing:
                blocks = seq.block_table[: self.block_manager.blocks_needed(seq.num_prompt_tokens)]
                data, layout = self.executor.view_kv(blocks, seq.num_prompt_tokens, layer, layer + 1)
                self.connectors.prompt_layer_computed(seq.request_id, data, layout)
            if layer == self.local_layers_end - 1:
                for seq in completing:
                    seq.stream_prompt_kv = False

        return after_layer

    def _append_token(self, seq: Sequence, token_id: int, logprobs: TokenLogprobs | None) -> RequestOutput:
        seq.token_ids.append(token_id)
        detok = self._detokenizers.get(seq.request_id)
        error = None
        try:
            grammar_complete = self.structured.advance(seq.request_id, [token_id])
        except InvalidRequestError as exc:  # a token its grammar's mask did not allow: never expected
            grammar_complete, error = False, str(exc)
        new_text, finish_reason, stop_reason = self.judge_token(
            seq.params, token_id, detok, seq.num_tokens, seq.max_total_tokens, grammar_complete=grammar_complete,
        )
        if error is not None:
            finish_reason = "error"
        output = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[token_id],
            new_text=new_text,
            new_logprobs=[logprobs] if logprobs is not None else [],
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=max(seq.num_cached_tokens, 0),
            num_output_tokens=seq.num_output_tokens,
            error=error,
        )
        if seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            output.prompt_logprobs, seq.prompt_logprobs_sent = list(seq.prompt_logprobs), True
        if output.finished:
            if self._writes_back:
                self._write_back(seq)
            self._sequences.pop(seq.request_id, None)
            self._detokenizers.pop(seq.request_id, None)
            self.structured.drop(seq.request_id)
            self.schedulers[seq.virtual_engine].finish(seq, free_blocks=not seq.hold_kv)
            if seq.hold_kv:
                self._held[seq.request_id] = seq
            self.connectors.request_finished(seq.request_id)
        return output

    def judge_token(
        self, params: SamplingParams, token_id: int, detok: IncrementalDetokenizer | None,
        num_tokens: int, max_total_tokens: int, grammar_complete: bool = False,
    ) -> tuple[str, str | None, str | int | None]:
        """(text released, finish reason, stop reason) after a sequence's new token. `grammar_complete`: its
        structured output is whole (nothing but EOS could follow): it stops there.

        Pure but for `detok`, which it advances: also usable for a first token
        sampled elsewhere (a prefill worker's), before the request is here.
        """
        finish_reason = stop_reason = None
        new_text = ""
        if not params.ignore_eos and token_id in self.eos_token_ids:
            finish_reason, stop_reason = "stop", token_id
        elif token_id in params.stop_token_ids:
            finish_reason, stop_reason = "stop", token_id
        elif detok is not None:
            new_text = detok.add_token(token_id)
            if detok.matched_stop is not None:
                finish_reason, stop_reason = "stop", detok.matched_stop
        if finish_reason is None and grammar_complete:
            finish_reason = "stop"
        if finish_reason is None and num_tokens >= max_total_tokens:
            finish_reason = "length"
        if finish_reason is not None and detok is not None and detok.matched_stop is None:
            new_text += detok.finish()
        return new_text, finish_reason, stop_reason

    def remote_first_token(self, prompt_token_ids: list[int], params: SamplingParams, token_id: int, *,
                           num_cached_tokens: int = 0, kv_origin: KVOrigin = KVOrigin.COMPUTED) -> FirstToken:
        """Judge a request's first token sampled elsewhere (a prefill worker's), before the request's KV is here:
        its text and stop, as a token of its own; its load then ends with the `continuation` returned."""
        detok = self.new_detokenizer(prompt_token_ids, params)
        text, finish_reason, _ = self.judge_token(params, token_id, detok, len(prompt_token_ids) + 1,
                                                  self.max_total_tokens(len(prompt_token_ids), params))
        return FirstToken(text, finish_reason, Continuation([token_id], num_cached_tokens, kv_origin, detok))

    def _replayed_detokenizer(self, prompt_token_ids: list[int], output_token_ids, params: SamplingParams
                              ) -> IncrementalDetokenizer | None:
        """A detokenizer in the state it reached after `output_token_ids` (their text already streamed): what it
        held back (a character's first bytes, a possible stop string's start) is released as the request goes on."""
        detok = self.new_detokenizer(prompt_token_ids, params)
        if detok is None:
            return None
        for token_id in output_token_ids:
            detok.add_token(token_id)
            if detok.matched_stop is not None:
                raise InvalidRequestError("the output tokens already end at a stop string", "resume_output_token_ids")
        return detok

    def new_detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens,
                                      params.include_stop_str_in_output, min_tokens=params.min_tokens,
                                      spaces_between_special_tokens=params.spaces_between_special_tokens)

    def max_total_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        if params.max_tokens is None:
            return self.max_model_len
        return min(self.max_model_len, prompt_len + params.max_tokens)

    # ---- KV export / import -------------------------------------------------------
    def export_kv(
        self,
        request_id: str,
        block_start: int = 0,
        block_end: int | None = None,
        layer_start: int = 0,
        layer_end: int | None = None,
    ) -> tuple[torch.Tensor, KVLayout]:
        """Copy a request's computed KV for blocks [block_start, block_end) and layers [layer_start, layer_end)."""
        seq = self._sequences.get(request_id) or self._held.get(request_id)
        if seq is None:
            raise EngineError(f"unknown request {request_id!r}")
        num_full_or_partial = self.block_manager.blocks_needed(seq.num_computed_tokens)
        block_end = num_full_or_partial if block_end is None else block_end
        if not 0 <= block_start < block_end <= num_full_or_partial:
            raise EngineError(
                f"blocks [{block_start}, {block_end}) are outside the request's {num_full_or_partial} computed blocks"
            )
        num_layers = self.model_config.num_hidden_layers
        layer_end = num_layers if layer_end is None else layer_end
        if not 0 <= layer_start < layer_end <= num_layers:
            raise EngineError(f"layers [{layer_start}, {layer_end}) are outside the model's {num_layers} layers")
        num_tokens = min(seq.num_computed_tokens, block_end * self.config.block_size) - block_start * self.config.block_size
        data, layout = self.executor.export_kv(seq.block_table[block_start:block_end], num_tokens, layer_start, layer_end)
        return data, dataclasses.replace(layout, block_start=block_start)

    @property
    def _writes_back(self) -> bool:
        # A pipeline head holds only its own layers' KV: whole blocks cannot be written back from it.
        return self.connectors.wants("blocks_computed") and self.local_layers_end == self.model_config.num_hidden_layers

    def _full_blocks(self, seq: Sequence) -> int:
        return min(seq.num_computed_tokens // self.config.block_size, len(seq.block_table))

    def _write_back(self, seq: Sequence) -> None:
        """Hand the sequence's full computed blocks not yet handed over to the connectors."""
        start, end = seq.num_written_back, self._full_blocks(seq)
        if end <= start:
            return
        self.block_manager.update_hashes(seq)
        block_ids = seq.block_table[start:end]
        seq.num_written_back = end

        def export(indices: list[int]) -> torch.Tensor:
            chosen = [block_ids[i] for i in indices]
            data, _ = self.executor.export_kv(chosen, len(chosen) * self.config.block_size, 0,
                                              self.model_config.num_hidden_layers)
            return data.permute(2, 0, 1, 3, 4, 5).contiguous()  # one block after another

        self.connectors.blocks_computed(list(seq.block_hashes[start:end]), export)

    def prefix_block_hashes(self, prompt_token_ids: list[int], cache_salt: str = "") -> list[bytes]:
        """The hashes of the prompt's full blocks that a cached prefix may cover."""
        return cacheable_block_hashes(prompt_token_ids, self.config.block_size, self.fingerprint, cache_salt)

    def write_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Write whole blocks' KV ([n, layers, 2, block_size, kv_heads, head_dim], as the kv-store keeps them)
        into a loading request's blocks."""
        layout = self.executor.kv_layout(0, self.model_config.num_hidden_layers, len(block_ids),
                                         len(block_ids) * self.config.block_size)
        self.write_kv(block_ids, blocks.permute(1, 2, 0, 3, 4, 5), layout)

    def write_layers(self, block_ids: list[int], num_tokens: int, layer_start: int, layer_end: int,
                     data: "torch.Tensor | BlockSlice") -> None:
        """Write received KV of layers [layer_start, layer_end) for the first `num_tokens` tokens of a loading
        request into its blocks (as `KVSender` streams a prompt's KV, layer by layer)."""
        layout = self.executor.kv_layout(layer_start, layer_end, len(block_ids), num_tokens)
        self.write_kv(block_ids, data, layout)

    def write_kv(self, block_ids: list[int], data: "torch.Tensor | BlockSlice", layout: KVLayout) -> None:
        """Copy received KV (a tensor, or blocks of another cache) into a loading request's blocks, from the
        first: the one copy on the receiving side."""
        if layout.block_start != 0:
            raise EngineError("imported KV must start at the sequence's first block")
        if layout.num_blocks != len(block_ids):
            raise EngineError(f"KV for {layout.num_blocks} blocks does not fit {len(block_ids)} blocks")
        self.executor.import_kv(block_ids, data, layout)

    # ---- offline convenience ------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[CompletedRequest]:
        """Run prompts to completion in one continuous batch; results in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling parameters")
        ids = [f"generate-{self._arrivals + i}" for i in range(len(prompts))]
        results = {rid: CompletedRequest(rid, [], "", None, [], len(p), 0) for rid, p in zip(ids, prompts)}
        try:
            for rid, prompt, p in zip(ids, prompts, params_list):
                self.add_request(rid, prompt, p)
        except EngineError:
            for rid in ids:
                self.abort_request(rid)
            raise
        while any(rid in self._sequences for rid in ids):
            for out in self.step():
                result = results.get(out.request_id)
                if result is None:
                    continue  # someone else's request sharing the engine
                result.token_ids.extend(out.new_token_ids)
                result.text += out.new_text
                result.logprobs.extend(out.new_logprobs)
                if out.finished:
                    result.finish_reason = out.finish_reason
                    result.num_cached_tokens = out.num_cached_tokens
        return [results[rid] for rid in ids]

    # ---- validation ---------------------------------------------------------------
    def _validate(self, prompt_token_ids: list[int], output_token_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling parameters must be a SamplingParams", "params")
        params.validate()  # for direct engine users: the services' are checked where they came in, and here again
        if len(prompt_token_ids) == 0:
            raise InvalidRequestError("the prompt is empty", "prompt")
        for token_id in list(prompt_token_ids) + output_token_ids:
            if not isinstance(token_id, int) or not 0 <= token_id < self.vocab_size:
                raise InvalidRequestError(f"token id {token_id!r} is outside the vocabulary [0, {self.vocab_size})", "prompt")
        total = len(prompt_token_ids) + len(output_token_ids)
        if total >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {total} tokens, but the model's maximum context length is {self.max_model_len} "
                f"tokens, which leaves no room to generate",
                "prompt",
            )
        params.check_token_ids(self.vocab_size)


def _profile_batch(num_tokens: int, max_num_seqs: int, block_size: int) -> StepBatch:
    """A full step to measure memory by: `num_tokens` prompt tokens over as many sequences as a step holds (each
    sampled, as a step of that many sequences samples), each with blocks of its own."""
    num_seqs = max(1, min(max_num_seqs, num_tokens))
    lengths = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
    batch = StepBatch.empty(block_size)
    next_block = 0
    for i, length in enumerate(lengths):
        blocks = -(-length // block_size)
        batch.request_ids.append(f"profile-{i}")
        batch.token_ids += [0] * length
        batch.positions += list(range(length))
        batch.query_lens.append(length)
        batch.context_lens.append(length)
        batch.block_tables.append(list(range(next_block, next_block + blocks)))
        batch.sample_indices.append(i)
        next_block += blocks
    return batch


def _prompt_tokens(scheduled: SchedulerOutput) -> int:
    """Tokens a planned step computes in chunks (a prompt's, or a preempted sequence's again), not decodes."""
    return sum(item.num_new_tokens for item in scheduled.scheduled if item.num_new_tokens > 1)


def _decodes(scheduled: SchedulerOutput) -> int:
    """Sequences a planned step decodes (one new token each)."""
    return sum(1 for item in scheduled.scheduled if item.num_new_tokens == 1)


def _eos_token_ids(model_dir: str, model_config, tokenizer) -> set[int]:
    """The ids generation stops at, chosen as transformers' generate() chooses them."""
    try:
        candidates = [GenerationConfig.from_pretrained(model_dir).eos_token_id]
    except OSError:
        candidates = []
    candidates.append(getattr(model_config, "eos_token_id", None))
    if tokenizer is not None:
        candidates.append(tokenizer.eos_token_id)
    for candidate in candidates:
        if isinstance(candidate, int):
            return {candidate}
        if isinstance(candidate, (list, tuple)) and candidate:
            return {c for c in candidate if isinstance(c, int)}
    return set()


def _want_prompt_logits(scheduled, batch: StepBatch) -> list:
    """For the sequences that want their prompt's logprobs: ask the step for the logits of the prompt positions it
    computes that are not had yet (added to `batch.extra_logit_indices`); (sequence, first position, count) each.
    Position p's logits give prompt token p + 1's logprob, so the last prompt position is not among them."""
    wanted, offset = [], 0
    for item in scheduled.scheduled:
        seq, start, count = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
        if seq.params.prompt_logprobs is not None:
            first, end = max(start, len(seq.prompt_logprobs)), min(start + count, seq.num_prompt_tokens - 1)
            if first < end:
                batch.extra_logit_indices.extend(range(offset + first - start, offset + end - start))
                wanted.append((seq, first, end - first))
        offset += count
    return wanted
