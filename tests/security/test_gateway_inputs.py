"""The gateway's last input holes (issue 35): every number bounded, logit_bias keys parsed safely, tools counted
before tokenizing, bodies read within a deadline, grammars compiled within bounds and off the engine's step, and
the keys guarding the docs. The gateway runs in this process, without NATS: every request here is refused (or
answered) before anything would reach the bus. The engine's loop runs a real engine.
(`loadtest/bench_schema_stall.py` measures what a large schema costs another user's stream.)"""

import json
import socket
import threading
import types
import typing

import pytest
from fastapi.testclient import TestClient

from services.gateway.app import create_app
from services.gateway.settings import GatewayServiceSettings
from services.gateway.model_info import ModelInfo
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from support.waiting import wait_until

MODEL = "m"
USER = [{"role": "user", "content": "Hi"}]
KEY = "secret-1f3a"


def _config(default_model: str, **overrides) -> GatewayServiceSettings:
    return GatewayServiceSettings(nats="nats://127.0.0.1:9", namespace="t", instance_id="gateway-t",
                                  model=default_model, served_model_name=MODEL, **overrides)


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
    backend = app.state.gateway.backend_for(MODEL)
    return 2 * backend.max_model_len * backend.model.max_chars_per_token


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
    max_model_len = app.state.gateway.backend_for(MODEL).max_model_len
    words = "hello " * (max_model_len + 10)  # a token a word, and within the characters' bound
    assert_error(http.post("/tokenize", json={"prompt": words}), 400, "prompt", "context_length_exceeded")
    assert_error(http.post("/tokenize", json={"messages": [{"role": "user", "content": words}]}), 400, "messages",
                 "context_length_exceeded")
    assert http.post("/tokenize", json={"prompt": "hello " * 10}).status_code == 200


def test_a_body_sent_slowly_is_a_408_and_its_connection_closes(default_model):
    import uvicorn

    from services.common.free_port import free_port
    from services.gateway.__main__ import settings_of
    from services.common.settings import default_of

    assert settings_of([], environ={}).request_body_timeout == default_of(GatewayServiceSettings,
                                                                          "request_body_timeout")
    assert settings_of(["--request-body-timeout", "2.5"], environ={}).request_body_timeout == 2.5
    port = free_port()
    app = create_app(_config(default_model, request_body_timeout=0.3))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning"))
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


def _nested(kind: str, depth: int) -> dict:
    if kind == "guided_grammar":  # GBNF, turned into Lark by a recursive parser
        return {kind: "root ::= " + "(" * depth + '"a"' + ")" * depth}
    if kind == "guided_regex":
        return {kind: "(" * depth + "a" + ")" * depth}
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return {kind: schema}


def test_deeply_nested_constraints_are_400s(http):
    for kind in ("guided_grammar", "guided_regex", "guided_json"):
        for depth in (150, 400):  # (the JSON parser takes up to about 1000 levels)
            body = {"model": MODEL, "prompt": "Hello", **_nested(kind, depth)}
            error = assert_error(http.post("/v1/completions", json=body), 400, kind, "invalid_value")
            assert "deep" in error["message"]


def test_a_constraint_that_does_not_compile_in_time_is_a_400(monkeypatch):
    import asyncio

    import services.gateway.structured_request as structured_request
    from services.gateway.errors import RequestError
    from services.gateway.structured_request import Constraint, check_constraint

    release = threading.Event()
    monkeypatch.setattr(structured_request, "check_structured", lambda kind, spec: release.wait(60))
    try:
        with pytest.raises(RequestError) as refused:
            asyncio.run(check_constraint(Constraint("regex", "a+", "guided_regex"), timeout_s=0.2))
    finally:
        release.set()
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, "guided_regex", "invalid_value")
    assert "did not compile within 0.2 s" in refused.value.message


def test_with_every_compiler_busy_a_constraint_is_a_503_not_a_400_after_the_deadline(monkeypatch):
    """One client's slow constraints hold the gateway's compile threads: another's valid one is told to retry at
    once (the server's condition), not queued behind them into a 'did not compile' 400."""
    import asyncio

    import services.gateway.structured_request as structured_request
    from services.gateway.errors import RequestError
    from services.gateway.structured_request import COMPILE_THREADS, Constraint, check_constraint

    release = threading.Event()
    monkeypatch.setattr(structured_request, "check_structured", lambda kind, spec: release.wait(60))
    slow = Constraint("regex", "a+", "guided_regex")

    async def scenario():
        held = [asyncio.create_task(check_constraint(slow, timeout_s=30)) for _ in range(COMPILE_THREADS)]
        await asyncio.sleep(0)  # (each took its thread)
        with pytest.raises(RequestError) as refused:
            await check_constraint(slow, timeout_s=30)
        release.set()
        await asyncio.gather(*held)
        await check_constraint(slow, timeout_s=30)  # the threads are free again
        return refused.value

    refused = asyncio.run(scenario())
    assert (refused.status, refused.code, refused.headers.get("Retry-After")) == (503, "overloaded", "1")


def test_a_constraint_compiles_off_the_engine_step(default_model, monkeypatch):
    """While a constraint compiles, the engine's other requests go on stepping; the request is added once it has
    compiled (one compile for requests alike), and not at all if it was cancelled meanwhile."""
    from services.common.engine_loop import AddRequest, EngineLoop, RequestRejected
    from services.common.engine_thread import EngineThread
    from shared.engine import structured_output
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.engine.sampling_params import SamplingParams

    thread = EngineThread()
    engine = thread.submit(LLMEngine, EngineConfig(model=default_model, max_num_seqs=8)).result(120)
    release, compiles = threading.Event(), []
    grammar_of = structured_output.grammar_of

    def slow_grammar_of(kind, spec):
        compiles.append(kind)
        assert release.wait(60)
        return grammar_of(kind, spec)

    monkeypatch.setattr(structured_output, "grammar_of", slow_grammar_of)
    tokens: dict[str, list] = {}
    finished: set[str] = set()
    rejected: dict[str, str] = {}

    def emit(items):
        for item in items:
            if isinstance(item, RequestRejected):
                rejected[item.request_id] = str(item.error)
            else:
                tokens.setdefault(item.request_id, []).extend(item.new_token_ids)
                if item.finished:
                    finished.add(item.request_id)

    loop = EngineLoop(engine, emit, thread)
    loop.start()
    prompt = list(range(5, 30))
    try:
        loop.add(AddRequest("free", prompt, SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)))
        wait_until(lambda: tokens.get("free"), 30, "the free request did not start", poll_s=0.01)
        constrained = SamplingParams(max_tokens=4, temperature=0.0, structured_kind="json_object")
        for request_id in ("json-0", "json-1", "gone"):
            loop.add(AddRequest(request_id, prompt, constrained))
        loop.add(AddRequest("bad", prompt, SamplingParams(max_tokens=4, structured_kind="regex", structured_spec="(")))
        loop.abort("gone")
        wait_until(lambda: len(compiles) == 2, 30, "the constraints did not start compiling", poll_s=0.01)
        seen = len(tokens["free"])
        wait_until(lambda: len(tokens["free"]) >= seen + 20, 30, "the free request stopped while a constraint compiled",
                   poll_s=0.01)
        assert "json-0" not in tokens and not engine.structured._matchers  # (added once compiled)
        release.set()
        wait_until(lambda: {"json-0", "json-1"} <= finished, 30, "the constrained requests did not run once compiled",
                   poll_s=0.01)
        assert tokens["json-0"] == tokens["json-1"]
        wait_until(lambda: "bad" in rejected, 30, "the constraint that does not compile was not refused", poll_s=0.01)
        assert "regex" in rejected["bad"] and "gone" not in tokens and "gone" not in rejected
        assert sorted(compiles) == ["json_object", "regex"]  # json-0, json-1 (and gone) shared one compile
        loop.abort("free")
    finally:
        release.set()
        loop.stop()
    assert loop.crashed is None


def test_with_api_keys_the_docs_need_one_and_up_can_protect_metrics(default_model, tmp_path):
    from services.cli.main import build_parser
    from services.common.settings import settings_from
    from services.gateway.__main__ import settings_of
    from services.launcher.launcher import Launcher
    from services.launcher.topology import plan
    from services.launcher.up_settings import UpSettings

    guarded = TestClient(create_app(_config(default_model, api_keys=(KEY,), protect_metrics=True)),
                         raise_server_exceptions=False)
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect", "/metrics"):
        assert_error(guarded.get(path), 401, None, "invalid_api_key")
    assert guarded.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()["info"]["title"]
    assert guarded.get("/docs", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert TestClient(create_app(_config(default_model))).get("/openapi.json").status_code == 200  # no keys: open

    def gateway_settings(*up_flags: str):
        options = settings_from(UpSettings, build_parser().parse_args(["up", "--run-dir", str(tmp_path), *up_flags]),
                                None, {})
        spec = next(s for s in plan(options, Launcher(options)._resolved_run(default_model, MODEL))
                    if s.role == "gateway")
        return settings_of(list(spec.args), environ={})

    assert gateway_settings("--protect-metrics").protect_metrics is True
    assert gateway_settings().protect_metrics is False
