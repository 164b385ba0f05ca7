"""/tokenize, /detokenize and /version in vLLM's shapes (the gateway's own app; nothing here reaches the bus)."""

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from services.gateway.app import create_app
from services.gateway.settings import GatewayServiceSettings
from shared.version import VERSION

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return AutoTokenizer.from_pretrained(default_model)


@pytest.fixture(scope="module")
def http(default_model) -> TestClient:
    settings = GatewayServiceSettings(nats="nats://127.0.0.1:9", namespace="t", instance_id="gateway-t",
                                      model=default_model, served_model_name="m", api_keys=("secret",))
    return TestClient(create_app(settings), raise_server_exceptions=False,
                      headers={"Authorization": "Bearer secret"})


def test_a_prompt_is_tokenized_as_a_completion_encodes_it(http, tokenizer):
    body = http.post("/tokenize", json={"model": "m", "prompt": "Hello world", "return_token_strs": True}).json()
    ids = tokenizer("Hello world").input_ids
    assert body == {"count": len(ids), "max_model_len": body["max_model_len"], "tokens": ids,
                    "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    assert body["max_model_len"] > 0
    bare = http.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer("Hello world", add_special_tokens=False).input_ids
    assert bare["token_strs"] is None


def test_messages_are_tokenized_through_the_chat_template(http, tokenizer):
    body = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert body["tokens"] == list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                                return_dict=False))
    without = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert without["count"] < body["count"]


def test_detokenize_is_the_tokenizers_decode(http, tokenizer):
    ids = tokenizer("Paris is lovely").input_ids
    assert http.post("/detokenize", json={"model": "m", "tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"prompt": "a", "tools": [{}]}, "tools"),
    ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function", "name": "x"}]}, "tools"),  # no "function"
    ("/tokenize", {"prompt": "a", "bogus": 1}, "bogus"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
])
def test_bad_requests_are_400s_naming_the_field(http, path, body, param):
    response = http.post(path, json=body)
    assert response.status_code == 400 and response.json()["error"]["param"].split("[")[0] == param


def test_another_models_name_is_a_404(http):
    assert http.post("/tokenize", json={"model": "other", "prompt": "a"}).status_code == 404


def test_tokenizing_needs_the_api_key_and_the_version_does_not(default_model):
    settings = GatewayServiceSettings(nats="nats://127.0.0.1:9", namespace="t", instance_id="gateway-t",
                                      model=default_model, served_model_name="m", api_keys=("secret",))
    anonymous = TestClient(create_app(settings), raise_server_exceptions=False)
    assert anonymous.post("/tokenize", json={"prompt": "a"}).status_code == 401
    assert anonymous.post("/detokenize", json={"tokens": [1]}).status_code == 401
    assert anonymous.get("/version").json() == {"version": VERSION} and VERSION != "unknown"
