"""Edge cases that once hung the engine or corrupted its cache."""

import json
import shutil

import pytest

from shared.engine.continuation import Continuation, ReservedKV
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.errors import EngineError, InvalidRequestError, ModelLoadError
from shared.engine.model_loader import load_model
from shared.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def make_engine(model_dir, **overrides):
    config = dict(model=model_dir, dtype="float32", num_kv_blocks=64)
    config.update(overrides)
    return LLMEngine(EngineConfig(**config), load_tokenizer=False)


def run_to_end(engine, max_steps=500):
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError("the engine did not finish: a request hangs")


def exported_prompt_kv(model_dir, prompt, block_size=4):
    source = make_engine(model_dir, block_size=block_size)
    source.add_request("src", prompt, GREEDY)
    first = []
    while not first:
        first = source.step()
    parts = [source.export_kv("src")]
    return first[0].new_token_ids[0], parts, source


def test_imported_request_under_memory_pressure_does_not_hang(default_model):
    prompt = list(range(10, 22))
    first, parts, _ = exported_prompt_kv(default_model, prompt)
    engine = make_engine(default_model, block_size=4, num_kv_blocks=12)
    engine.add_request("a", list(range(30, 34)), GREEDY)
    engine.step()
    engine.add_request("c", list(range(40, 68)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.add_request("b", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                       Continuation(output_token_ids=[first], kv=parts))
    run_to_end(engine)
    assert engine.block_manager.num_used_blocks == 0


def test_continuation_past_max_tokens_is_rejected(default_model):
    engine = make_engine(default_model)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        engine.add_request("x", [1, 2, 3, 4], SamplingParams(max_tokens=5), Continuation(output_token_ids=list(range(5, 15))))
    assert not engine.has_unfinished_requests()


def test_partial_export_cannot_be_imported_as_a_prefix(default_model):
    prompt = list(range(10, 22))
    _, _, source = exported_prompt_kv(default_model, prompt)
    data, layout = source.export_kv("src", block_start=1, block_end=3)
    assert layout.block_start == 1
    target = make_engine(default_model, block_size=4)
    with pytest.raises(EngineError, match="first block"):
        target.add_request("y", prompt, GREEDY, Continuation(output_token_ids=[5], kv=[(data, layout)]))
    assert target.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("layers", [(0, 10), (3, 3), (5, 7), (-1, 2)])
def test_export_rejects_layers_outside_the_model(default_model, layers):
    _, _, source = exported_prompt_kv(default_model, list(range(10, 22)))
    with pytest.raises(EngineError, match="outside the model"):
        source.export_kv("src", layer_start=layers[0], layer_end=layers[1])


def test_generate_shares_the_engine_and_cleans_up_after_bad_input(default_model):
    engine = make_engine(default_model)
    engine.add_request("mine", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    with pytest.raises(InvalidRequestError):
        engine.generate([[1, 2, 3], []], GREEDY)
    with pytest.raises(ValueError, match="2 prompts but 1"):
        engine.generate([[1, 2], [3, 4]], [GREEDY])
    results = engine.generate([[1, 2, 3]], GREEDY)
    assert len(results[0].token_ids) == 24
    mine = engine.get_sequence("mine")  # kept running beside generate(), not swallowed by it
    assert mine is not None and mine.num_output_tokens > 0


def test_unverified_causal_lm_families_are_refused(tmp_path, default_model):
    shutil.copytree(default_model, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config.update(model_type="granite", architectures=["GraniteForCausalLM"])
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="granite"):
        load_model(tmp_path / "m")


def test_continuation_into_a_full_batch_is_recomputed_not_refused(default_model):
    prompt = list(range(10, 22))
    first, parts, _ = exported_prompt_kv(default_model, prompt)
    reference = make_engine(default_model, block_size=4).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].token_ids
    engine = make_engine(default_model, block_size=4, max_num_seqs=1)
    engine.add_request("busy", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.step()
    block_ids = engine.reserve_blocks(len(prompt))
    for data, layout in parts:
        engine.write_kv(block_ids, data, layout)
    used_before = engine.block_manager.num_used_blocks
    engine.add_request("cont", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                       Continuation(output_token_ids=[first], reserved=ReservedKV(block_ids, len(prompt))))
    assert engine.block_manager.num_used_blocks == used_before - len(block_ids)  # given back, to recompute later
    tokens = [first]
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() if o.request_id == "cont" for t in o.new_token_ids]
    assert tokens == reference


def test_refused_continuation_gives_its_reserved_blocks_back(default_model):
    engine = make_engine(default_model)
    engine.add_request("dup", [1, 2, 3], GREEDY)
    block_ids = engine.reserve_blocks(12)
    used = engine.block_manager.num_used_blocks
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", list(range(12)), GREEDY, Continuation(output_token_ids=[4], reserved=ReservedKV(block_ids, 12)))
    assert engine.block_manager.num_used_blocks == used - len(block_ids)
