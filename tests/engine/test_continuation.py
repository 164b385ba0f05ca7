"""A request moved from a worker that failed goes on from the tokens its client already has, as if nothing
happened: the same tokens after them, and the same text after what was streamed (what the first worker's
detokenizer held back, a character's first bytes or a possible stop string's start, comes out here)."""

import pytest

from shared.engine.config import EngineConfig
from shared.engine.continuation import Continuation
from shared.engine.engine import LLMEngine
from shared.engine.errors import InvalidRequestError
from shared.engine.kv_connector import KVConnector, LoadEnd
from shared.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(default_model):
    return LLMEngine(EngineConfig(model=default_model, dtype="float32", num_kv_blocks=256))


def run(engine, request_id, prompt, params, continuation=None) -> list[tuple[int, str]]:
    """(token, text released with it) per step, until the request ends."""
    engine.add_request(request_id, prompt, params, continuation)
    steps = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            steps += [(token, out.new_text if i == len(out.new_token_ids) - 1 else "")
                      for i, token in enumerate(out.new_token_ids)]
    return steps


PARAMS = {  # greedy, and seeded sampling (drawn by position)
    "greedy": dict(temperature=0.0, max_tokens=40, ignore_eos=True),
    "seeded": dict(temperature=0.9, top_p=0.95, seed=7, max_tokens=40, ignore_eos=True),
}


@pytest.mark.parametrize("name", PARAMS)
@pytest.mark.parametrize("moved_at", [1, 9, 39])
def test_a_moved_request_streams_what_the_uninterrupted_one_would_have(engine, name, moved_at):
    prompt = engine.tokenizer("Once upon a time, in a quiet valley, there lived").input_ids
    plain = run(engine, f"plain-{name}-{moved_at}", prompt, SamplingParams(**PARAMS[name]))
    # A stop string that never matches but starts with the text's last two characters at the move: the first
    # worker held them back, so the new one must release them.
    text_at_move = engine.tokenizer.decode([t for t, _ in plain[:moved_at]])
    params = SamplingParams(**PARAMS[name], stop=[text_at_move[-2:] + "\u00a7\u00b6"])
    whole = run(engine, f"whole-{name}-{moved_at}", prompt, params)
    tokens = [t for t, _ in whole]
    streamed_text = "".join(text for _, text in whole[:moved_at])
    assert text_at_move.startswith(streamed_text) and len(streamed_text) <= len(text_at_move) - 2  # held back
    rest = run(engine, f"moved-{name}-{moved_at}", prompt, params, Continuation(output_token_ids=tokens[:moved_at]))
    assert tokens[:moved_at] + [t for t, _ in rest] == tokens
    assert streamed_text + "".join(text for _, text in rest) == "".join(text for _, text in whole)


def test_a_move_past_a_stop_string_is_refused(engine):
    prompt = engine.tokenizer("Once upon a time").input_ids
    whole = run(engine, "whole-stop", prompt, SamplingParams(**PARAMS["greedy"]))
    text = engine.tokenizer.decode([t for t, _ in whole[:6]])
    stop = text[-2:]
    with pytest.raises(InvalidRequestError, match="stop string"):
        engine.add_request("moved-past-stop", prompt, SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]),
                           Continuation(output_token_ids=[t for t, _ in whole[:6]]))
    assert not engine.has_unfinished_requests()


class _FirstTokenElsewhere(KVConnector):
    """A remote prefill whose KV never comes: the engine computes the prompt, and goes on after the first token
    judged by `remote_first_token` (its load's continuation)."""

    def __init__(self):
        self.firsts, self._ended = {}, []

    def external_prefix(self, request_id, token_ids, num_local_tokens):
        return len(token_ids) - num_local_tokens if request_id in self.firsts else 0

    def start_load(self, request_id, block_ids, first_token, num_tokens):
        self._ended.append(LoadEnd(request_id, False, self.firsts.pop(request_id).continuation))

    def finished_loads(self):
        ended, self._ended = self._ended, []
        return ended


@pytest.mark.parametrize("name", PARAMS)
def test_a_first_token_sampled_elsewhere_streams_as_if_sampled_here(engine, name):
    prompt = engine.tokenizer("Once upon a time, in a quiet valley, there lived").input_ids
    plain = run(engine, f"plain-first-{name}", prompt, SamplingParams(**PARAMS[name]))
    # A stop string that starts with the first token's text: the engine holds that text back, here as there.
    params = SamplingParams(**PARAMS[name], stop=[engine.tokenizer.decode([plain[0][0]]) + "\u00a7\u00b6"])
    whole = run(engine, f"whole-first-{name}", prompt, params)
    first = engine.remote_first_token(prompt, params, whole[0][0])
    assert (first.text, first.finish_reason) == (whole[0][1], None)
    connector = _FirstTokenElsewhere()
    engine.connect(connector)
    connector.firsts[f"remote-{name}"] = first
    rest = run(engine, f"remote-{name}", prompt, params)
    assert [whole[0][0]] + [t for t, _ in rest] == [t for t, _ in whole]
    assert first.text + "".join(text for _, text in rest) == "".join(text for _, text in whole)


def test_a_first_token_sampled_elsewhere_can_end_the_request(engine):
    prompt = engine.tokenizer("Once upon a time").input_ids
    first = engine.remote_first_token(prompt, SamplingParams(temperature=0.0, max_tokens=1), 42, num_cached_tokens=16)
    assert first.finish_reason == "length"
    assert (first.continuation.output_token_ids, first.continuation.num_cached_tokens) == ([42], 16)
