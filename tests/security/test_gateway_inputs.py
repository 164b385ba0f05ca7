"""The gateway's last input holes (issue 35): every number bounded, logit_bias keys parsed safely, tools counted
before tokenizing, bodies read within a deadline, grammars compiled within bounds and off the engine's step, and
the keys guarding the docs. The gateway runs in this process, without NATS: every request here is refused (or
answered) before anything would reach the bus."""

import json
import socket
import threading
import types
import typing

import pytest
from fastapi.testclient import TestClient

from services.gateway.app import GatewayConfig, create_app
from services.gateway.model_info import ModelInfo
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from support.waiting import wait_until

MODEL = "m"
USER = [{"role": "user", "content": "Hi"}]
KEY = "secret-1f3a"


def _config(default_model: str, **overrides) -> GatewayConfig:
    return GatewayConfig(nats_url="nats://127.0.0.1:9", namespace="t", instance_id="gateway-t",
                         model_dir=default_model, served_model_name=MODEL, **overrides)


@pytest.fixture(scope="module")
def app(default_model):
    return create_app(_config(default_model))


@pytest.fixture(scope="module")
def http(app) -> TestClient:
    return TestClient(app, raise_server_exceptions=False)


def assert_error(response, status: int, param: str | None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def _number_kind(annotation) -> str | None:
    """"int", "float", "list" (of numbers) or None for a field's annotation."""
    if annotation in (int, float):
        return annotation.__name__
    if typing.get_origin(annotation) is list:
        return "list" if _number_kind(typing.get_args(annotation)[0]) else None
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return next(filter(None, map(_number_kind, typing.get_args(annotation))), None)
    return None


HUGE = {"int": 2**64, "float": 1e300, "list": [2**64]}


@pytest.mark.parametrize("path,model_cls,base", [
    ("/v1/completions", CompletionRequest, {"model": MODEL, "prompt": "Hello"}),
    ("/v1/chat/completions", ChatCompletionRequest, {"model": MODEL, "messages": USER}),
])
def test_every_numeric_field_has_an_upper_bound(http, path, model_cls, base):
    fields = {name: _number_kind(info.annotation) for name, info in model_cls.model_fields.items()}
    fields = {name: kind for name, kind in fields.items() if kind}
    assert {"top_k", "seed", "n", "max_tokens", "min_tokens", "repetition_penalty", "stop_token_ids"} <= set(fields)
    for name, kind in fields.items():
        assert_error(http.post(path, json={**base, name: HUGE[kind]}), 400, name)
    if model_cls is CompletionRequest:
        assert_error(http.post(path, json={**base, "prompt": [1, 2**64]}), 400, "prompt")
    # top_k's bound is the vocabulary (past it, top_k is no filter at all)
    assert_error(http.post(path, json={**base, "top_k": 10**6}), 400, "top_k")


def test_logit_bias_keys_are_token_ids_within_the_vocabulary(http):
    for key in ["9" * 5000, "2048", "99999999999", "-1", "1e3", "\u0663", " 1"]:  # (the vocabulary: 2048 tokens)
        body = {"model": MODEL, "prompt": "Hello", "logit_bias": {key: 1}}
        error = assert_error(http.post("/v1/completions", json=body), 400, "logit_bias")
        assert len(error["message"]) < 200  # a long key is not echoed whole


def _char_limit(app) -> int:
    gateway = app.state.gateway
    return 2 * gateway.max_model_len * gateway.model.max_chars_per_token


@pytest.fixture
def no_chat_tokenizing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("tokenized before the context check")

    monkeypatch.setattr(ModelInfo, "encode_chat", refuse)


def test_tools_and_tool_calls_count_toward_the_context_before_tokenizing(http, app, no_chat_tokenizing):
    long = "x" * (_char_limit(app) + 1)
    tools = [{"type": "function", "function": {"name": "f", "description": long}}]
    chat = {"model": MODEL, "messages": USER}
    assert_error(http.post("/v1/chat/completions", json={**chat, "tools": tools}), 400, "tools",
                 "context_length_exceeded")
    assert_error(http.post("/tokenize", json={"messages": USER, "tools": tools}), 400, "tools",
                 "context_length_exceeded")
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": json.dumps({"a": long})}}]
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": calls}, {"role": "user", "content": "?"}]
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": history}), 400, "messages",
                 "context_length_exceeded")
    named = [{"role": "user", "content": "Hi", "name": long}]
    assert_error(http.post("/tokenize", json={"messages": named}), 400, "messages", "context_length_exceeded")


def test_tokenize_is_bounded_by_the_context(http, app):
    max_model_len = app.state.gateway.max_model_len
    words = "hello " * (max_model_len + 10)  # a token a word, and within the characters' bound
    assert_error(http.post("/tokenize", json={"prompt": words}), 400, "prompt", "context_length_exceeded")
    assert_error(http.post("/tokenize", json={"messages": [{"role": "user", "content": words}]}), 400, "messages",
                 "context_length_exceeded")
    assert http.post("/tokenize", json={"prompt": "hello " * 10}).status_code == 200


def test_a_body_sent_slowly_is_a_408_and_its_connection_closes(default_model):
    import uvicorn

    from services.common.free_port import free_port
    from services.gateway.__main__ import settings_of
    from services.gateway.edge import DEFAULT_BODY_TIMEOUT_S

    assert settings_of([], environ={}).request_body_timeout == DEFAULT_BODY_TIMEOUT_S
    assert settings_of(["--request-body-timeout", "2.5"], environ={}).request_body_timeout == 2.5
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(_config(default_model, body_timeout_s=0.3)), host="127.0.0.1",
                                           port=port, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 30, "the gateway did not start", poll_s=0.02)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"model\": ")  # and the other 90 bytes never come
            response = b""
            while chunk := sock.recv(65536):  # until the gateway closes the connection
                response += chunk
        head, _, body = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), response
        assert json.loads(body)["error"]["code"] == "request_timeout"
    finally:
        server.should_exit = True
        thread.join(30)
