"""The gateway's one-stop /metrics from the services' stats: vLLM's engine series for model workers only, and
which services answered the scrape."""

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from contracts import ServiceInfo, ServiceStats
from services.gateway.metrics import GatewayMetrics
from services.gateway.service_stats import ScrapedStats


def scrape(answered, silent=()) -> dict:
    async def ask():
        return ScrapedStats(answered=list(answered), silent=list(silent))

    metrics = GatewayMetrics(ask, model_name="m", instance="gateway-0")
    text = asyncio.run(metrics.exposition()).decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def test_kv_usage_is_a_fraction_and_a_kv_store_shows_no_engine():
    decode = ServiceInfo(instance_id="decode-0", role="decode", state="ready", served_model_name="m",
                         kv_blocks_total=200, kv_blocks_free=50, num_running=3, num_waiting=1)
    store = ServiceInfo(instance_id="kvstore-0", role="kvstore", state="ready")
    found = scrape([ServiceStats.of(decode, {}), ServiceStats.of(store, {})])
    labels = {"model_name": "m", "service": "decode", "instance": "decode-0"}
    assert found["vllm:kv_cache_usage_perc"] == [(labels, 0.75)]
    assert found["vllm:num_requests_running"] == [(labels, 3.0)]
    assert found["vllm:num_requests_waiting"] == [(labels, 1.0)]
    assert all(l["instance"] != "kvstore-0" for l, _ in found["splitserve_kv_blocks_total"])


def test_a_service_that_did_not_answer_is_down_and_shows_nothing_else():
    answered = ServiceInfo(instance_id="decode-0", role="decode", served_model_name="m", kv_blocks_total=10)
    silent = ServiceInfo(instance_id="decode-1", role="decode", served_model_name="m", kv_blocks_total=10)
    found = scrape([ServiceStats.of(answered, {})], [silent])
    assert sorted((l["instance"], v) for l, v in found["splitserve_service_up"]) == [("decode-0", 1), ("decode-1", 0)]
    assert [l["instance"] for l, _ in found["vllm:num_requests_running"]] == ["decode-0"]


def test_the_gateways_own_series_name_the_model_service_and_instance():
    found = scrape([])
    (labels, _), = found["splitserve_gateway_requests_waiting"]
    assert labels == {"model_name": "m", "service": "gateway", "instance": "gateway-0"}
