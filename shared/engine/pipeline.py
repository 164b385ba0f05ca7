"""Pipeline parallelism: layer splits, and the head engine that keeps micro-batches in flight.

A pipeline of p stages runs a model's decoder layers in contiguous ranges, one
range per process. Stage 0, the *head*, owns everything a request is: the
schedulers, the block tables, sampling and detokenization; it also runs the
first layers. The other stages hold only their layers' weights and KV cache
and run whatever step reaches them, in the order it arrives; the last one
returns the logits of the positions to sample to the head.

Micro-batching: the head's engine has m virtual engines (schedulers over one
block pool, each with its own requests). Each has at most one step in flight,
so up to m steps travel the pipeline at once: while stage k computes step s,
stage k-1 computes step s+1. With one micro-batch the stages take turns.

No NATS in here: the head hands each step to `submit(step_id, batch, hidden,
shipping, prompt_chunks)` (the service sends it on) and the service puts what
comes back into `results` (`StepResult`). `shipping` names the requests whose
prompt completes in the step and that asked for their KV (`stream_prompt_kv`, as a
prefill worker's requests do): the head streams its own layers' KV to its
connectors, and every stage must ship its layers' KV of those blocks.
`prompt_chunks` names the requests whose prompt tokens the step computes, and
how many (for tracing: the stages' share of a request's prefill).
"""

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.engine.config import EngineConfig
from shared.engine.defaults import DEFAULT_MICROBATCHES, DEFAULT_STEP_TIMEOUT_S
from shared.engine.engine import LLMEngine, PlannedStep, RequestOutput
from shared.engine.kv_cache import KVAllocator
from shared.engine.layer_split import LayerRange, LayerSplitError, check_layer_split, even_split, parse_layer_split
from shared.engine.step_batch import StepBatch
from shared.telemetry.utilization import Utilization


@dataclass(slots=True)
class StepResult:
    """What came back for a step: the logits of its sampled positions, or why it failed."""

    step_id: int
    logits: torch.Tensor | None = None
    error: str | None = None


@dataclass(slots=True)
class ShipKV:
    """A request whose prompt KV every stage ships once the step has computed it."""

    request_id: str
    block_ids: list[int]
    num_tokens: int


Submit = Callable[[int, StepBatch, torch.Tensor, list[ShipKV], list[tuple[str, int]]], None]


class PipelineHeadEngine(LLMEngine):
    """Stage 0 of a pipeline: the engine (requests, schedulers, sampling) and the first layers.

    `step()` starts a step on every virtual engine that has none in flight,
    then waits (at most `poll_s`) for steps to come back and returns their
    outputs. A step that fails or is not back within `step_timeout_s` ends
    its requests with `finish_reason="error"`: the stages' KV for them is then
    unknown, so they cannot go on.
    """

    def __init__(self, config: EngineConfig, submit: Submit, *, num_microbatches: int = DEFAULT_MICROBATCHES,
                 step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S, poll_s: float = 0.02, load_tokenizer: bool = True,
                 kv_allocator: KVAllocator | None = None):
        super().__init__(config, load_tokenizer=load_tokenizer, kv_allocator=kv_allocator,
                         num_virtual_engines=num_microbatches)
        if self.local_layers_end >= self.model_config.num_hidden_layers:
            raise LayerSplitError("a pipeline head must leave layers to other stages")
        self._submit = submit
        self.step_timeout_s = step_timeout_s
        self.poll_s = poll_s
        self.results: queue.SimpleQueue[StepResult] = queue.SimpleQueue()
        self._in_flight: dict[int, tuple[PlannedStep, float]] = {}  # step id -> (step, deadline)
        self._busy: set[int] = set()  # virtual engines with a step in flight
        self._next_step_id = 0
        self.steps_started = 0
        self.steps_failed = 0
        self.utilization = Utilization()  # of the head's own layers

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def step(self) -> list[RequestOutput]:
        self.collect_loads()
        for virtual_engine in range(len(self.schedulers)):
            if virtual_engine not in self._busy:
                self._start(virtual_engine)
        outputs = []
        wait_s = self.poll_s if self._in_flight else 0.0
        while True:
            try:
                result = self.results.get(timeout=wait_s) if wait_s > 0 else self.results.get_nowait()
            except queue.Empty:
                break
            outputs += self._finish(result)
            wait_s = 0.0  # take whatever else is there, without waiting again
        outputs += self._expire()
        self.stalled = not self._in_flight and not outputs
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._in_flight) or super().has_unfinished_requests()

    def fail_all(self, reason: str) -> list[RequestOutput]:
        """End every request with an error and forget every cached prefix: for when a stage lost its KV
        (it restarted). Steps still in flight are dropped; whatever they return later is ignored."""
        self._in_flight.clear()
        self._busy.clear()
        outputs = [self._error_output(seq, reason) for seq in list(self._sequences.values())]
        for output in outputs:
            self.abort_request(output.request_id)
        self.block_manager.reset_prefix_cache()
        return outputs

    def _start(self, virtual_engine: int) -> None:
        planned = self.plan_step(virtual_engine)
        if planned is None:
            return
        shipping = [ShipKV(seq.request_id, seq.block_table[: self.block_manager.blocks_needed(seq.num_prompt_tokens)],
                           seq.num_prompt_tokens) for seq in self._completing_streams(planned.scheduled)]
        started = time.monotonic()
        hidden = self.executor.execute(planned.batch, self._layer_streamer(planned.scheduled))
        self.utilization.record(started, time.monotonic())
        step_id = self._next_step_id
        self._next_step_id += 1
        self._in_flight[step_id] = (planned, time.monotonic() + self.step_timeout_s)
        self._busy.add(virtual_engine)
        self.steps_started += 1
        prompt_chunks = [(item.seq.request_id, item.num_new_tokens) for item in planned.scheduled.scheduled
                         if item.seq.num_computed_tokens < item.seq.num_prompt_tokens]
        self._submit(step_id, planned.batch, hidden, shipping, prompt_chunks)

    def _finish(self, result: StepResult) -> list[RequestOutput]:
        entry = self._in_flight.pop(result.step_id, None)
        if entry is None:
            return []  # dropped (timed out, or a reset) before it came back
        planned, _ = entry
        self._busy.discard(planned.virtual_engine)
        if result.error is not None:
            return self._fail_step(planned, result.error)
        return self.complete_step(planned, result.logits)

    def _expire(self) -> list[RequestOutput]:
        now = time.monotonic()
        outputs = []
        for step_id, (planned, deadline) in list(self._in_flight.items()):
            if now > deadline:
                del self._in_flight[step_id]
                self._busy.discard(planned.virtual_engine)
                outputs += self._fail_step(planned, f"a pipeline step was not back within {self.step_timeout_s:g} s")
        return outputs

    def _fail_step(self, planned: PlannedStep, reason: str) -> list[RequestOutput]:
        self.steps_failed += 1
        outputs = []
        for item in planned.scheduled.scheduled:
            seq = item.seq
            if self._sequences.get(seq.request_id) is seq:
                outputs.append(self._error_output(seq, reason))
                self.abort_request(seq.request_id)
        return outputs

    @staticmethod
    def _error_output(seq, reason: str) -> RequestOutput:
        return RequestOutput(request_id=seq.request_id, new_token_ids=[], new_text="", finished=True,
                             finish_reason="error", error=reason, num_prompt_tokens=seq.num_prompt_tokens,
                             num_output_tokens=seq.num_output_tokens)
