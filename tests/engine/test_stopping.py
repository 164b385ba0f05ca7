"""When generation stops, and the text it streams, match transformers' and OpenAI's rules."""

import json
import shutil

import pytest

from reference import reference_greedy
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(default_model):
    return LLMEngine(EngineConfig(model=default_model, dtype="float32", num_kv_blocks=128))


@pytest.fixture(scope="module")
def prompt(engine):
    return engine.tokenizer("Once upon a time, in a quiet valley, there lived").input_ids


def test_streamed_text_is_the_decoded_tokens(engine, prompt):
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 40
    assert out.text == engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_stop_string_truncates_text_before_it(engine, prompt):
    full = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    assert len(out.token_ids) < 40


def test_stop_token_id_ends_generation_and_is_reported(engine, prompt):
    full = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    stop_id = full.token_ids[9]
    first = full.token_ids.index(stop_id)
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop"


def test_eos_stops_like_transformers(tmp_path, default_model, prompt):
    # Declare a token that greedy decoding reaches as EOS; both engines must stop on it.
    model_dir = tmp_path / "model"
    shutil.copytree(default_model, model_dir)
    expected, _ = reference_greedy(default_model, prompt, 30)
    eos = expected[6]
    generation_config = json.loads((model_dir / "generation_config.json").read_text())
    generation_config["eos_token_id"] = eos
    (model_dir / "generation_config.json").write_text(json.dumps(generation_config))

    reference, _ = reference_greedy(str(model_dir), prompt, 30, ignore_eos=False)
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64))
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30))[0]
    assert out.token_ids == reference == expected[: expected.index(eos) + 1]
    assert out.finish_reason == "stop"
    ignoring = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    assert ignoring.token_ids == expected


def test_logprobs_are_returned_per_token(engine, prompt):
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3))[0]
    assert len(out.logprobs) == 5
    for token_id, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token_id and len(lp.top) == 3
        assert lp.top[0][0] == token_id  # greedy picks the most likely token
        assert lp.logprob == pytest.approx(lp.top[0][1]) and lp.logprob <= 0
