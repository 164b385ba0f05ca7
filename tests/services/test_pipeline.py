"""Pipeline stages end to end: the same tokens as transformers through 2, 3 and 4 stage processes, each
holding only its share of the weights; a stage killed mid-stream costs its stream a wait, never a token."""

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from transformers import AutoConfig, AutoTokenizer

from reference import reference_logprobs, safe_prompts
from support.deployment import start_deployment, start_pipeline
from support.metrics import matching, samples
from support.sse import stream, streamed_text
from support.waiting import wait_until

MODEL = "splitserve-default-llama"
LENGTHS = [3, 20, 64, 150, 400, 1000]


@pytest.fixture(scope="module")
def cases(default_model):
    return safe_prompts(default_model, 2048, LENGTHS, 16, seed=3)


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return AutoTokenizer.from_pretrained(default_model)


def complete(base_url: str, prompt, **kwargs) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **kwargs}
    return httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def token_ids_of(deployment, response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return deployment.token_ids(response.json())


def assert_matches_transformers(deployment, cases, tokenizer) -> None:
    """Every case alone, then 16 at once of mixed lengths: transformers' greedy tokens (and their text)."""
    for prompt, expected in cases:
        response = complete(deployment.base_url, prompt)
        assert token_ids_of(deployment, response) == expected
        assert text_of(response) == tokenizer.decode(expected, skip_special_tokens=True)
    batch = (cases * 3)[:16]
    with ThreadPoolExecutor(16) as pool:
        outputs = list(pool.map(lambda case: token_ids_of(deployment, complete(deployment.base_url, case[0])), batch))
    assert outputs == [e for _, e in batch]


SMALL = ("--inline-activation-bytes", str(16 << 10))  # prefill chunks over the side channel, decode steps inline
TWO_STAGES = [(0, 2), (2, 4)]  # the package's `two_stages` deployment (tests/services/conftest.py)


def failures(deployment, stages: int) -> tuple:
    """The pipeline's failed steps and sends so far: the head's, then each stage's."""
    head = deployment.stats("stage-0").details
    others = [deployment.stats(f"stage-{i}").details for i in range(1, stages)]
    return (head["steps_failed"], *(d["steps"].get("failed", 0) for d in others),
            sum(d["link"]["failed_sends"] for d in [head, *others]))


@pytest.mark.parametrize("split", [
    TWO_STAGES,
    [(0, 2), (2, 3), (3, 4)],  # 4 layers over 3 stages: uneven
    [(0, 1), (1, 2), (2, 3), (3, 4)],
])
def test_pipeline_matches_transformers_alone_and_concurrently(nats_server, default_model, tmp_path, cases, tokenizer,
                                                              split, request):
    shared = split == TWO_STAGES
    deployment = request.getfixturevalue("two_stages") if shared else start_pipeline(
        nats_server.url, tmp_path, default_model, split, microbatches=2, head_args=SMALL, stage_args=SMALL)
    try:
        failed = failures(deployment, len(split))
        assert_matches_transformers(deployment, cases, tokenizer)
        assert failures(deployment, len(split)) == failed  # no step and no send failed

        head = deployment.stats("stage-0")
        assert head.layer_range == tuple(split[0])
        assert head.kv_blocks_free == head.kv_blocks_total  # every request's blocks came back
        parameter_bytes = [head.details["parameter_bytes"]]
        for i, (start, end) in enumerate(split[1:], start=1):
            stage = deployment.stats(f"stage-{i}")
            assert stage.layer_range == (start, end)
            assert stage.details["steps"].get("forwarded", 0) > 0
            assert 0 <= stage.details["utilization"]["idle_fraction"] < 1
            parameter_bytes.append(stage.details["parameter_bytes"])
        # Each process holds its share only: a middle stage exactly its layers' weights, no embedding, no LM head.
        assert all(b > 0 for b in parameter_bytes)
        if len(split) > 2:
            per_layer = parameter_bytes[1] // (split[1][1] - split[1][0])
            assert parameter_bytes[0] > (split[0][1] - split[0][0]) * per_layer  # the head also embeds
            assert sum(parameter_bytes) < len(split) * parameter_bytes[0]
        links = [head.details["link"]] + [deployment.stats(f"stage-{i}").details["link"] for i in range(1, len(split))]
        assert sum(link["side_channel_transfers_sent"] for link in links) > 0  # prefill chunks
        assert sum(link["inline_messages_sent"] for link in links) > 0  # decode steps
    finally:
        if not shared:
            deployment.stop()


def test_openai_client_streams_from_a_pipeline(nats_server, default_model, tmp_path, cases, tokenizer):
    from openai import OpenAI

    deployment = start_pipeline(nats_server.url, tmp_path, default_model, [(0, 3), (3, 4)], microbatches=3)
    try:
        client = OpenAI(base_url=deployment.api, api_key="unused")
        prompt, expected = cases[3]
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = list(stream)
        assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == tokenizer.decode(
            expected, skip_special_tokens=True)
        assert deployment.token_ids({"id": chunks[0].id}) == expected
        # The prompt's logprobs come from the last stage with the sampled logits; a grammar holds across stages.
        body = complete(deployment.base_url, prompt, max_tokens=4, prompt_logprobs=1).json()
        reference = reference_logprobs(default_model, prompt[:1], prompt[1:])
        shown = body["choices"][0]["prompt_logprobs"]
        assert shown[0] is None and [p[str(t)]["logprob"] for p, t in zip(shown[1:], prompt[1:])] == pytest.approx(
            [reference[j, t].item() for j, t in enumerate(prompt[1:])], abs=1e-4)
        assert deployment.token_ids(body) == expected[:4]
        picked = complete(deployment.base_url, prompt, max_tokens=8, guided_choice=["alpha", "beta"]).json()
        assert picked["choices"][0]["text"] in ("alpha", "beta")
        # Each stage's bubble and bytes show on the gateway's /metrics (it asks each stage as it is read).
        def busy_metrics():
            found = samples(deployment.base_url)
            busy = matching(found, "splitserve_pipeline_stage_busy_seconds_total", instance="stage-1")
            return found if busy and busy[0] > 0 else None

        found = wait_until(busy_metrics, 10, "stage-1's busy seconds never showed on /metrics", poll_s=0.5)
        head = {"instance": "stage-0", "service": "decode", "model_name": MODEL}
        assert matching(found, "splitserve_pipeline_stage_idle_fraction", **head)
        assert matching(found, "splitserve_pipeline_activation_bytes_total", path="inline", **head)
    finally:
        deployment.stop()


def test_a_stage_killed_mid_stream_the_stream_waits_for_the_pipeline_and_goes_on_exactly(two_stages, cases):
    deployment = two_stages
    prompt, _ = cases[3]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 300, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    reference = stream(deployment.base_url, body)
    moved = sum(matching(samples(deployment.base_url), "splitserve_request_migrations_total"))
    resets = deployment.stats("stage-0").details["resets"]
    killed = []

    def kill_stage_1(events):
        if len(events) == 10 and not killed:
            os.kill(deployment.procs["stage-1"].pid, signal.SIGKILL)
            killed.append(time.monotonic())
            # It comes back (as its supervisor would start it): the head is whole, and the only pipeline.
            deployment.restart("stage-1")

    events = stream(deployment.base_url, body, kill_stage_1)
    assert killed, "the stream ended before the stage could be killed"
    # The head failed the stream at once (the stage left the registry, taking the request's KV with it); the
    # gateway moved it without ruling the head out, and the scheduler held it until the pipeline was whole.
    assert not [e for e in events if "error" in e], events[-3:]
    assert streamed_text(events) == streamed_text(reference)
    assert events[-1]["usage"]["completion_tokens"] == 300
    assert sum(matching(samples(deployment.base_url), "splitserve_request_migrations_total")) == moved + 1
    assert deployment.stats("stage-0").details["resets"] > resets


# Two model shapes: the default (4 layers, head_dim 32) and qwen3 with q/k norms and head_dim 48 != hidden/heads.
@pytest.mark.parametrize("transport, shape", [("shm", "default"), ("tcp", "qwen3-qknorm")])
def test_a_pipelined_prefill_pool_ships_each_stages_kv_straight_to_decode(nats_server, default_model, model_zoo, tmp_path,
                                                                         cases, tokenizer, transport, shape):
    model = default_model if shape == "default" else model_zoo[shape]
    num_layers = AutoConfig.from_pretrained(model).num_hidden_layers
    if shape != "default":
        tokenizer = AutoTokenizer.from_pretrained(model)
        cases = safe_prompts(model, len(tokenizer), LENGTHS, 16, seed=4)
    deployment = start_deployment(nats_server.url, tmp_path, model, prefill_split=[(0, 1), (1, num_layers)],
                                  scheduler_args=("--max-local-prefill", "0"),
                                  prefill_args=("--kv-transport", transport))
    try:
        assert_matches_transformers(deployment, cases, tokenizer)

        decode = deployment.stats("decode-0")
        remote = decode.details["prefill_decisions"].get("remote", 0)
        assert remote >= len(cases) and not decode.details["prefill_decisions"].get("local_fallback_transfer")
        transfers = decode.details["kv_transfer"]
        assert transfers["ok_by_backend"][transport] == remote
        # Every layer came from the stage that computed it: 1 from the head, the rest from the stage.
        head, stage = deployment.stats("prefill-0"), deployment.stats("prefill-stage-1")
        assert head.details["jobs"].get("shipped") == remote and stage.details["kv_shipped"].get("ok") == remote
        assert head.details["kv_transfer"]["ok_by_backend"][transport] == remote
        if transport == "shm":
            assert transfers["in_place_parts"] == num_layers * remote  # no copy but the decode worker's own
        assert head.kv_blocks_free == head.kv_blocks_total  # the prompts' blocks were let go once shipped
    finally:
        deployment.stop()

