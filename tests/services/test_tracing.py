"""One request through disagg, traced: one trace with the spans of every service it crossed, correctly parented,
exported over OTLP to a receiver the test runs; its id comes back to the client and is on the services' log lines."""

import httpx
import pytest

from support.deployment import start_deployment
from support.otlp_receiver import OtlpHttpReceiver
from support.waiting import wait_until

MODEL = "splitserve-default-llama"


@pytest.mark.timeout(300)
def test_one_request_through_disagg_is_one_trace(nats_server, default_model, tmp_path, monkeypatch):
    receiver = OtlpHttpReceiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # export within a fraction of a second
    deployment = start_deployment(nats_server.url, tmp_path, default_model, prefill=1,
                                  scheduler_args=("--max-local-prefill", "0"), decode_args=("--kv-store",),
                                  prefill_args=("--kv-store",), kvstore_args=())
    try:
        body = {"model": MODEL, "prompt": list(range(100, 180)), "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        response = httpx.post(f"{deployment.base_url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        trace_id = response.headers["x-trace-id"]
        assert len(trace_id) == 32 and int(trace_id, 16)

        # Each service exports its spans in batches of its own: wait for every span asserted on below, and for the
        # parent of each span received.
        wanted = {"gateway.request", "scheduler.route", "decode.request", "decode.remote_prefill", "prefill.job",
                  "kvstore.load_prefix", "kvstore.lookup"}

        def complete():
            received = receiver.of_trace(trace_id)
            ids = {s.span_id for s in received}
            return wanted <= {s.name for s in received} and all(s.parent_span_id in ids for s in received
                                                                 if s.parent_span_id)

        wait_until(complete, 30, f"the spans {wanted} and their parents did not all reach the receiver", poll_s=0.2)
        spans = {s.name: s for s in receiver.of_trace(trace_id)}
        by_id = {s.span_id: s for s in spans.values()}

        def parent(name):
            return by_id[spans[name].parent_span_id].name

        gateway = spans["gateway.request"]
        root = gateway
        while root.parent_span_id:  # (FastAPI's own HTTP spans, when it makes them, sit above ours)
            root = by_id[root.parent_span_id]
        assert gateway.service == root.service == "splitserve-gateway"
        assert gateway.attributes["splitserve.prompt_tokens"] == 80
        assert gateway.attributes["splitserve.completion_tokens"] == 8 and gateway.attributes["splitserve.ttft_s"] > 0
        assert parent("scheduler.route") == "gateway.request"
        assert spans["scheduler.route"].attributes["splitserve.prefill"] == "remote"
        assert spans["scheduler.route"].attributes["splitserve.worker"] == "decode-0"
        candidates = spans["scheduler.route"].attributes["splitserve.candidates"]  # what it was routed by
        assert len(candidates) == 1 and candidates[0].startswith("decode-0: 0/") and candidates[0].endswith(" cached")
        assert parent("decode.request") == "scheduler.route"
        assert parent("decode.remote_prefill") == "decode.request"
        assert spans["decode.remote_prefill"].attributes["splitserve.prefill_outcome"] == "remote"
        transfer = spans["decode.remote_prefill"].attributes
        assert transfer["splitserve.kv_transfer.bytes"] > 0 and transfer["splitserve.kv_transfer.backend"] in ("shm", "tcp")
        assert parent("prefill.job") == "decode.remote_prefill"
        assert spans["prefill.job"].attributes["splitserve.outcome"] == "shipped"
        assert parent("kvstore.load_prefix") == "prefill.job"  # the prefill worker looked in the kv-store
        assert parent("kvstore.lookup") == "kvstore.load_prefix"
        assert len({s.trace_id for s in spans.values()}) == 1

        # The same trace id on the log lines written while serving it.
        assert any(trace_id in line for line in (tmp_path / "prefill-prefill-0.log").read_text().splitlines())
    finally:
        deployment.stop()
        receiver.stop()


@pytest.mark.timeout(300)
def test_a_pipeline_requests_trace_has_each_stages_share_of_its_prompt(nats_server, default_model, tmp_path,
                                                                       monkeypatch):
    from support.deployment import start_pipeline

    receiver = OtlpHttpReceiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    deployment = start_pipeline(nats_server.url, tmp_path, default_model, [(0, 2), (2, 3), (3, 4)],
                                head_args=("--max-num-batched-tokens", "32"))
    try:
        body = {"model": MODEL, "prompt": list(range(100, 180)), "max_tokens": 4, "temperature": 0}
        response = httpx.post(f"{deployment.base_url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        trace_id = response.headers["x-trace-id"]

        def chunks():
            return [s for s in receiver.of_trace(trace_id) if s.name == "stage.prefill_chunk"]

        # 80 prompt tokens in steps of 32: 3 steps, on each of 2 stages; and the head's span of the request
        wait_until(lambda: len(chunks()) >= 6 and any(s.name == "decode.request" for s in receiver.of_trace(trace_id)),
                   30, "the stages' 6 prefill chunks and the head's request span did not all reach the receiver",
                   poll_s=0.2)
        spans = receiver.of_trace(trace_id)
        head = next(s for s in spans if s.name == "decode.request")
        assert head.service == "splitserve-stage"  # the head takes requests like a decode worker
        per_stage = {}
        for chunk in chunks():
            assert chunk.service == "splitserve-stage" and chunk.parent_span_id == head.span_id
            per_stage.setdefault(chunk.attributes["splitserve.stage"], []).append(
                chunk.attributes["splitserve.prompt_tokens_in_step"])
        assert {stage: sorted(tokens) for stage, tokens in per_stage.items()} == {
            "stage-1": [16, 32, 32], "stage-2": [16, 32, 32]}
        assert {c.attributes["splitserve.layers"] for c in chunks()} == {"2:3", "3:4"}
    finally:
        deployment.stop()
        receiver.stop()
