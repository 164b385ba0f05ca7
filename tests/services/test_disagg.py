"""Prefill/decode disaggregation end to end: same tokens as colocated and transformers, and its failure paths."""

import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import nats
import pytest
from transformers import AutoTokenizer

from contracts import ServiceInfo, Subjects
from reference import safe_prompts
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from support.deployment import start_deployment

MODEL = "splitserve-default-llama"
LENGTHS = [3, 20, 64, 150, 400, 1000]


@pytest.fixture(scope="module")
def disagg(nats_server, default_model, tmp_path_factory):
    """Remote prefill forced for every prompt (--max-local-prefill 0)."""
    deployment = start_deployment(nats_server.url, tmp_path_factory.mktemp("logs"), default_model, prefill=1,
                                  scheduler_args=("--max-local-prefill", "0"), decode_args=("--prefill-timeout", "10"))
    yield deployment
    deployment.stop()


@pytest.fixture(scope="module")
def cases(default_model):
    return safe_prompts(default_model, 2048, LENGTHS, 16, seed=3)


def complete(base_url: str, prompt, **kwargs) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **kwargs}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()




def decoded_ids(tokenizer, body) -> str:
    return body["choices"][0]["text"]


def test_remote_prefill_matches_transformers_alone_and_concurrently(disagg, cases, default_model):
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    for prompt, expected in cases:
        body = complete(disagg.base_url, prompt)
        assert body["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        assert body["usage"]["completion_tokens"] == 16 and body["usage"]["prompt_tokens"] == len(prompt)
    decode = disagg.stats("decode-0")
    assert decode.details["prefill_decisions"].get("remote", 0) >= len(cases)
    assert sum(decode.details["kv_transfer"]["bytes_by_backend"].values()) > 0

    # 16 concurrent requests of mixed lengths.
    batch = (cases * 3)[:16]
    with ThreadPoolExecutor(16) as pool:
        bodies = list(pool.map(lambda case: complete(disagg.base_url, case[0]), batch))
    assert [b["choices"][0]["text"] for b in bodies] == [tokenizer.decode(e, skip_special_tokens=True) for _, e in batch]
    assert disagg.stats("decode-0").kv_blocks_free == disagg.stats("decode-0").kv_blocks_total


def test_seeded_sampling_is_the_same_as_colocated(disagg, default_model):
    prompt = list(range(100, 180))
    params = dict(temperature=0.8, top_p=0.9, seed=1234)
    engine = LLMEngine(EngineConfig(model=default_model, dtype="float32", num_kv_blocks=64))
    expected = engine.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True, **params))[0].text
    assert complete(disagg.base_url, prompt, **params)["choices"][0]["text"] == expected


def test_a_prefill_job_for_another_model_is_refused_not_computed(disagg):
    from contracts import PrefillJob, PrefillResult
    from shared.transfer import TransferTicket

    subjects = Subjects(disagg.namespace)

    async def offer(fingerprint: bytes, request_id: str) -> PrefillResult:
        nc = await nats.connect(disagg.nats_url)
        try:
            results = await nc.subscribe(f"{disagg.namespace}.test.{request_id}")
            ticket = TransferTicket(transfer_id=request_id, endpoint={"host": "127.0.0.1", "port": 9, "host_id": "elsewhere"}, token=b"t" * 32,
                                    deadline_unix_s=time.time() + 5)
            job = PrefillJob(request_id=request_id, model=MODEL, prompt_token_ids=list(range(100, 140)),
                             sampling={"max_tokens": 4, "temperature": 0.0, "seed": 1}, ticket=ticket.to_dict(),
                             reply_subject=f"{disagg.namespace}.test.{request_id}", block_size=16,
                             model_fingerprint=fingerprint, deadline_ms=int((time.time() + 5) * 1000),
                             created_ms=int(time.time() * 1000))
            await nc.request(subjects.prefill_offer("prefill-0"), job.encode(), timeout=5)
            return PrefillResult.decode((await results.next_msg(timeout=10)).data)
        finally:
            await nc.close()

    refused = asyncio.run(offer(b"\x00" * 16, "other-model-job"))
    assert not refused.ok and "another model" in refused.error and refused.first_token_id == -1
    deadline = time.monotonic() + 10  # (the registry entry is heartbeated each second)
    while (entry := asyncio.run(_registry_entry(disagg, "prefill", "prefill-0"))).details["jobs"].get(
            "refused_other_model") != 1:
        assert time.monotonic() < deadline, entry.details["jobs"]
        time.sleep(0.2)
    # control: the same job with the deployment's own fingerprint is computed (its KV then fails to ship: port 9)
    own = asyncio.run(offer(bytes.fromhex(entry.details["kv_fingerprint"]), "own-model-job"))
    assert own.ok and own.first_token_id >= 0 and own.model_fingerprint.hex() == entry.details["kv_fingerprint"]


def test_transfer_that_never_arrives_falls_back_locally(nats_server, default_model, tmp_path, cases):
    """A frozen prefill worker: the decode worker gives up at its deadline and prefills itself."""
    deployment = start_deployment(nats_server.url, tmp_path, default_model, prefill=1,
                                  scheduler_args=("--max-local-prefill", "0"), decode_args=("--prefill-timeout", "3"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(default_model)
        prompt, expected = cases[3]
        os.kill(deployment.procs["prefill-0"].pid, signal.SIGSTOP)
        started = time.monotonic()
        body = complete(deployment.base_url, prompt)
        assert time.monotonic() - started < 15
        assert body["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        assert deployment.stats("decode-0").details["prefill_decisions"].get("local_fallback_no_result", 0) == 1

        # Client disconnect while the prefill is pending frees the decode worker's reserved blocks.
        with httpx.stream("POST", f"{deployment.base_url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 50, "stream": True}) as response:
            assert response.status_code == 200
            time.sleep(0.5)
            assert deployment.stats("decode-0").kv_blocks_free < deployment.stats("decode-0").kv_blocks_total
        closed = time.monotonic()
        while deployment.stats("decode-0").kv_blocks_free != deployment.stats("decode-0").kv_blocks_total:
            assert time.monotonic() - closed < 1.0, "reserved blocks still held a second after the disconnect"
            time.sleep(0.05)
        os.kill(deployment.procs["prefill-0"].pid, signal.SIGCONT)
        # The prefill worker drops the cancelled job and holds nothing.
        deadline = time.monotonic() + 10
        while True:
            prefill = deployment.stats("prefill-0")
            if prefill.num_running == 0 and prefill.kv_blocks_free == prefill.kv_blocks_total:
                break
            assert time.monotonic() < deadline, prefill
            time.sleep(0.2)
    finally:
        os.kill(deployment.procs["prefill-0"].pid, signal.SIGCONT)
        deployment.stop()


def test_prefill_worker_killed_mid_job_completes_once(nats_server, default_model, tmp_path, cases):
    deployment = start_deployment(nats_server.url, tmp_path, default_model, prefill=2,
                                  scheduler_args=("--max-local-prefill", "0"), decode_args=("--prefill-timeout", "20"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(default_model)
        prompt, expected = cases[-1]
        # Freeze one worker so that it takes the job and dies with it; the other must redo it.
        os.kill(deployment.procs["prefill-1"].pid, signal.SIGSTOP)
        os.kill(deployment.procs["prefill-0"].pid, signal.SIGSTOP)
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(complete, deployment.base_url, prompt, stream=False)
            time.sleep(1.0)
            os.kill(deployment.procs["prefill-1"].pid, signal.SIGCONT)
            time.sleep(0.05)
            os.kill(deployment.procs["prefill-0"].pid, signal.SIGKILL)
            body = future.result(timeout=60)
        assert body["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        assert body["usage"]["completion_tokens"] == 16
    finally:
        for name in ("prefill-0", "prefill-1"):
            try:
                os.kill(deployment.procs[name].pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        deployment.stop()


def test_gateway_metrics_show_the_disaggregation(disagg, cases):
    complete(disagg.base_url, cases[2][0])

    def scrape() -> str:
        return httpx.get(f"{disagg.base_url}/metrics", timeout=10).text

    deadline = time.monotonic() + 5
    while True:
        text = scrape()
        lines = [line for line in text.splitlines() if not line.startswith("#")]
        transferred = [l for l in lines if l.startswith("splitserve_kv_transfer_bytes_total{") and 'instance="decode-0"' in l]
        remote = [l for l in lines if l.startswith("splitserve_disagg_decisions_total{") and 'decision="remote"' in l]
        if transferred and remote and float(transferred[0].split()[-1]) > 0:
            break
        assert time.monotonic() < deadline, text
        time.sleep(0.3)
    assert float(remote[0].split()[-1]) >= 1
    assert any(l.startswith('splitserve_kv_transfer_seconds_count{') for l in lines)
    assert any(l.startswith("splitserve_time_per_output_token_seconds_count") for l in lines)
    assert any(l.startswith("splitserve_time_to_first_token_seconds_count") for l in lines)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_each_kv_transport_decodes_identically(nats_server, default_model, tmp_path, cases, transport):
    deployment = start_deployment(nats_server.url, tmp_path, default_model, prefill=1,
                                  scheduler_args=("--max-local-prefill", "0"), prefill_args=("--kv-transport", transport))
    try:
        deployment.wait_scheduler_sees("prefill", 1)  # else the first prompts may be prefilled locally
        tokenizer = AutoTokenizer.from_pretrained(default_model)
        for prompt, expected in cases[2:5]:
            body = complete(deployment.base_url, prompt)
            assert body["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        transfers = deployment.stats("decode-0").details["kv_transfer"]
        moved = transfers["bytes_by_backend"]
        assert set(moved) == {transport} and moved[transport] > 0
        # Over shm the decode worker copied every layer straight out of the prefill worker's cache.
        layers = 4  # of the default model; a layer's KV here is well under a part's split size
        assert transfers["in_place_parts"] == (layers * transfers["ok_by_backend"]["shm"] if transport == "shm" else 0)
    finally:
        deployment.stop()


def test_default_threshold_prefills_short_prompts_locally(nats_server, default_model, tmp_path, cases):
    # One request at a time; a decode worker's load is a heartbeat old, so with short-prompt offloading on a
    # short prompt right after another request may count it as busy and go remote (tested below).
    deployment = start_deployment(nats_server.url, tmp_path, default_model, prefill=1,
                                  scheduler_args=("--no-offload-short-prefills",))
    try:
        tokenizer = AutoTokenizer.from_pretrained(default_model)
        for prompt, expected in cases:  # 3 .. 1000 tokens: both sides of the 256-token default
            body = complete(deployment.base_url, prompt)
            assert body["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        deadline = time.monotonic() + 5  # the registry entry is refreshed every second
        while True:
            decisions = asyncio.run(_registry_entry(deployment, "scheduler", "scheduler-0")).details["disagg_decisions"]
            if decisions.get("local", 0) >= 3 and decisions.get("remote", 0) >= 2:
                break
            assert time.monotonic() < deadline, decisions
            time.sleep(0.3)
    finally:
        deployment.stop()


def test_a_short_prompt_goes_to_the_idle_prefill_worker_while_its_decode_worker_streams(
        nats_server, default_model, tmp_path, cases):
    deployment = start_deployment(nats_server.url, tmp_path, default_model, prefill=1)
    try:
        deployment.wait_scheduler_sees("prefill", 1)
        tokenizer = AutoTokenizer.from_pretrained(default_model)
        with ThreadPoolExecutor(1) as pool:
            # A long stream keeps the decode worker busy (a short prompt to an idle worker: computed there).
            streaming = pool.submit(complete, deployment.base_url, cases[1][0], max_tokens=1500)
            deadline = time.monotonic() + 30
            while asyncio.run(_registry_entry(deployment, "scheduler", "scheduler-0")).details["disagg_decisions"].get("local", 0) < 1:
                assert time.monotonic() < deadline, "the first request was never routed"
                time.sleep(0.1)
            prompt, expected = cases[3]  # 150 tokens: under the 256-token threshold
            body = complete(deployment.base_url, prompt)
            assert body["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
            assert not streaming.done(), "the long stream ended first: nothing was busy"
            assert deployment.stats("decode-0").details["prefill_decisions"].get("remote") == 1
            deadline = time.monotonic() + 5  # the scheduler's registry entry is refreshed every second
            while (decisions := asyncio.run(_registry_entry(deployment, "scheduler", "scheduler-0")).details["disagg_decisions"]) != {
                    "local": 1, "remote": 1}:
                assert time.monotonic() < deadline, decisions
                time.sleep(0.3)
            streaming.result(timeout=120)
    finally:
        deployment.stop()


async def _registry_entry(deployment, role: str, instance_id: str) -> ServiceInfo:
    nc = await nats.connect(deployment.nats_url)
    try:
        kv = await nc.jetstream().key_value(Subjects(deployment.namespace).registry_bucket)
        return ServiceInfo.decode((await kv.get(f"{role}.{instance_id}")).value)
    finally:
        await nc.close()
