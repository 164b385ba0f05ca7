"""The pipeline head and its stages, in one process: stage threads joined by queues stand in for the
stage services (the services' own tests run them as processes over NATS)."""

import queue
import threading

import pytest
import torch

from reference import safe_prompts
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.model_loader import LayerRange
from shared.engine.pipeline import LayerSplitError, PipelineHeadEngine, StepResult, even_split, parse_layer_split
from shared.engine.sampling_params import SamplingParams
from shared.engine.stage import StageRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
NUM_BLOCKS = 256


def test_even_split_spreads_the_remainder_over_the_first_stages():
    assert even_split(4, 2) == [LayerRange(0, 2), LayerRange(2, 4)]
    assert even_split(5, 3) == [LayerRange(0, 2), LayerRange(2, 4), LayerRange(4, 5)]
    assert even_split(4, 4) == [LayerRange(i, i + 1) for i in range(4)]
    with pytest.raises(LayerSplitError, match="at most one stage per layer"):
        even_split(4, 5)
    with pytest.raises(LayerSplitError, match="at least one stage"):
        even_split(4, 0)


@pytest.mark.parametrize("text, message", [
    ("0:2,3:4", "in no stage"),
    ("0:3,2:4", "overlaps"),
    ("0:2,2:5", "has 4 layers"),
    ("0:2", r"layers \[2, 4\) are in no stage"),
    ("1:4", r"layers \[0, 1\) are in no stage"),
    ("0:2,x", "START:END"),
    ("0:0,0:4", "empty"),
])
def test_bad_layer_splits_say_what_is_wrong(text, message):
    with pytest.raises(LayerSplitError, match=message):
        parse_layer_split(text, 4)


def test_layer_split_parses_uneven_ranges():
    assert parse_layer_split("0:1, 1:4", 4) == [LayerRange(0, 1), LayerRange(1, 4)]


class ThreadPipeline:
    """Stages after the head, each on its own thread, taking steps in order from the one before."""

    def __init__(self, model_dir: str, ranges: list[LayerRange], fail_step: int | None = None):
        self.stages = [StageRunner(model_dir, r, dtype="float32", num_blocks=NUM_BLOCKS, block_size=16) for r in ranges]
        self.inboxes = [queue.SimpleQueue() for _ in self.stages]
        self.head: PipelineHeadEngine | None = None
        self.fail_step = fail_step
        self.max_in_flight = 0  # most steps in the pipeline at once
        self.prompt_chunks: list[tuple[str, int]] = []  # (request id, prompt tokens) of every step sent
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(len(self.stages))]
        for thread in self.threads:
            thread.start()

    def submit(self, step_id, batch, hidden, shipping, prompt_chunks) -> None:
        self.prompt_chunks.extend(prompt_chunks)
        self.max_in_flight = max(self.max_in_flight, self.head.num_in_flight)
        self.inboxes[0].put((step_id, batch, hidden))

    def _run(self, index: int) -> None:
        stage = self.stages[index]
        while True:
            item = self.inboxes[index].get()
            if item is None:
                return
            step_id, batch, hidden = item
            if step_id == self.fail_step and index == len(self.stages) - 1:
                self.head.results.put(StepResult(step_id, error="the stage failed"))
                continue
            out = stage.execute(batch, hidden)
            if index + 1 < len(self.stages):
                self.inboxes[index + 1].put((step_id, batch, out))
            else:
                self.head.results.put(StepResult(step_id, logits=out))

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)


def make_pipeline(model_dir: str, ranges: list[LayerRange], microbatches: int, **options):
    stages = ThreadPipeline(model_dir, ranges[1:], fail_step=options.pop("fail_step", None))
    config = EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=NUM_BLOCKS, layer_ranges=[ranges[0]], **options)
    head = PipelineHeadEngine(config, stages.submit, num_microbatches=microbatches, load_tokenizer=False)
    stages.head = head
    return head, stages


@pytest.fixture(scope="module")
def prompts(default_model):
    engine = LLMEngine(EngineConfig(model=default_model, dtype="float32", num_kv_blocks=64), load_tokenizer=False)
    return safe_prompts(default_model, engine.vocab_size, [5, 16, 40, 90, 200], GREEDY.max_tokens, seed=3)


@pytest.mark.parametrize("ranges, microbatches", [
    ([LayerRange(0, 2), LayerRange(2, 4)], 1),
    ([LayerRange(0, 2), LayerRange(2, 4)], 2),
    ([LayerRange(0, 2), LayerRange(2, 3), LayerRange(3, 4)], 3),
    ([LayerRange(0, 1), LayerRange(1, 2), LayerRange(2, 3), LayerRange(3, 4)], 4),
])
def test_pipeline_output_matches_transformers(default_model, prompts, ranges, microbatches):
    head, stages = make_pipeline(default_model, ranges, microbatches, max_num_batched_tokens=64)
    try:
        results = head.generate([p for p, _ in prompts] * 2, GREEDY)  # copies hit the prefix cache
        assert [r.token_ids for r in results] == [e for _, e in prompts] * 2
        assert head.block_manager.num_used_blocks == 0 and head.num_in_flight == 0
        assert stages.max_in_flight == min(microbatches, len(prompts) * 2)  # the micro-batches were in flight together
        # Each step named the prompt tokens it computed: every prompt's uncached tokens, once, in budget-sized chunks.
        computed: dict[str, int] = {}
        for request_id, tokens in stages.prompt_chunks:
            assert 0 < tokens <= 64
            computed[request_id] = computed.get(request_id, 0) + tokens
        assert [computed[r.request_id] + r.num_cached_tokens for r in results] == [len(p) for p, _ in prompts] * 2
    finally:
        stages.close()


def test_stages_hold_only_their_layers_weights(default_model):
    whole = StageRunner(default_model, LayerRange(1, 4), dtype="float32", num_blocks=8, block_size=16)
    parts = [StageRunner(default_model, r, dtype="float32", num_blocks=8, block_size=16)
             for r in (LayerRange(1, 2), LayerRange(2, 4))]
    assert sum(p.parameter_bytes for p in parts) < whole.parameter_bytes + parts[0].parameter_bytes
    assert parts[0].parameter_bytes < parts[1].parameter_bytes < whole.parameter_bytes
    assert parts[0].runner.kv_cache.tensor.shape[0] == 1 and parts[1].runner.kv_cache.tensor.shape[0] == 2


def test_a_failed_step_ends_its_requests_with_an_error_and_the_rest_go_on(default_model, prompts):
    head, stages = make_pipeline(default_model, [LayerRange(0, 2), LayerRange(2, 4)], 2, fail_step=0)
    try:
        results = head.generate([p for p, _ in prompts], GREEDY)
        failed = [r for r in results if r.finish_reason == "error"]
        assert failed and len(failed) < len(results)
        for result, (_, expected) in zip(results, prompts):
            if result.finish_reason != "error":
                assert result.token_ids == expected
        assert head.block_manager.num_used_blocks == 0 and head.steps_failed == 1
    finally:
        stages.close()


def test_a_step_that_never_returns_times_out(default_model, prompts):
    head = PipelineHeadEngine(
        EngineConfig(model=default_model, dtype="float32", num_kv_blocks=NUM_BLOCKS, layer_ranges=[LayerRange(0, 2)]),
        lambda step_id, batch, hidden, shipping, prompt_chunks: None, step_timeout_s=0.2, load_tokenizer=False)
    results = head.generate([prompts[0][0]], GREEDY)
    assert results[0].finish_reason == "error" and head.block_manager.num_used_blocks == 0


def test_fail_all_ends_every_request_and_forgets_cached_prefixes(default_model, prompts):
    head, stages = make_pipeline(default_model, [LayerRange(0, 2), LayerRange(2, 4)], 2)
    try:
        head.generate([prompts[3][0]], GREEDY)
        assert head.block_manager.num_free_blocks < NUM_BLOCKS or head.block_manager.cached_free_block_ids
        head.add_request("a", prompts[2][0], GREEDY)
        head.add_request("b", prompts[1][0], GREEDY)
        head.step()
        outputs = head.fail_all("stage-1 restarted")
        assert {o.request_id for o in outputs} == {"a", "b"} and all(o.error for o in outputs)
        assert not head.has_unfinished_requests() and not head.block_manager.cached_free_block_ids
        assert head.block_manager.num_free_blocks == NUM_BLOCKS
    finally:
        stages.close()


def test_a_head_that_holds_every_layer_is_refused(default_model):
    with pytest.raises(LayerSplitError):
        PipelineHeadEngine(EngineConfig(model=default_model, dtype="float32", num_kv_blocks=8),
                           lambda *a: None, load_tokenizer=False)
    with pytest.raises(ValueError, match="pipeline head"):
        StageRunner(default_model, LayerRange(0, 2), num_blocks=8, block_size=16)


def test_a_stage_refuses_steps_that_do_not_fit(default_model, prompts):
    stage = StageRunner(default_model, LayerRange(2, 4), dtype="float32", num_blocks=4, block_size=16)
    head, stages = make_pipeline(default_model, [LayerRange(0, 2), LayerRange(2, 4)], 1)
    stages.close()
    planned = head.plan_step(0) if head.add_request("x", prompts[1][0], GREEDY) is None else None
    hidden = head.executor.execute(planned.batch)
    with pytest.raises(ValueError, match="hidden states"):
        stage.execute(planned.batch, hidden[:-1])
    planned.batch.block_tables[0] = [9]
    with pytest.raises(ValueError, match="outside this stage's 4"):
        stage.execute(planned.batch, hidden)
    assert torch.is_tensor(hidden)
