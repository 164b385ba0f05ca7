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


def _transformers_greedy(model_dir: str, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    import torch

    from reference import reference_model

    model = reference_model(model_dir)
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new_tokens,
                         pad_token_id=model.generation_config.pad_token_id or 0, **kwargs)
    return out[0, len(prompt):].tolist()


def test_min_tokens_holds_back_a_stop_token_as_transformers_min_new_tokens_does(engine, prompt, default_model):
    full = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    stop_id = full.token_ids[2]
    held = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_id],
                                                    ignore_eos=True, min_tokens=8))[0]
    # transformers: the same token as EOS, min_new_tokens=8 (it is suppressed for the first 8 steps, then stops).
    expected = _transformers_greedy(default_model, prompt, 30, eos_token_id=stop_id, min_new_tokens=8)
    assert held.token_ids == expected
    assert stop_id not in held.token_ids[:8]
    assert len(held.token_ids) > 8 or held.finish_reason == "length"


def test_min_tokens_lets_no_stop_string_end_the_text_early(engine, prompt):
    full = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    stop = engine.tokenizer.decode(full.token_ids[1:2])
    assert stop.strip(), "the second token's text is a usable stop string"
    early = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert len(early.token_ids) == 2 and early.finish_reason == "stop"
    later = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop],
                                                     min_tokens=10))[0]
    assert len(later.token_ids) > 10 or later.finish_reason == "length"
    assert later.token_ids == full.token_ids[:len(later.token_ids)]  # min_tokens changes no greedy choice here


def test_logit_bias_moves_greedy_choices_as_transformers_sequence_bias_does(engine, prompt, default_model):
    full = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    banned, favoured = full.token_ids[0], full.token_ids[5]
    bias = {banned: -100.0, favoured: 3.5}
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                   logit_bias=bias))[0]
    expected = _transformers_greedy(default_model, prompt, 12, min_new_tokens=12,
                                    sequence_bias={(banned,): -100.0, (favoured,): 3.5})
    assert out.token_ids == expected and banned not in out.token_ids
    forced = engine.generate([prompt], SamplingParams(temperature=0.7, seed=1, max_tokens=6, ignore_eos=True,
                                                      logit_bias={favoured: 100.0}))[0]
    assert forced.token_ids == [favoured] * 6  # sampled too: +100 leaves nothing else a chance


def test_include_stop_str_in_output_keeps_the_stop_string(engine, prompt):
    full = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop],
                                                   include_stop_str_in_output=True))[0]
    assert out.finish_reason == "stop" and out.text == full.text[: full.text.index(stop) + len(stop)]
