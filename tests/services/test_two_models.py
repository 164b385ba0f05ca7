"""Two models of different shapes behind one gateway (issue 38): the default tiny llama in the deployment's
namespace, and a qwen2 (biases, 3 layers, 2 KV heads) in a namespace of its own, each with its own scheduler and
decode worker, real processes on one nats-server. Each model's greedy output is transformers' own for it; both are
listed, an unknown model is OpenAI's 404; the metrics and /ready say which model is which; and the operator's
`ServeModel` (an admin connection) takes a model away, letting its open stream finish, and gives it back."""

import asyncio
import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import nats
import pytest
from transformers import AutoTokenizer

from contracts import ServeModel, ServeModelReply, Subjects
from reference import reference_greedy, safe_prompts
from shared.bus.permissions import ADMIN, inbox_prefix
from support.deployment import start_deployment
from support.metrics import matching, samples, value
from support.sse import stream
from support.token_tap import TokenTap
from support.waiting import wait_until

MODEL_A, MODEL_B = "splitserve-default-llama", "model-b"
B_CONTEXT = 1024  # model B's worker takes shorter sequences than the model's 4096: the gateway checks B's prompts by it
TOKENS = 12


@pytest.fixture(scope="module")
def model_b(model_zoo) -> str:
    return model_zoo["qwen2-bias"]


@pytest.fixture(scope="module")
def two(nats_server, default_model, model_b, tmp_path_factory):
    # Model changes wait for open streams up to the drain timeout; a frozen worker is not taken for stalled here.
    deployment = start_deployment(nats_server.url, tmp_path_factory.mktemp("logs"), default_model,
                                  also_serve=((MODEL_B, model_b, ("--max-model-len", str(B_CONTEXT))),),
                                  gateway_args=("--drain-timeout", "120", "--stream-idle-timeout", "120"))
    deployment.tap_b = TokenTap(nats_server.url, deployment.model_namespaces[MODEL_B])
    yield deployment
    deployment.tap_b.close()
    deployment.stop()


@pytest.fixture(scope="module")
def cases(default_model, model_b) -> dict:
    """Per model, prompts whose greedy run has no near-ties, and transformers' tokens for them."""
    return {name: safe_prompts(path, len(AutoTokenizer.from_pretrained(path)), [7, 33], TOKENS, seed=5)
            for name, path in ((MODEL_A, default_model), (MODEL_B, model_b))}


def complete(base_url: str, model: str, prompt, **fields) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, **fields}
    return httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)


def tokens_of(two, model: str, body: dict) -> list[int]:
    return (two.tap_b if model == MODEL_B else two.tap).token_ids(body)


def change(two, command: ServeModel, timeout_s: float = 150) -> ServeModelReply:
    """The gateway's answer to the operator's `command`, sent from an admin connection."""
    async def send():
        nc = await nats.connect(two.nats_url, inbox_prefix=inbox_prefix(two.namespace, ADMIN, ADMIN))
        try:
            reply = await nc.request(Subjects(two.namespace).gateway_models("gateway-0"), command.encode(),
                                     timeout=timeout_s)
            return ServeModelReply.decode(reply.data)
        finally:
            await nc.close()
    return asyncio.run(send())


def listed(two) -> list[str]:
    return [card["id"] for card in httpx.get(f"{two.base_url}/v1/models", timeout=10).json()["data"]]


def test_each_model_answers_exactly_as_transformers_does_for_it(two, cases, default_model):
    for model in (MODEL_A, MODEL_B):
        for prompt, expected in cases[model]:
            response = complete(two.base_url, model, prompt)
            assert response.status_code == 200, response.text
            assert response.json()["model"] == model
            assert tokens_of(two, model, response.json()) == expected, model
    prompt, expected = cases[MODEL_B][1]
    assert reference_greedy(default_model, prompt, TOKENS)[0] != expected  # model A would have said otherwise
    events = stream(two.base_url, {"model": MODEL_B, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
                                   "ignore_eos": True})
    assert tokens_of(two, MODEL_B, events[-1]) == expected


def test_both_models_are_listed_each_with_its_context_and_an_unknown_one_is_a_404(two):
    cards = {card["id"]: card for card in httpx.get(f"{two.base_url}/v1/models", timeout=10).json()["data"]}
    assert list(cards) == [MODEL_A, MODEL_B]
    assert (cards[MODEL_A]["max_model_len"], cards[MODEL_B]["max_model_len"]) == (4096, B_CONTEXT)
    assert all(card["object"] == "model" and card["owned_by"] == "splitserve" for card in cards.values())
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/tokenize", {"prompt": "hi"})):
        response = httpx.post(f"{two.base_url}{path}", json={"model": "gpt-9", **body}, timeout=30)
        assert response.status_code == 404, (path, response.text)
        assert response.json() == {"error": {
            "message": "The model `gpt-9` does not exist or you do not have access to it.",
            "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
    # Each model's prompts are checked against its own context.
    words = "hello " * (B_CONTEXT + 10)  # a token a word
    for model, status in ((MODEL_A, 200), (MODEL_B, 400)):
        response = httpx.post(f"{two.base_url}/tokenize", json={"model": model, "prompt": words}, timeout=30)
        assert response.status_code == status, (model, response.text)
    long = list(range(5, 5 + B_CONTEXT + 10))
    assert complete(two.base_url, MODEL_B, long).json()["error"]["code"] == "context_length_exceeded"


def test_metrics_and_readiness_name_each_model(two, cases):
    prompt, _ = cases[MODEL_B][0]
    assert complete(two.base_url, MODEL_B, prompt).status_code == 200
    found = samples(two.base_url)
    gateway = {"service": "gateway", "instance": "gateway-0"}
    assert value(found, "vllm:request_success_total", model_name=MODEL_B, finished_reason="length", **gateway) >= 1
    assert value(found, "vllm:generation_tokens_total", model_name=MODEL_B, **gateway) >= TOKENS
    assert value(found, "splitserve_requests_total", model_name=MODEL_B, endpoint="completions", status="ok",
                 **gateway) >= 1
    assert value(found, "vllm:time_to_first_token_seconds_count", model_name=MODEL_B, **gateway) >= 1
    assert len(matching(found, "splitserve_gateway_requests_waiting", **gateway)) == 2
    # Both models' pools have a scheduler-0 and a decode-0: the model tells them apart.
    for model in (MODEL_A, MODEL_B):
        assert value(found, "splitserve_service_up", model_name=model, service="decode", instance="decode-0") == 1
        assert value(found, "splitserve_service_up", model_name=model, service="scheduler",
                     instance="scheduler-0") == 1
        assert value(found, "splitserve_kv_blocks_total", model_name=model, instance="decode-0") > 0
    routed = matching(found, "splitserve_scheduler_routed_total", model_name=MODEL_B, outcome="assigned")
    assert routed and routed[0] >= 1

    ready = httpx.get(f"{two.base_url}/ready", timeout=10)
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    models = ready.json()["models"]
    assert list(models) == [MODEL_A, MODEL_B]
    assert models[MODEL_B]["ready"] == {"scheduler": 1, "decode": 1} and models[MODEL_B]["missing"] == {}


def test_serve_model_takes_a_model_away_once_its_open_stream_is_done_and_gives_it_back(two, cases, model_b):
    decode_b = two.procs[f"{MODEL_B}/decode"]
    body = {"model": MODEL_B, "prompt": cases[MODEL_B][0][0], "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        started: list = []
        open_stream = pool.submit(stream, two.base_url, body, lambda events: started.append(len(events)))
        wait_until(lambda: started, 60, "model B's stream never started", poll_s=0.05)
        os.kill(decode_b.pid, signal.SIGSTOP)  # the stream cannot end until it goes on
        try:
            unserving = pool.submit(change, two, ServeModel(served_name=MODEL_B, serve=False))
            wait_until(lambda: listed(two) == [MODEL_A], 30, "model B is still listed")
            gone = complete(two.base_url, MODEL_B, "hello")
            assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
            assert complete(two.base_url, MODEL_A, "hello").status_code == 200  # the other model serves on
            assert not unserving.done()  # it waits for the open stream
        finally:
            os.kill(decode_b.pid, signal.SIGCONT)
        events = open_stream.result(timeout=120)
        reply = unserving.result(timeout=150)
    assert (reply.ok, reply.models) == (True, [MODEL_A])
    assert not [e for e in events if "error" in e]  # it ran to its end
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"]] == ["length"]
    assert len(two.tap_b.token_ids(events[-1])) == body["max_tokens"]

    # What the gateway refuses changes nothing.
    refusals = {"unknown_model": ServeModel(served_name=MODEL_B, serve=False),
                "last_model": ServeModel(served_name=MODEL_A, serve=False),
                "already_served": ServeModel(served_name=MODEL_A, serve=True, model=model_b, namespace="elsewhere"),
                "failed": ServeModel(served_name=MODEL_B, serve=True, model=str(two.log_dir / "no-such-model"),
                                     namespace=two.model_namespaces[MODEL_B])}
    for code, command in refusals.items():
        reply = change(two, command)
        assert (reply.ok, reply.code, reply.models) == (False, code, [MODEL_A]), reply
        assert reply.error
    assert listed(two) == [MODEL_A]

    # And back, at runtime: routed to its pools again, exactly.
    reply = change(two, ServeModel(served_name=MODEL_B, serve=True, model=model_b,
                                   namespace=two.model_namespaces[MODEL_B]))
    assert (reply.ok, reply.models) == (True, [MODEL_A, MODEL_B]), reply
    assert listed(two) == [MODEL_A, MODEL_B]
    for prompt, expected in cases[MODEL_B]:
        response = complete(two.base_url, MODEL_B, prompt)
        assert response.status_code == 200, response.text
        assert tokens_of(two, MODEL_B, response.json()) == expected
    assert json.loads(httpx.get(f"{two.base_url}/ready", timeout=10).text)["models"][MODEL_B]["status"] == "ready"
