"""Hypothesis against a real gateway: a few hundred request bodies, valid and not, and never a 5xx (issue 13)."""

import json
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODEL = "splitserve-default-llama"
STATUSES: Counter = Counter()  # over the whole module, to show both accepted and refused bodies were tried
ERRORS: Counter = Counter()  # 400s by the field they blamed

pytestmark = [pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def client(colocated):
    with httpx.Client(base_url=colocated.base_url, timeout=60) as client:  # one keep-alive connection throughout
        yield client


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12)
SMALL = st.integers(1, 4)  # token budgets that keep valid requests short
TEXT = st.text(max_size=40)
IDS = st.lists(st.integers(0, 1000), min_size=1, max_size=12)


COMMON = {  # valid values of the sampling fields both endpoints take
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
    "seed": st.integers(0, 2**63 - 1), "stop": st.lists(st.text(min_size=1, max_size=8), max_size=4),
    "stop_token_ids": IDS, "n": st.just(1), "stream": st.booleans(), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2),
    "logit_bias": st.dictionaries(st.integers(0, 1000).map(str), st.floats(-100, 100), max_size=3),
    "ignore_eos": st.booleans(), "user": TEXT,
}
COMPLETION_FIELDS = {"model": st.just(MODEL), "max_tokens": SMALL, "prompt": TEXT.filter(str.strip) | IDS}
COMPLETION_OPTIONAL = {"logprobs": st.integers(0, 5), "echo": st.booleans(), **COMMON}
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user"]),
     "content": TEXT.filter(str.strip) | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                                                  min_size=1, max_size=2)},
    optional={"name": st.text(alphabet="abcxyz", min_size=1, max_size=8)})
CHAT_FIELDS = {"model": st.just(MODEL), "max_tokens": SMALL, "messages": st.lists(MESSAGE, min_size=1, max_size=3)}
CHAT_OPTIONAL = {"logprobs": st.booleans(), "top_logprobs": st.integers(0, 5), **COMMON}
EDGES = {  # values at and past the edges, and fields OpenAI has that this server may not
    "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(-5, 0),
    "seed": st.integers(-2**64, 2**64), "stop": st.lists(TEXT, max_size=6), "n": st.integers(-1, 3),
    "stop_token_ids": st.lists(st.integers(-3, 60_000), max_size=5), "max_tokens": st.integers(-2, 0),
    "logprobs": st.integers(-1, 25), "top_logprobs": st.integers(-1, 25), "min_tokens": st.integers(-2, 5),
    "prompt": st.lists(TEXT, max_size=2) | st.just(""), "messages": st.just([]), "model": TEXT,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "suffix": TEXT, "best_of": SMALL,
    "response_format": JSON, "tools": JSON, "tool_choice": JSON,
    "logit_bias": st.dictionaries(st.text(max_size=6), JSON, max_size=3),
}


def requests(required: dict, optional: dict) -> st.SearchStrategy:
    """Valid bodies; and valid bodies with one field set to an edge value or to any JSON at all."""
    valid = st.fixed_dictionaries(required, optional=optional)
    fields = sorted({*required, *optional, *EDGES})

    @st.composite
    def mutated(draw):
        body = draw(valid)
        field = draw(st.sampled_from(fields))
        body[field] = draw((EDGES[field] | JSON) if field in EDGES else JSON)
        return body

    return st.one_of(valid, mutated())


COMPLETION = requests(COMPLETION_FIELDS, COMPLETION_OPTIONAL)
CHAT = requests(CHAT_FIELDS, CHAT_OPTIONAL)


def post(client: httpx.Client, path: str, body) -> int:
    """The status; a streamed 200 is read to its end (an error inside the stream is an event, not a status)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with client.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as response:
        data = b"".join(response.iter_bytes())
        STATUSES[response.status_code] += 1
        if response.status_code == 400:
            ERRORS[json.loads(data)["error"].get("param")] += 1
        return response.status_code


@settings(max_examples=150, deadline=None, derandomize=True, database=None,  # the same cases every run
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=st.one_of(COMPLETION, COMPLETION, JSON, st.binary(max_size=40)))
def test_completions_bodies_never_get_a_5xx(client, body):
    status = post(client, "/v1/completions", body)
    assert status < 500, body


@settings(max_examples=150, deadline=None, derandomize=True, database=None,  # the same cases every run
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=st.one_of(CHAT, CHAT, JSON))
def test_chat_bodies_never_get_a_5xx(client, body):
    status = post(client, "/v1/chat/completions", body)
    assert status < 500, body


def test_the_fuzzed_gateway_still_serves(client):
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "still", "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert STATUSES[200] >= 20 and STATUSES[400] >= 50, (STATUSES, ERRORS)  # the fuzz reached generation, not only errors
