"""The official openai client against the colocated deployment."""

import re

import openai
import pytest
from transformers import AutoTokenizer

from reference import reference_greedy, reference_logprobs, safe_seed

MODEL = "splitserve-default-llama"
PROMPT = "The lighthouse keeper opened the old logbook and"


@pytest.fixture(scope="module")
def client(colocated):
    return openai.OpenAI(base_url=colocated.api, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return AutoTokenizer.from_pretrained(default_model)


def test_greedy_completion_matches_transformers(client, tokenizer, default_model):
    prompt_ids = tokenizer(PROMPT).input_ids
    expected_ids, _ = reference_greedy(default_model, prompt_ids, 24, ignore_eos=False)
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert result.choices[0].text == tokenizer.decode(expected_ids, skip_special_tokens=True)
    assert result.usage.prompt_tokens == len(prompt_ids)
    assert result.usage.completion_tokens == len(expected_ids)
    assert result.usage.total_tokens == len(prompt_ids) + len(expected_ids)
    assert result.choices[0].finish_reason == ("length" if len(expected_ids) == 24 else "stop")


def test_streamed_deltas_equal_the_whole_text(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    deltas, usage, finish = [], None, None
    for chunk in stream:
        if chunk.choices:
            deltas.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert "".join(deltas) == whole.choices[0].text
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_matches_transformers_streamed_and_not(client, tokenizer, default_model):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected_ids, _ = reference_greedy(default_model, list(prompt_ids), 20, ignore_eos=False)
    expected = tokenizer.decode(expected_ids, skip_special_tokens=True)

    result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert result.choices[0].message.content == expected
    assert result.choices[0].message.role == "assistant"
    assert result.usage.prompt_tokens == len(prompt_ids)

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == result.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == result.usage.total_tokens


def test_token_id_prompt_and_logprobs(client, colocated, tokenizer, default_model):
    prompt_ids = tokenizer(PROMPT).input_ids
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    by_ids = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=8, temperature=0, logprobs=2)
    assert colocated.token_ids(by_ids.model_dump()) == colocated.token_ids(by_text.model_dump())
    tokens = colocated.token_ids(by_text.model_dump())
    # The raw model's log-probabilities, as transformers computes them on the same tokens.
    reference = reference_logprobs(default_model, prompt_ids, tokens)
    logprobs = by_text.choices[0].logprobs
    assert logprobs.tokens == [tokenizer.decode([t]) for t in tokens]
    assert logprobs.token_logprobs == pytest.approx([reference[i, t].item() for i, t in enumerate(tokens)], abs=1e-4)
    for i, top in enumerate(logprobs.top_logprobs):
        values, ids = reference[i].topk(2)
        assert top == pytest.approx({tokenizer.decode([t]): v for t, v in zip(ids.tolist(), values.tolist())},
                                    abs=1e-4)


def test_repeated_prompt_reports_cached_tokens(client):
    long_prompt = " ".join(["the quiet river ran past the mill"] * 12)
    first = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2, temperature=0)
    # Every full block of the prompt but the one holding its last token (which must be computed) is a hit.
    prompt_tokens = again.usage.prompt_tokens
    assert prompt_tokens > 32 and first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // 16 * 16


@pytest.mark.parametrize(("temperature", "top_p"), [(1.5, 1.0), (0.7, 0.8)])
def test_seeded_sampling_draws_what_temperature_top_p_and_seed_say(client, colocated, tokenizer, default_model,
                                                                    temperature, top_p):
    prompt_ids = tokenizer(PROMPT).input_ids
    seed, expected = safe_seed(default_model, prompt_ids, 12, temperature=temperature, top_p=top_p)
    other_seed, other = safe_seed(default_model, prompt_ids, 12, temperature=temperature, top_p=top_p, first=seed + 1)
    assert other != expected  # so a seed the service ignored could not pass
    for seed, expected in ((seed, expected), (other_seed, other)):
        result = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=12, temperature=temperature,
                                           top_p=top_p, seed=seed, extra_body={"ignore_eos": True})
        assert colocated.token_ids(result.model_dump()) == expected


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_every_parameter_is_honoured_or_refused_by_name(client, colocated, tokenizer):
    # A misspelled or unsupported parameter is a 400 naming it, never a run with default behaviour.
    for extra in ({"max_token": 4}, {"guided_decoding_backend": "xgrammar"}, {"guided_whitespace_pattern": " "}):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body=extra)
        assert info.value.param == next(iter(extra)) and info.value.code == "unknown_parameter"
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, user="someone",
                                      extra_body={"ignore_eos": True})
    tokens = colocated.token_ids(plain.model_dump())
    # logit_bias: the first greedy token banned, another one's never drawn either.
    biased = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                       logit_bias={str(tokens[0]): -100}, extra_body={"ignore_eos": True})
    assert tokens[0] not in colocated.token_ids(biased.model_dump())
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logit_bias={"99999999": 1})
    assert info.value.param == "logit_bias"
    # min_tokens: a stop token id that greedy decoding reaches second waits for the fifth token.
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True, "stop_token_ids": [tokens[1]]})
    assert stopped.usage.completion_tokens == 2 and stopped.choices[0].finish_reason == "stop"
    held = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True, "stop_token_ids": [tokens[1]], "min_tokens": 5})
    assert held.usage.completion_tokens >= 5 and tokens[1] not in colocated.token_ids(held.model_dump())[:5]


def test_echo_puts_the_prompt_ahead_of_the_completion_streamed_and_not(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == echoed.choices[0].text


def test_echo_with_logprobs_scores_the_prompt_then_the_completion(client, tokenizer, default_model):
    """As evaluation harnesses score a text: the prompt's tokens with their logprobs (the first null), then the
    completion's, every one transformers' own."""
    prompt_ids = tokenizer(PROMPT).input_ids
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1)
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1, echo=True)
    logprobs, completion = echoed.choices[0].logprobs, plain.choices[0].logprobs
    assert len(logprobs.tokens) == len(prompt_ids) + 3 and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None and logprobs.text_offset[0] == 0
    reference = reference_logprobs(default_model, prompt_ids[:1], prompt_ids[1:])
    assert logprobs.token_logprobs[1:len(prompt_ids)] == pytest.approx(
        [reference[j, t].item() for j, t in enumerate(prompt_ids[1:])], abs=1e-4)
    assert logprobs.tokens[len(prompt_ids):] == completion.tokens
    assert logprobs.token_logprobs[len(prompt_ids):] == pytest.approx(completion.token_logprobs, abs=1e-5)
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert "prompt_logprobs" not in (echoed.choices[0].model_extra or {})  # not asked for: only in the echo


def test_n_completions_share_the_prompt_and_sample_as_their_own_seeds(client):
    prompt = " ".join(["the keeper counted the ships that passed the cape at dawn"] * 6)
    single = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, n=3,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert [c.text for c in greedy.choices] == [single.choices[0].text] * 3
    assert greedy.usage.prompt_tokens == single.usage.prompt_tokens
    assert greedy.usage.completion_tokens == 3 * single.usage.completion_tokens
    # The later choices started once the first had its prompt computed: they found it in the prefix cache.
    assert greedy.usage.prompt_tokens_details.cached_tokens == (single.usage.prompt_tokens - 1) // 16 * 16
    # The first choice may end before the others are even submitted (its first token its last): all still come.
    short = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, n=3,
                                      extra_body={"ignore_eos": True})
    assert [(c.index, c.finish_reason) for c in short.choices] == [(0, "length"), (1, "length"), (2, "length")]
    assert short.usage.completion_tokens == 3
    # Seeded: choice i draws as a request seeded seed + i would.
    seeded = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=41, n=3,
                                       extra_body={"ignore_eos": True})
    alone = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=41 + i,
                                       extra_body={"ignore_eos": True}).choices[0].text for i in range(3)]
    assert [c.text for c in seeded.choices] == alone and len(set(alone)) > 1
    # Streamed: each chunk names its choice; each choice's deltas add up to its whole text.
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                            temperature=1.0, seed=7, n=2, stream=True,
                                            stream_options={"include_usage": True})
    texts, finished, usage = {0: "", 1: ""}, set(), None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
        usage = chunk.usage or usage
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                           temperature=1.0, seed=7, n=2)
    assert texts == {c.index: c.message.content for c in whole.choices} and finished == {0, 1}
    assert usage.completion_tokens == whole.usage.completion_tokens


PET = {"type": "object", "additionalProperties": False, "required": ["name", "kind", "age", "tags"],
       "properties": {"name": {"type": "string", "maxLength": 16}, "kind": {"enum": ["cat", "dog", "fish"]},
                      "age": {"type": "integer", "minimum": 0, "maximum": 30},
                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}}}


def test_structured_output_through_the_api_parses_and_validates_streamed_or_not(client):
    """Even the random test model writes JSON that parses and follows the schema once it is constrained."""
    import json

    import jsonschema

    response_format = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
    messages = [{"role": "user", "content": "Describe a pet."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=200, temperature=0,
                                           response_format=response_format)
    choice = whole.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PET)
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=200, temperature=0,
                                              response_format=response_format, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == choice.message.content
    # n > 1 sampled: every choice follows the schema.
    several = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=200, temperature=1.0, seed=4,
                                             n=3, response_format=response_format)
    for c in several.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), PET)
    # vLLM's ways on the completions endpoint.
    phone = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0.7, seed=1,
                                      extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone.choices[0].text)
    picked = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0,
                                       extra_body={"guided_choice": ["north", "south", "east", "west"]})
    assert picked.choices[0].text in ("north", "south", "east", "west")


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"guided_grammar": "start: missing_rule"}, "guided_grammar"),
])
def test_a_constraint_that_does_not_compile_is_a_400_naming_its_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body=extra)
    assert refused.value.param == param and refused.value.code == "invalid_value"


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}


def _valid_call(name: str, arguments: str) -> None:
    import json

    import jsonschema

    tool = {"get_weather": WEATHER, "get_time": TIME}[name]
    jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("tool_choice,finish", [
    ({"type": "function", "function": {"name": "get_time"}}, "stop"),  # named: OpenAI ends a forced call with stop
    ("required", "tool_calls"),
])
def test_tool_calls_named_or_required_are_calls_of_the_offered_functions_streamed_or_not(client, tool_choice, finish):
    messages = [{"role": "user", "content": "What's the weather in Paris, and the time?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=120, temperature=0,
                                           tools=[WEATHER, TIME], tool_choice=tool_choice)
    choice = whole.choices[0]
    assert choice.finish_reason == finish and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(call.type == "function" and call.id.startswith("call_") for call in calls)
    if isinstance(tool_choice, dict):
        assert [call.function.name for call in calls] == ["get_time"]
    for call in calls:
        _valid_call(call.function.name, call.function.arguments)

    # Streamed: each call's id and name first, then its arguments in pieces that add up to the same calls.
    streamed, finish_seen = {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=120, temperature=0,
                                                tools=[WEATHER, TIME], tool_choice=tool_choice, stream=True):
        if not chunk.choices:
            continue
        finish_seen = chunk.choices[0].finish_reason or finish_seen
        assert not chunk.choices[0].delta.content
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.id is not None:
                assert delta.index not in streamed
                streamed[delta.index] = [delta.function.name, delta.function.arguments or ""]
            else:
                streamed[delta.index][1] += delta.function.arguments
    assert finish_seen == finish
    assert [tuple(streamed[i]) for i in sorted(streamed)] == [(c.function.name, c.function.arguments) for c in calls]
    # Not parallel: one call at most.
    single = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=120, temperature=1.0, seed=2,
                                            tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert len(single.choices[0].message.tool_calls) == 1


def test_best_of_returns_the_candidates_of_highest_cumulative_logprob(client):
    """best_of=4, n=2 returns the two of the four seeded candidates (choice i drawn with seed + i, as an n=4
    request draws them) whose tokens' logprobs sum highest, best first; usage counts all four."""
    common = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=7,
                  extra_body={"ignore_eos": True})
    every = client.completions.create(n=4, logprobs=0, **common)
    totals = {c.index: sum(c.logprobs.token_logprobs) for c in every.choices}
    best = sorted(totals, key=lambda i: (-totals[i], i))[:2]
    picked = client.completions.create(n=2, best_of=4, **common)
    texts = {c.index: c.text for c in every.choices}
    assert [c.text for c in picked.choices] == [texts[i] for i in best]
    assert [c.index for c in picked.choices] == [0, 1] and all(c.logprobs is None for c in picked.choices)
    assert picked.usage.completion_tokens == every.usage.completion_tokens == 40


def test_tool_choice_auto_answers_in_text_or_in_calls(client, tokenizer):
    """"auto" (the default with tools): text, or calls the grammar holds valid. A logit bias towards "<" makes
    the test model begin with it, so it calls; away from it, it writes text."""
    lt = str(tokenizer.convert_tokens_to_ids("<"))
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    common = dict(model=MODEL, messages=messages, max_tokens=80, temperature=0, tools=[WEATHER, TIME],
                  parallel_tool_calls=False)  # (one call: the random model would go on calling to the length)
    called = client.chat.completions.create(logit_bias={lt: 100}, **common)
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        _valid_call(call.function.name, call.function.arguments)
    streamed = {}
    for chunk in client.chat.completions.create(logit_bias={lt: 100}, stream=True, **common):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = streamed.setdefault(delta.index, [delta.function.name, ""])
            entry[1] += delta.function.arguments or ""
    assert [tuple(streamed[i]) for i in sorted(streamed)] == [(c.function.name, c.function.arguments)
                                                              for c in choice.message.tool_calls]
    text = client.chat.completions.create(logit_bias={lt: -100}, tool_choice="auto", **common).choices[0]
    assert text.message.tool_calls is None and text.message.content and not text.message.content.startswith("<")
    assert text.finish_reason in ("stop", "length")


def _check_prompt_logprobs(shown: list, prompt_ids: list[int], default_model: str, top: int) -> None:
    """vLLM's shape: None, then per prompt token its own entry and the top alternatives, as transformers has them."""
    reference = reference_logprobs(default_model, prompt_ids[:1], prompt_ids[1:])
    assert shown[0] is None and len(shown) == len(prompt_ids)
    for j, position in enumerate(shown[1:]):
        token, row = prompt_ids[j + 1], reference[j]
        own = position[str(token)]
        assert own["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
        assert own["rank"] == int((row > row[token]).sum()) + 1
        values, ids = row.topk(top)
        for rank, (token_id, value) in enumerate(zip(ids.tolist(), values.tolist()), 1):
            assert position[str(token_id)]["rank"] == rank
            assert position[str(token_id)]["logprob"] == pytest.approx(value, abs=1e-4)
        assert set(position) <= {str(token)} | {str(t) for t in ids.tolist()}


def test_prompt_logprobs_are_transformers_own_and_every_choice_has_them(colocated, tokenizer, default_model):
    import httpx

    prompt_ids = tokenizer(PROMPT).input_ids
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "n": 2, "prompt_logprobs": 2}
    # The same prompt twice: the second is in the prefix cache, yet computed again (a cached position has no logits).
    for _ in range(2):
        response = httpx.post(f"{colocated.api}/completions", json=body, timeout=60).json()
        first, second = (choice["prompt_logprobs"] for choice in response["choices"])
        assert first == second
        _check_prompt_logprobs(first, prompt_ids, default_model, top=2)
    chat = httpx.post(f"{colocated.api}/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 0}).json()
    chat_ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
    _check_prompt_logprobs(chat["prompt_logprobs"], list(chat_ids), default_model, top=0)
