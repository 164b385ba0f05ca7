"""A sequence's KV exported from one engine continues identically in another (loaded as a remote prefill loads
it, through a connector)."""

import pytest
import torch

from reference import safe_prompts
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.continuation import KVOrigin
from shared.engine.errors import EngineError
from shared.engine.kv_connector import KVConnector
from shared.engine.sampling_params import SamplingParams
from support.kv_from_elsewhere import KVFromElsewhere

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


class OnBlocksComputed(KVConnector):
    def __init__(self, handle):
        self.handle = handle

    def blocks_computed(self, block_hashes, export):
        self.handle(block_hashes, export)


class OnPromptLayer(KVConnector):
    def __init__(self, handle):
        self.handle = handle

    def prompt_layer_computed(self, request_id, data, layout):
        self.handle(request_id, data, layout)


def make_engine(model_dir, **overrides):
    return LLMEngine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=128, **overrides), load_tokenizer=False)


def prefill_and_export(engine, prompt, params, layer_parts):
    """Run the prompt until its first token; export its KV in layer parts, then drop it."""
    engine.add_request("src", prompt, params)
    first = []
    while not first:
        first = [o for o in engine.step() if o.request_id == "src"]
    parts = [engine.export_kv("src", layer_start=a, layer_end=b) for a, b in layer_parts]
    engine.abort_request("src")
    return first[0].new_token_ids[0], parts


def continue_elsewhere(model_dir, prompt, params, first_token, parts, target=None, **connector_options):
    """Load the KV into a fresh engine (or `target`) and generate the rest; all tokens from the first on."""
    target = target or make_engine(model_dir)
    target.connect(KVFromElsewhere(target, parts, first_token, request_ids={"dst"}, **connector_options))
    target.add_request("dst", prompt, params, read_prefix_cache=False)
    tokens = [first_token]
    while target.has_unfinished_requests():
        for out in target.step():
            tokens += out.new_token_ids
    return tokens


@pytest.fixture(scope="module")
def case(default_model):
    engine = make_engine(default_model)
    return safe_prompts(default_model, engine.vocab_size, [45], GREEDY.max_tokens, seed=7)[0]


@pytest.mark.parametrize("layer_parts", [[(0, 4)], [(0, 1), (1, 4)], [(2, 4), (0, 2)]])
def test_import_continues_with_identical_tokens(default_model, case, layer_parts):
    prompt, expected = case
    source = make_engine(default_model)
    first_token, parts = prefill_and_export(source, prompt, GREEDY, layer_parts)
    assert source.block_manager.num_used_blocks == 0
    assert sum(p[1].num_bytes for p in parts) == sum(p[0].numel() * p[0].element_size() for p in parts)
    assert all(layout.num_tokens == len(prompt) for _, layout in parts)

    assert continue_elsewhere(default_model, prompt, GREEDY, first_token, parts) == expected


def test_seeded_sampling_continues_identically_after_import(default_model, case):
    prompt, greedy = case
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    whole = make_engine(default_model).generate([prompt], params)[0].token_ids
    assert whole != greedy  # sampled, so a continuation that dropped the seed or temperature would differ
    first_token, parts = prefill_and_export(make_engine(default_model), prompt, params, [(0, 4)])
    assert continue_elsewhere(default_model, prompt, params, first_token, parts) == whole


def test_kv_that_does_not_fit_the_blocks_is_refused(default_model, case):
    prompt, _ = case
    source = make_engine(default_model)
    _, parts = prefill_and_export(source, prompt, GREEDY, [(0, 4)])
    target = make_engine(default_model)
    data, layout = parts[0]  # 45 tokens: 3 blocks
    with pytest.raises(EngineError, match="does not fit"):
        target.write_kv([0, 1], data, layout)
    source.add_request("again", prompt, GREEDY)
    source.step()
    data, layout = source.export_kv("again", block_start=1, block_end=3)
    with pytest.raises(EngineError, match="first block"):
        target.write_kv([0, 1], data, layout)


def test_prefill_decode_handoff_through_held_blocks_and_a_load(default_model, case):
    """The PD path inside the engine: prefill holds its KV, decode loads it (layers in any order)."""
    prompt, expected = case
    prefill = make_engine(default_model)
    prefill.add_request("p", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), hold_kv=True)
    first = [o for o in prefill.step()]
    assert first[0].finished and prefill.num_held == 1
    held_blocks = prefill.block_manager.num_used_blocks
    parts = [prefill.export_kv("p", layer_start=a, layer_end=b) for a, b in [(0, 2), (2, 4)]]
    assert prefill.release_held("p") and prefill.block_manager.num_used_blocks == 0 and held_blocks > 0

    decode = make_engine(default_model)
    assert continue_elsewhere(default_model, prompt, GREEDY, first[0].new_token_ids[0], parts[::-1], decode) == expected
    assert decode.block_manager.num_used_blocks == 0


def test_prompt_kv_streams_layer_by_layer_during_the_completing_step(default_model, case):
    prompt, expected = case
    engine = make_engine(default_model, max_num_batched_tokens=16)  # 45 tokens: chunks of 16, 16, 13
    streamed = []
    streamed_ids = []

    def on_layer(request_id, data, layout):
        streamed_ids.append(request_id)
        streamed.append((data, layout))

    engine.connect(OnPromptLayer(on_layer))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request("p", prompt, params, hold_kv=True, stream_prompt_kv=True)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        assert len(streamed) in (0, 4)  # nothing until the step that completes the prompt, then every layer
    assert steps == 3
    assert [layout.layer_start for _, layout in streamed] == [0, 1, 2, 3]
    for data, layout in streamed:  # views of the held blocks: identical to exporting afterwards
        again, _ = engine.export_kv("p", layer_start=layout.layer_start, layer_end=layout.layer_end)
        assert layout.num_tokens == len(prompt) and torch.equal(data.gather(), again)
    engine.generate([prompt[:20]], params)  # a request that did not ask is not streamed
    assert streamed_ids == ["p"] * 4
    # And they continue generation elsewhere like any export.
    assert continue_elsewhere(default_model, prompt, GREEDY, expected[0], streamed) == expected


def test_decoded_blocks_are_written_back_every_eight_and_imported_ones_only_when_not_already(default_model):
    from shared.engine.engine import WRITE_BACK_BLOCKS

    prompt, _ = safe_prompts(default_model, 2048, [40], 1, seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    engine = make_engine(default_model)
    calls = []
    engine.connect(OnBlocksComputed(lambda hashes, export: calls.append(len(hashes))))
    engine.generate([prompt], params)
    # 40 + 199 computed tokens = 14 full blocks: the prompt's 2, then 8 as decoding fills them, then the rest.
    assert WRITE_BACK_BLOCKS == 8 and calls == [2, 8, 4]

    first_token, parts = prefill_and_export(make_engine(default_model), prompt, GREEDY, [(0, 4)])
    hashes = make_engine(default_model).prefix_block_hashes(prompt)
    for origin in (KVOrigin.WRITTEN_BACK, KVOrigin.COMPUTED):
        target = make_engine(default_model)
        calls = []
        target.connect(OnBlocksComputed(lambda hashes, export: calls.append(hashes)))
        continue_elsewhere(default_model, prompt, GREEDY, first_token, parts, target, kv_origin=origin)
        # 40 + 19 computed tokens: 3 full blocks, of which the first 2 came in; sent back only if not stored yet.
        written = [h for call in calls for h in call]
        assert len(written) == (1 if origin is KVOrigin.WRITTEN_BACK else 3) and written[-1] not in hashes, origin
        assert written[:-1] == ([] if origin is KVOrigin.WRITTEN_BACK else hashes), origin
        assert target.prefix_cache_counts()["prompt_tokens_computed"] == 0
