"""The gateway's /metrics: valid Prometheus text, its histograms count the requests just made, and every
service's series are there, labelled by service and instance; vLLM's names (and model_name) where vLLM has the
same measure."""

import os
import signal
import time

import httpx
import pytest

from services.gateway.service_stats import STATS_TIMEOUT_S

from support.deployment import start_deployment
from support.metrics import matching, samples, value
from support.waiting import wait_until

MODEL = "splitserve-default-llama"


@pytest.mark.timeout(300)
def test_metrics_count_the_requests_and_show_every_service(nats_server, default_model, tmp_path):
    deployment = start_deployment(nats_server.url, tmp_path, default_model, workers=2)
    try:
        for stream in (False, True, True):
            body = {"model": MODEL, "prompt": list(range(100, 140)), "max_tokens": 6, "temperature": 0,
                    "ignore_eos": True, "stream": stream}
            with httpx.stream("POST", f"{deployment.base_url}/v1/completions", json=body, timeout=60) as response:
                assert response.status_code == 200
                response.read()
        bad = httpx.post(f"{deployment.base_url}/v1/completions", json={"model": MODEL, "prompt": []}, timeout=30)
        assert bad.status_code == 400

        # The gateway's own series count exactly what was made, each labelled with the model and the gateway.
        found = samples(deployment.base_url)
        own = {"model_name": MODEL, "service": "gateway", "instance": "gateway-0"}
        for histogram in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                          "vllm:request_time_per_output_token_seconds", "vllm:request_prompt_tokens",
                          "vllm:request_generation_tokens"):
            assert value(found, f"{histogram}_count", **own) == 3, histogram
            buckets = [s for s in found[f"{histogram}_bucket"]]
            assert max(s.value for s in buckets) == 3 and value(found, f"{histogram}_bucket", le="+Inf") == 3
        assert value(found, "vllm:inter_token_latency_seconds_count", **own) == 3 * 5  # 6 tokens: 5 gaps each
        assert value(found, "vllm:prompt_tokens_total", **own) == 3 * 40
        assert value(found, "vllm:generation_tokens_total", **own) == 3 * 6
        assert value(found, "vllm:request_success_total", finished_reason="length", **own) == 3
        assert value(found, "splitserve_requests_total", endpoint="completions", status="ok", **own) == 3

        def prompt_tokens(found) -> float:
            """Every prompt token the workers either computed or found cached, as they say."""
            return sum(sum(s.value for s in found.get(name, []) if s.labels.get("instance") in ("decode-0", "decode-1")
                           and s.labels.get("tier", "local") == "local")
                       for name in ("splitserve_prompt_tokens_computed_total", "splitserve_prefix_cache_hit_tokens_total"))

        # The other services' series, as each answers the gateway's stats request at the scrape.
        def counted():
            found = samples(deployment.base_url)
            routed = [s for s in found.get("splitserve_scheduler_routed_total", []) if s.labels["outcome"] == "assigned"]
            # A worker may stream a request's last chunk a step before its engine lets the request go.
            idle = all(matching(found, "vllm:num_requests_running", service="decode", instance=w, model_name=MODEL)
                       == [0] for w in ("decode-0", "decode-1"))
            return (found, routed) if routed and routed[0].value == 3 and prompt_tokens(found) == 3 * 40 and idle \
                else None

        found, routed = wait_until(counted, 10, "the scheduler's 3 routed requests, the workers' 3 * 40 "
                                   "prompt tokens and their idle engines never all showed on /metrics")
        assert routed[0].labels == {"model_name": MODEL, "service": "scheduler", "instance": "scheduler-0",
                                    "outcome": "assigned"}
        assert value(found, "splitserve_queue_depth", instance="scheduler-0", queue="requests") == 0
        for worker in ("decode-0", "decode-1"):
            assert value(found, "splitserve_kv_blocks_total", service="decode", instance=worker) > 0
            assert 0 <= value(found, "vllm:kv_cache_usage_perc", model_name=MODEL, instance=worker) < 1
        computed = sum(value(found, "splitserve_prompt_tokens_computed_total", instance=w) for w in ("decode-0", "decode-1"))
        cached = sum(value(found, "splitserve_prefix_cache_hit_tokens_total", instance=w, tier="local")
                     for w in ("decode-0", "decode-1"))
        assert computed + cached == 3 * 40  # every prompt token either computed or found cached
        up = {s.labels["instance"]: s.value for s in found["splitserve_service_up"]}
        assert up == {"scheduler-0": 1, "decode-0": 1, "decode-1": 1}

        # A frozen worker: the scrape still answers, in the stats timeout, and says which service is missing.
        os.kill(deployment.procs["decode-1"].pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            found = samples(deployment.base_url)
            assert time.monotonic() - started < STATS_TIMEOUT_S + 3
        finally:
            os.kill(deployment.procs["decode-1"].pid, signal.SIGCONT)
        up = {s.labels["instance"]: s.value for s in found["splitserve_service_up"]}
        assert up == {"scheduler-0": 1, "decode-0": 1, "decode-1": 0}
        assert matching(found, "vllm:num_requests_running", instance="decode-1") == []
        assert matching(found, "vllm:num_requests_running", instance="decode-0") == [0]
    finally:
        deployment.stop()
