"""Edge cases that once hung the engine or corrupted its cache."""

import json
import shutil

import pytest

from shared.engine.continuation import Continuation
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.errors import EngineError, InvalidRequestError, ModelLoadError
from shared.engine.model_loader import load_model
from shared.engine.sampling_params import SamplingParams
from support.kv_from_elsewhere import KVFromElsewhere

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
    engine.connect(KVFromElsewhere(engine, parts, first, request_ids={"b"}))
    engine.add_request("b", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                       read_prefix_cache=False)
    run_to_end(engine)
    assert engine.block_manager.num_used_blocks == 0


def test_continuation_past_max_tokens_is_rejected(default_model):
    engine = make_engine(default_model)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        engine.add_request("x", [1, 2, 3, 4], SamplingParams(max_tokens=5), Continuation(output_token_ids=list(range(5, 15))))
    assert not engine.has_unfinished_requests()


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


def test_a_load_into_a_full_batch_waits_for_a_slot(default_model):
    prompt = list(range(10, 22))
    first, parts, _ = exported_prompt_kv(default_model, prompt)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reference = make_engine(default_model, block_size=4).generate([prompt], params)[0].token_ids
    engine = make_engine(default_model, block_size=4, max_num_seqs=1)
    connector = KVFromElsewhere(engine, parts, first, request_ids={"cont"})
    engine.connect(connector)
    engine.add_request("busy", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.step()
    engine.add_request("cont", prompt, params, read_prefix_cache=False)
    tokens = [first]
    while engine.has_unfinished_requests():
        busy = engine.get_sequence("busy") is not None
        tokens += [t for o in engine.step() if o.request_id == "cont" for t in o.new_token_ids]
        assert not (busy and connector.loads)  # nothing loads (nor goes out to prefill) while the batch is full
    assert tokens == reference and len(connector.loads) == 1


def test_a_refused_request_is_over_for_the_connectors_but_not_a_running_one_of_that_id(default_model):
    engine = make_engine(default_model)
    connector = KVFromElsewhere(engine, [], 0, request_ids=())
    engine.connect(connector)
    engine.add_request("dup", [1, 2, 3], GREEDY)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", list(range(12)), GREEDY)
    with pytest.raises(InvalidRequestError):
        engine.add_request("empty", [], GREEDY)
    assert connector.ended == ["empty"]  # the running "dup" is not over
    run_to_end(engine)
    assert connector.ended == ["empty", "dup"]
