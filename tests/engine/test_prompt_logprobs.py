"""A prompt's logprobs: transformers' own at every position, however the prompt is chunked or cached."""

import pytest
from reference import reference_logprobs

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.sampling_params import SamplingParams


def run(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams) -> list:
    engine.add_request(request_id, prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    given = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
    assert len(given) == 1 and outputs[0].prompt_logprobs is not None  # once, with the first output
    return given[0]


@pytest.mark.parametrize("chunk", [16, 2048])
def test_prompt_logprobs_match_transformers_chunked_or_not_and_cached_or_not(default_model, chunk):
    engine = LLMEngine(EngineConfig(model=default_model, dtype="float32", device="cpu", num_kv_blocks=64,
                                    max_num_batched_tokens=chunk))
    prompt = list(range(40, 140))
    reference = reference_logprobs(default_model, prompt[:1], prompt[1:])
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))  # the prompt now in the prefix cache
    for attempt in range(2):
        entries = run(engine, f"r{attempt}", prompt, params)
        assert [e.token_id for e in entries] == prompt[1:]
        for j, entry in enumerate(entries):
            row = reference[j]
            assert entry.logprob == pytest.approx(row[prompt[j + 1]].item(), abs=1e-4)
            assert entry.rank == int((row > row[prompt[j + 1]]).sum()) + 1
            assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()


def test_a_one_token_prompt_has_none_and_zero_alternatives_give_none(default_model):
    engine = LLMEngine(EngineConfig(model=default_model, dtype="float32", device="cpu", num_kv_blocks=16))
    assert run(engine, "one", [7], SamplingParams(max_tokens=1, prompt_logprobs=2)) == []
    entries = run(engine, "two", [7, 8, 9], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert len(entries) == 2 and all(e.top == [] for e in entries)
