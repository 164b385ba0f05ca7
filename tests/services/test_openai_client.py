"""The official openai client against the colocated deployment."""

import openai
import pytest
from transformers import AutoTokenizer

from reference import reference_greedy

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

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def test_token_id_prompt_and_logprobs(client, tokenizer):
    prompt_ids = tokenizer(PROMPT).input_ids
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    by_ids = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=8, temperature=0, logprobs=2)
    assert by_ids.choices[0].text == by_text.choices[0].text
    logprobs = by_text.choices[0].logprobs
    assert len(logprobs.tokens) == 8 and all(lp <= 0 for lp in logprobs.token_logprobs)


def test_repeated_prompt_reports_cached_tokens(client):
    long_prompt = " ".join(["the quiet river ran past the mill"] * 12)
    client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.9, seed=11)
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
