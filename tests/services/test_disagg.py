"""Prefill/decode disaggregation end to end: same tokens as colocated and transformers, and its failure paths."""

import asyncio
import json
import os
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import nats
import pytest
from transformers import AutoConfig, AutoTokenizer

from contracts import PrefillResult, Subjects, from_anyone
from reference import reference_greedy, reference_logprobs, safe_prompts, safe_seed
from support.deployment import start_deployment
from support.kv_workload import wait_until
from support.metrics import samples, value
from support.token_tap import BusTap

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


def test_remote_prefill_matches_transformers_alone_and_concurrently(disagg, cases, default_model):
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    for prompt, expected in cases:
        body = complete(disagg.base_url, prompt)
        assert disagg.token_ids(body) == expected
        assert body["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        assert body["usage"]["completion_tokens"] == 16 and body["usage"]["prompt_tokens"] == len(prompt)
    decode = disagg.stats("decode-0")
    assert decode.details["prefill_decisions"].get("remote", 0) >= len(cases)
    assert sum(decode.details["kv_transfer"]["bytes_by_backend"].values()) > 0

    # 16 concurrent requests of mixed lengths.
    batch = (cases * 3)[:16]
    with ThreadPoolExecutor(16) as pool:
        bodies = list(pool.map(lambda case: complete(disagg.base_url, case[0]), batch))
    assert [disagg.token_ids(b) for b in bodies] == [e for _, e in batch]
    assert disagg.stats("decode-0").kv_blocks_free == disagg.stats("decode-0").kv_blocks_total


def test_seeded_sampling_draws_what_the_seed_says_across_prefill_and_decode(disagg, default_model):
    # The prefill worker draws the first token, the decode worker the rest: each with the request's seed.
    prompt = list(range(100, 180))
    seed, expected = safe_seed(default_model, prompt, 16, temperature=0.8, top_p=0.9)
    body = complete(disagg.base_url, prompt, temperature=0.8, top_p=0.9, seed=seed)
    assert disagg.token_ids(body) == expected
    assert expected != reference_greedy(default_model, prompt, 16)[0]


def test_structured_output_across_prefill_and_decode_is_what_one_engine_writes(disagg, default_model):
    """The prefill worker draws the first token inside the grammar, the decode worker goes on from there: the
    output is what one engine alone writes, and it follows the schema."""
    import jsonschema

    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.engine.sampling_params import SamplingParams

    schema = {"type": "object", "additionalProperties": False, "required": ["id", "ok", "words"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"},
                             "words": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4}}}
    prompt = list(range(500, 560))
    body = complete(disagg.base_url, prompt, max_tokens=64, structured_outputs={"json": schema})
    text = body["choices"][0]["text"]
    jsonschema.validate(json.loads(text), schema)
    engine = LLMEngine(EngineConfig(model=default_model, dtype="float32", device="cpu", num_kv_blocks=64))
    alone = engine.generate([prompt], SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True,
                                                     structured_kind="json", structured_spec=json.dumps(schema)))[0]
    assert disagg.token_ids(body) == alone.token_ids and text == alone.text


def test_prompt_logprobs_in_disagg_are_computed_where_the_request_decodes(disagg, default_model):
    """Every prompt goes to the prefill pool here, but one asking for its prompt's logprobs is computed by its
    decode worker (which has the logits; a prefill worker's result carries none): they are transformers' own."""
    prompt = list(range(600, 650))
    body = complete(disagg.base_url, prompt, max_tokens=2, prompt_logprobs=1)
    shown = body["choices"][0]["prompt_logprobs"]
    reference = reference_logprobs(default_model, prompt[:1], prompt[1:])
    assert shown[0] is None and len(shown) == len(prompt)
    for j, position in enumerate(shown[1:]):
        assert position[str(prompt[j + 1])]["logprob"] == pytest.approx(reference[j, prompt[j + 1]].item(), abs=1e-4)
    assert disagg.token_ids(body) == reference_greedy(default_model, prompt, 2)[0]


def test_logprobs_come_from_both_workers_as_transformers_computes_them(disagg, default_model):
    # The first token's logprobs travel from the prefill worker in its PrefillResult, the rest from the decode worker.
    prompt = list(range(300, 340))
    body = complete(disagg.base_url, prompt, max_tokens=6, logprobs=3)
    tokens = disagg.token_ids(body)
    reference = reference_logprobs(default_model, prompt, tokens)
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] == pytest.approx([reference[i, t].item() for i, t in enumerate(tokens)],
                                                       abs=1e-4)
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    for i, top in enumerate(logprobs["top_logprobs"]):  # greedy: the sampled token is the best of the top 3
        values, ids = reference[i].topk(3)
        assert top == pytest.approx({tokenizer.decode([t]): v for t, v in zip(ids.tolist(), values.tolist())},
                                    abs=1e-4)


def test_a_prefill_job_for_another_model_is_refused_not_computed(disagg):
    from contracts import PrefillJob, PrefillResult
    from contracts import TransferEndpoint, TransferTicket
    from shared.engine.sampling_params import SamplingParams

    subjects = Subjects(disagg.namespace)

    async def offer(fingerprint: bytes, request_id: str) -> PrefillResult:
        nc = await nats.connect(disagg.nats_url)
        try:
            results = await nc.subscribe(from_anyone(f"{disagg.namespace}.test.{request_id}"))  # (signed by its sender)
            ticket = TransferTicket(transfer_id=request_id, token=b"t" * 32, deadline_unix_s=time.time() + 5,
                                    endpoint=TransferEndpoint(host="127.0.0.1", port=9, host_id="elsewhere"))
            job = PrefillJob(request_id=request_id, model=MODEL, prompt_token_ids=list(range(100, 140)),
                             sampling=SamplingParams(max_tokens=4, temperature=0.0, seed=1), ticket=ticket,
                             reply_subject=f"{disagg.namespace}.test.{request_id}", block_size=16,
                             model_fingerprint=fingerprint, deadline_ms=int((time.time() + 5) * 1000),
                             created_ms=int(time.time() * 1000))
            await nc.request(subjects.prefill_offer("prefill-0"), job.encode(), timeout=5)
            return PrefillResult.decode((await results.next_msg(timeout=10)).data)
        finally:
            await nc.close()

    refused = asyncio.run(offer(b"\x00" * 16, "other-model-job"))
    assert not refused.ok and "another model" in refused.error and refused.first_token_id == -1
    deadline = time.monotonic() + 10
    while (entry := disagg.stats("prefill-0")).details["jobs"].get(
            "refused_other_model") != 1:
        assert time.monotonic() < deadline, entry.details["jobs"]
        time.sleep(0.2)
    # control: the same job with the deployment's own fingerprint is computed (its KV then fails to ship: port 9)
    own = asyncio.run(offer(entry.kv_fingerprint, "own-model-job"))
    assert own.ok and own.first_token_id >= 0 and own.model_fingerprint == entry.kv_fingerprint


def test_transfer_that_never_arrives_falls_back_locally(nats_server, default_model, tmp_path, cases):
    """A frozen prefill worker: the decode worker gives up at its deadline and prefills itself."""
    deployment = start_deployment(nats_server.url, tmp_path, default_model, prefill=1,
                                  scheduler_args=("--max-local-prefill", "0"), decode_args=("--prefill-timeout", "3"))
    try:
        prompt, expected = cases[3]
        os.kill(deployment.procs["prefill-0"].pid, signal.SIGSTOP)
        started = time.monotonic()
        body = complete(deployment.base_url, prompt)
        assert time.monotonic() - started < 15
        assert deployment.token_ids(body) == expected
        assert deployment.stats("decode-0").details["prefill_decisions"].get("local_fallback_no_result", 0) == 1

        # Client disconnect while the prefill is pending frees the decode worker's reserved blocks.
        with httpx.stream("POST", f"{deployment.base_url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 50, "stream": True}) as response:
            assert response.status_code == 200
            wait_until(lambda: (decode := deployment.stats("decode-0")).kv_blocks_free < decode.kv_blocks_total, 10,
                       "the decode worker reserves blocks for the pending prefill", poll_s=0.05)
        wait_until(lambda: (decode := deployment.stats("decode-0")).kv_blocks_free == decode.kv_blocks_total, 10,
                   "reserved blocks freed after the disconnect", poll_s=0.05)
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


def prefill_queue(deployment):
    """The prefill queue's consumer as the server sees it now (pending, waiting pulls, deliveries, acks)."""
    async def ask():
        nc = await nats.connect(deployment.nats_url)
        try:
            subjects = Subjects(deployment.namespace)
            return await nc.jetstream().consumer_info(subjects.prefill_stream, subjects.prefill_consumer)
        finally:
            await nc.close()
    return asyncio.run(ask())


def stream_into(base_url: str, prompt, chunks: queue.Queue) -> None:
    """A streamed completion, each SSE chunk put into `chunks` as it arrives; None once it ends."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    try:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunks.put(json.loads(line[len("data: "):]))
    finally:
        chunks.put(None)


def rest_of(chunks: queue.Queue) -> list[dict]:
    out = []
    while (chunk := chunks.get(timeout=60)) is not None:
        out.append(chunk)
    return out


def take_the_job_and_die(deployment, taker: str, results: BusTap) -> None:
    """`taker` (stopped, no pull outstanding) takes the queued job, reports its first token and is killed while
    shipping the KV, which the decode worker, stopped meanwhile, cannot have taken."""
    wait_until(lambda: prefill_queue(deployment).num_pending == 1, 15, "the job was never queued", poll_s=0.02)
    reported = len(results.messages())
    os.kill(deployment.procs["decode-0"].pid, signal.SIGSTOP)
    try:
        os.kill(deployment.procs[taker].pid, signal.SIGCONT)
        results.wait_for(lambda r: r.prefill_instance == taker, 15, f"{taker} never reported the first token",
                         after=reported)
        os.kill(deployment.procs[taker].pid, signal.SIGKILL)
        deployment.procs[taker].wait(10)
    finally:
        os.kill(deployment.procs["decode-0"].pid, signal.SIGCONT)


def stop_without_a_pull(deployment, *workers: str) -> None:
    """Freeze prefill workers, until none has a pull request outstanding: a job then waits in the queue."""
    for name in workers:
        os.kill(deployment.procs[name].pid, signal.SIGSTOP)
    wait_until(lambda: prefill_queue(deployment).num_waiting == 0, 15, "a pull is still outstanding", poll_s=0.05)


@pytest.mark.timeout(300)
def test_a_prefill_worker_killed_mid_job_has_it_redelivered_and_a_failed_transfer_falls_back(
        nats_server, default_model, tmp_path, cases):
    """Two prefill workers and one decode worker, --kv-transport auto, every prompt prefilled remotely.

    1. prefill-0 takes a job, reports the first token and is killed (SIGKILL) shipping the KV: the decode worker
       streams the first token at once, before any KV can arrive; the job, never acked, is redelivered to
       prefill-1, whose KV is adopted (over shm: auto, one host). The request completes once, token for token.
    2. /ready says the deployment is degraded and which service is missing.
    3. prefill-1 dies the same way on the next job, with no one to redeliver it to: the transfer fails at its
       deadline and the decode worker prefills locally after the streamed first token, still exactly.
    """
    deployment = start_deployment(nats_server.url, tmp_path, default_model, prefill=2,
                                  scheduler_args=("--max-local-prefill", "0"), decode_args=("--prefill-timeout", "15"),
                                  prefill_args=("--kv-transport", "auto"))
    results = BusTap(deployment.nats_url, from_anyone(Subjects(deployment.namespace).prefill_results("decode-0")), PrefillResult)
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    try:
        prompt, expected = cases[-1]
        stop_without_a_pull(deployment, "prefill-0", "prefill-1")
        chunks = queue.Queue()
        with ThreadPoolExecutor(1) as pool:
            streaming = pool.submit(stream_into, deployment.base_url, prompt, chunks)
            take_the_job_and_die(deployment, "prefill-0", results)
            # The first token reaches the client though no KV can have arrived (its sender is dead, the other
            # prefill worker still frozen), and well before the decode worker would give up on it (15 s).
            first = chunks.get(timeout=10)
            assert first is not None and first["choices"][0]["text"] == tokenizer.decode(expected[:1])
            decode = deployment.stats("decode-0").details
            assert decode["kv_transfer"]["ok_by_backend"] == {} and decode["prefill_decisions"] == {}
            os.kill(deployment.procs["prefill-1"].pid, signal.SIGCONT)
            rest = rest_of(chunks)
            streaming.result()
        assert "".join(c["choices"][0]["text"] for c in [first, *rest] if c["choices"]) == tokenizer.decode(expected)
        assert rest[-1]["usage"]["completion_tokens"] == 16
        assert deployment.token_ids(first) == expected  # every chunk once, in order: the first token not twice
        # prefill-1 ran the job again and its KV was used: no fallback of any kind on the decode worker. Its result
        # and its ack may trail the stream's end (the decode worker already had the first token and the KV).
        results.wait_for(lambda r: r.prefill_instance == "prefill-1", 10, "prefill-1 never reported the job")
        assert [r.prefill_instance for r in results.messages()] == ["prefill-0", "prefill-1"]
        wait_until(lambda: deployment.stats("prefill-1").details["jobs"] == {"redelivered": 1, "shipped": 1}, 10,
                   "prefill-1 never counted the job redelivered and shipped")
        decode = deployment.stats("decode-0").details
        assert decode["prefill_decisions"] == {"remote": 1}
        assert set(decode["kv_transfer"]["bytes_by_backend"]) == {"shm"} and decode["kv_transfer"]["ok_by_backend"] == {"shm": 1}
        # One job in the stream, delivered twice (to each worker), acked once.
        consumer = wait_until(lambda: (c := prefill_queue(deployment)).ack_floor.stream_seq == 1 and c, 10,
                              "the job was never acked")
        assert (consumer.delivered.stream_seq, consumer.delivered.consumer_seq, consumer.ack_floor.stream_seq) == (1, 2, 1)
        assert consumer.num_pending == consumer.num_ack_pending == 0
        assert value(samples(deployment.base_url), "splitserve_requests_total", endpoint="completions",
                     status="ok") == 1

        # /ready stays 200 once the dead worker's registry entry lapses (a decode worker prefills when no prefill
        # worker can), but says the deployment is degraded and what is missing; /health says so too.
        ready = wait_until(lambda: (lambda r: r if r.json()["status"] != "ready" else None)(
            httpx.get(f"{deployment.base_url}/ready", timeout=5)), 20, "/ready stayed 'ready' with a prefill worker gone")
        assert ready.status_code == 200 and ready.json()["status"] == "degraded"
        assert ready.json()["missing"] == {"prefill": 1} and ready.json()["ready"]["prefill"] == 1
        health = httpx.get(f"{deployment.base_url}/health", timeout=5)
        assert health.status_code == 200 and health.json()["missing"] == {"prefill": 1}

        prompt, expected = cases[-2]
        stop_without_a_pull(deployment, "prefill-1")
        with ThreadPoolExecutor(1) as pool:
            streaming = pool.submit(stream_into, deployment.base_url, prompt, chunks)
            take_the_job_and_die(deployment, "prefill-1", results)
            body = [chunks.get(timeout=15), *rest_of(chunks)]
            streaming.result()
        assert deployment.token_ids(body[0]) == expected
        assert deployment.stats("decode-0").details["prefill_decisions"] == {"remote": 1, "local_fallback_transfer": 1}
    finally:
        results.close()
        for name in ("prefill-0", "prefill-1", "decode-0"):
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
    assert any(l.startswith("vllm:request_time_per_output_token_seconds_count") for l in lines)
    assert any(l.startswith("vllm:time_to_first_token_seconds_count") for l in lines)


# Two model shapes: the default, and one KV head with tied embeddings (5 layers, head_dim 16).
@pytest.mark.parametrize("transport, shape", [("tcp", "default"), ("shm", "llama-1kv")])
def test_each_kv_transport_decodes_identically(nats_server, default_model, model_zoo, tmp_path, cases, transport, shape):
    model = default_model if shape == "default" else model_zoo[shape]
    if shape != "default":
        cases = safe_prompts(model, len(AutoTokenizer.from_pretrained(model)), LENGTHS, 16, seed=4)
    deployment = start_deployment(nats_server.url, tmp_path, model, prefill=1,
                                  scheduler_args=("--max-local-prefill", "0"), prefill_args=("--kv-transport", transport))
    try:
        for prompt, expected in cases[2:5]:
            body = complete(deployment.base_url, prompt)
            assert deployment.token_ids(body) == expected
        transfers = deployment.stats("decode-0").details["kv_transfer"]
        moved = transfers["bytes_by_backend"]
        assert set(moved) == {transport} and moved[transport] > 0
        # Over shm the decode worker copied every layer straight out of the prefill worker's cache.
        layers = AutoConfig.from_pretrained(model).num_hidden_layers  # a layer's KV here is well under a part's split size
        assert transfers["in_place_parts"] == (layers * transfers["ok_by_backend"]["shm"] if transport == "shm" else 0)
    finally:
        deployment.stop()


def test_default_threshold_prefills_short_prompts_locally(nats_server, default_model, tmp_path, cases):
    # One request at a time; a decode worker's load is a heartbeat old, so with short-prompt offloading on a
    # short prompt right after another request may count it as busy and go remote (tested below).
    deployment = start_deployment(nats_server.url, tmp_path, default_model, prefill=1,
                                  scheduler_args=("--no-offload-short-prefills",))
    try:
        for prompt, expected in cases:  # 3 .. 1000 tokens: both sides of the 256-token default
            body = complete(deployment.base_url, prompt)
            assert deployment.token_ids(body) == expected
        deadline = time.monotonic() + 5
        while True:
            decisions = deployment.stats("scheduler-0").details["disagg_decisions"]
            if decisions.get("local", 0) >= 3 and decisions.get("remote", 0) >= 2:
                break
            assert time.monotonic() < deadline, decisions
            time.sleep(0.3)
    finally:
        deployment.stop()


def test_a_short_prompt_goes_to_the_idle_prefill_worker_while_its_decode_worker_streams(
        nats_server, default_model, tmp_path, cases):
    deployment = start_deployment(nats_server.url, tmp_path, default_model, prefill=1)
    hang_up = threading.Event()

    def stream_until_hung_up() -> str:
        body = {"model": MODEL, "prompt": cases[1][0], "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{deployment.base_url}/v1/completions", json=body, timeout=120) as response:
            for _ in response.iter_lines():
                if hang_up.is_set():
                    return "hung up"
        return "finished"

    try:
        with ThreadPoolExecutor(1) as pool:
            # A long stream keeps the decode worker busy (a short prompt to an idle worker: computed there).
            streaming = pool.submit(stream_until_hung_up)
            deadline = time.monotonic() + 30
            while deployment.stats("scheduler-0").details["disagg_decisions"].get("local", 0) < 1:
                assert time.monotonic() < deadline, "the first request was never routed"
                time.sleep(0.1)
            prompt, expected = cases[3]  # 150 tokens: under the 256-token threshold
            body = complete(deployment.base_url, prompt)
            assert deployment.token_ids(body) == expected
            assert not streaming.done(), "the long stream ended first: nothing was busy"
            assert deployment.stats("decode-0").details["prefill_decisions"].get("remote") == 1
            deadline = time.monotonic() + 5
            while (decisions := deployment.stats("scheduler-0").details["disagg_decisions"]) != {
                    "local": 1, "remote": 1}:
                assert time.monotonic() < deadline, decisions
                time.sleep(0.3)
            hang_up.set()  # the rest of the stream proves nothing more
            assert streaming.result(timeout=60) == "hung up"
    finally:
        deployment.stop()

