"""Structured output with the real default model: whatever it writes parses and follows its constraint."""

import json
import re

import jsonschema
import pytest
from transformers import AutoTokenizer

from shared.engine.config import EngineConfig
from shared.engine.continuation import Continuation
from shared.engine.engine import LLMEngine
from shared.engine.errors import InvalidRequestError
from shared.engine.model_registry import DEFAULT_MODEL, resolve_model
from shared.engine.sampling_params import SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["engineer", "artist", "doctor"]},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "languages", "address"],
    "additionalProperties": False,
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def smollm2(cache_dir) -> str:
    return str(resolve_model(DEFAULT_MODEL).model_dir)


@pytest.fixture(scope="module")
def engine(smollm2) -> LLMEngine:
    return LLMEngine(EngineConfig(model=smollm2, dtype="float32", device="cpu", num_kv_blocks=256))


@pytest.fixture(scope="module")
def chat(smollm2):
    tokenizer = AutoTokenizer.from_pretrained(smollm2)

    def prompt(question: str) -> list[int]:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return prompt


def constrained(kind: str, spec: str = "", **sampling) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 160, "temperature": 0.0, **sampling}, structured_kind=kind,
                          structured_spec=spec)


def test_json_schema_output_parses_and_validates_greedy_and_sampled(engine, chat):
    prompts = [chat("Describe a person as JSON."), chat("Tell me about Ada Lovelace.")]
    params = [constrained("json", json.dumps(PERSON))] + [
        constrained("json", json.dumps(PERSON), temperature=1.0, top_p=0.95, seed=seed) for seed in range(3)]
    results = engine.generate([prompts[0]] + [prompts[1]] * 3, params)
    for result in results:
        assert result.finish_reason == "stop", result.text
        jsonschema.validate(json.loads(result.text), PERSON)


def test_json_object_regex_choice_and_grammars(engine, chat):
    cases = [
        (constrained("json_object"), chat("Give me a JSON object about a cat."),
         lambda text: isinstance(json.loads(text), dict)),
        (constrained("regex", r"\(\d{3}\) \d{3}-\d{4}"), chat("What is a phone number?"),
         lambda text: re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", text)),
        (constrained("choice", json.dumps(["Paris", "London", "Rome"]), temperature=1.0, seed=5),
         chat("What is the capital of Italy?"), lambda text: text in ("Paris", "London", "Rome")),
        (constrained("grammar", 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]+/'), chat("What is 2+2?"),
         lambda text: re.fullmatch(r"The answer is [0-9]+\.", text)),
        (constrained("grammar", 'root ::= "yes" | "no"'), chat("Is water wet?"),  # GBNF, as llama.cpp writes it
         lambda text: text in ("yes", "no")),
    ]
    results = engine.generate([prompt for _, prompt, _ in cases], [params for params, _, _ in cases])
    for (params, _, follows), result in zip(cases, results):
        assert result.finish_reason == "stop" and follows(result.text), (params.structured_kind, result.text)


def test_a_constrained_request_leaves_its_batch_neighbours_as_they_were(engine, chat):
    free = SamplingParams(max_tokens=24, temperature=0.0)
    prompt = chat("What is the capital of France?")
    alone = engine.generate([prompt], free)[0]
    together = engine.generate([prompt, chat("A person as JSON.")], [free, constrained("json", json.dumps(PERSON))])
    assert together[0].token_ids == alone.token_ids
    jsonschema.validate(json.loads(together[1].text), PERSON)


def test_a_request_arriving_with_output_goes_on_inside_its_grammar(engine, chat):
    """As a prefill worker's first token or a moved request brings it: the matcher is fed those tokens first, and
    greedy decoding goes on exactly as it would have."""
    prompt, params = chat("Describe a person as JSON."), constrained("json", json.dumps(PERSON))
    whole = engine.generate([prompt], params)[0]
    for cut in (1, len(whole.token_ids) // 2):
        engine.add_request(f"resumed-{cut}", prompt, params, Continuation(output_token_ids=whole.token_ids[:cut]))
        rest = []
        while engine.has_unfinished_requests():
            rest += [t for out in engine.step() for t in out.new_token_ids]
        assert whole.token_ids[:cut] + rest == whole.token_ids
    with pytest.raises(InvalidRequestError) as refused:  # output that breaks the grammar: the request is refused
        engine.add_request("broken", prompt, params, Continuation(output_token_ids=[engine.tokenizer.encode("x")[0]]))
    assert refused.value.param == "structured_outputs" and "broken" not in engine.structured


@pytest.mark.parametrize("kind,spec", [("json", "{not json"), ("json", '{"type": "nonsense"}'), ("regex", "(unclosed"),
                                       ("choice", "[]"), ("grammar", "start: undefined_rule")])
def test_a_constraint_that_does_not_compile_is_refused(engine, chat, kind, spec):
    with pytest.raises(InvalidRequestError) as refused:
        engine.add_request("bad", chat("Hi"), constrained(kind, spec))
    assert refused.value.param == "structured_outputs"
    assert not engine.has_unfinished_requests() and "bad" not in engine.structured
