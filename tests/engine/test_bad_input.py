"""Bad input gets a clear error and the engine keeps serving everyone else."""

import pytest

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.errors import InvalidRequestError
from shared.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(default_model):
    return LLMEngine(EngineConfig(model=default_model, dtype="float32", num_kv_blocks=64, max_model_len=256))


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_invalid_sampling_params_name_the_parameter():
    cases = [
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_p=2.0), "min_p"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(logprobs=99), "logprobs"),
        (dict(stop=[""]), "stop"),
    ]
    for kwargs, param in cases:
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**kwargs).validate()
        assert info.value.param == param, kwargs
        assert param in str(info.value)


def test_bad_requests_are_rejected_while_others_run(engine):
    prompt = engine.tokenizer("A lighthouse stood on the cliff").input_ids
    expected = engine.generate([prompt], GREEDY)[0].token_ids

    engine.add_request("good", prompt, GREEDY)
    tokens = [t for out in engine.step() for t in out.new_token_ids]  # the good request is now running
    bad = [
        ([], GREEDY, "prompt", "empty"),
        ([5] * 300, GREEDY, "prompt", "300 tokens"),
        ([engine.vocab_size + 7], GREEDY, "prompt", "vocabulary"),
        (prompt, SamplingParams(stop_token_ids=[engine.vocab_size]), "stop_token_ids", "vocabulary"),
        (prompt, SamplingParams(stop_token_ids=[-1]), "stop_token_ids", "vocabulary"),
        (prompt, SamplingParams(top_p=1.5), "top_p", "top_p"),  # a direct engine user's, checked on the way in
    ]
    for i, (bad_prompt, params, param, words) in enumerate(bad):
        with pytest.raises(InvalidRequestError, match=words) as info:
            engine.add_request(f"bad-{i}", bad_prompt, params)
        assert info.value.param == param
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("good", prompt, GREEDY)

    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "good"
            tokens += out.new_token_ids
    assert tokens == expected
    assert engine.block_manager.num_used_blocks == 0


def test_generation_stops_at_max_model_len(engine):
    prompt = [7] * 250
    result = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))[0]
    assert len(result.token_ids) == 6 and result.finish_reason == "length"


def test_request_larger_than_the_kv_pool_is_rejected(default_model):
    small = LLMEngine(EngineConfig(model=default_model, num_kv_blocks=4), load_tokenizer=False)
    with pytest.raises(InvalidRequestError, match="4 blocks"):
        small.add_request("big", [1] * 60, SamplingParams(max_tokens=20))


def test_abort_frees_blocks_at_once(engine):
    engine.add_request("a", [3] * 100, GREEDY)
    engine.add_request("b", [4] * 40, GREEDY)
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    assert engine.abort_request("a") and engine.abort_request("b")
    assert engine.block_manager.num_used_blocks == 0
    assert not engine.has_unfinished_requests()
    assert engine.abort_request("a") is False
