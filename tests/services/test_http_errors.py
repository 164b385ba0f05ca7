"""Every error case of the HTTP API: status, OpenAI shape, param, x-request-id."""

import httpx
import pytest

from support.deployment import start_deployment

MODEL = "splitserve-default-llama"


@pytest.fixture(scope="module")
def http(colocated):
    with httpx.Client(base_url=colocated.base_url, timeout=60) as client:
        yield client


def assert_error(response, status: int, param=None, words: str = ""):
    assert response.status_code == status, response.text
    assert response.headers.get("x-request-id")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert words in error["message"]
    return error


def completion(http, **body):
    return http.post("/v1/completions", json={"model": MODEL, "prompt": "hello", **body})


def test_unknown_model_is_404(http):
    error = assert_error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, "model", "gpt-9")
    assert error["code"] == "model_not_found"
    assert_error(http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}),
                 404, "model")


def test_context_overflow_names_both_numbers(http):
    response = completion(http, max_tokens=5000)
    error = assert_error(response, 400, "max_tokens", "4096")
    assert "5001" in error["message"] or "5000" in error["message"]
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 9000,
                                                    "messages": [{"role": "user", "content": "hi"}]})
    assert_error(chat, 400, "max_tokens", "4096")


@pytest.mark.parametrize("field,value", [
    ("temperature", -1), ("temperature", 3.5), ("top_p", 0), ("top_p", 1.5), ("max_tokens", 0),
    ("max_tokens", -3), ("n", 17), ("logprobs", 50), ("presence_penalty", 9),
])
def test_bad_sampling_parameter_names_it(http, field, value):
    assert_error(completion(http, **{field: value}), 400, field)


def test_chat_top_logprobs_out_of_range(http):
    response = http.post("/v1/chat/completions", json={"model": MODEL, "logprobs": True, "top_logprobs": 99,
                                                        "messages": [{"role": "user", "content": "x"}]})
    assert_error(response, 400, "top_logprobs")


def test_malformed_json_is_400(http):
    response = http.post("/v1/completions", content=b'{"model": "x", "prompt": ', headers={"content-type": "application/json"})
    assert_error(response, 400, None, "JSON")


def test_missing_prompt_and_bad_token_ids(http):
    assert_error(http.post("/v1/completions", json={"model": MODEL}), 400, "prompt")
    assert_error(completion(http, prompt=[1, 2, 10**9]), 400, "prompt", "vocabulary")


def test_stop_token_ids_and_stop_sequences_are_checked_at_the_gateway(http):
    assert_error(completion(http, stop_token_ids=[10**30]), 400, "stop_token_ids", "vocabulary")
    # Streamed too: a 400 before the stream starts, not a 200 with an error event.
    assert_error(completion(http, stream=True, stop_token_ids=[3, 10**6]), 400, "stop_token_ids", "vocabulary")
    assert_error(completion(http, stop=["x" * 100_000] * 4), 400, "stop", "characters")
    assert completion(http, max_tokens=2, stop_token_ids=[3], stop=["zzz"]).status_code == 200


def test_every_response_has_a_request_id(http):
    ids = {http.get("/health").headers["x-request-id"], http.get("/v1/models").headers["x-request-id"],
           completion(http, max_tokens=2).headers["x-request-id"], http.get("/nope").headers["x-request-id"]}
    assert len(ids) == 4


def test_a_streamed_answer_carries_one_request_id_its_own(http):
    with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 2,
                                                      "stream": True}) as response:
        body = response.read().decode()
    assert response.status_code == 200
    ids = response.headers.get_list("x-request-id")
    assert len(ids) == 1 and f'"id":"cmpl-{ids[0]}"' in body.replace(" ", ""), (ids, body[:200])


def test_no_worker_is_503_with_retry_after(nats_server, default_model, tmp_path):
    # A deployment whose only worker serves nothing: the gateway is up, no decode worker exists.
    deployment = start_deployment(nats_server.url, tmp_path, default_model, workers=0, expect="scheduler=1")
    try:
        response = httpx.post(f"{deployment.base_url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=60)
        error = assert_error(response, 503)
        assert int(response.headers["retry-after"]) >= 1
        assert error["code"] == "no_worker"
        health = httpx.get(f"{deployment.base_url}/health", timeout=10)
        assert health.status_code == 200  # what it was told to expect is there
    finally:
        deployment.stop()
