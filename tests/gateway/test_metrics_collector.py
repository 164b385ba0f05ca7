"""The gateway's one-stop /metrics from registry entries: vLLM's engine series for model workers only."""

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from contracts import ServiceInfo
from services.gateway.metrics import GatewayMetrics


def scrape(entries) -> dict:
    metrics = GatewayMetrics(lambda: entries, model_name="m", instance="gateway-0")
    found = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def test_kv_usage_is_a_fraction_and_a_kv_store_shows_no_engine():
    decode = ServiceInfo(instance_id="decode-0", role="decode", state="ready", served_model_name="m",
                         kv_blocks_total=200, kv_blocks_free=50, num_running=3, num_waiting=1)
    store = ServiceInfo(instance_id="kvstore-0", role="kvstore", state="ready")
    found = scrape([decode, store])
    labels = {"model_name": "m", "service": "decode", "instance": "decode-0"}
    assert found["vllm:kv_cache_usage_perc"] == [(labels, 0.75)]
    assert found["vllm:num_requests_running"] == [(labels, 3.0)]
    assert found["vllm:num_requests_waiting"] == [(labels, 1.0)]
    assert all(l["instance"] != "kvstore-0" for l, _ in found["splitserve_kv_blocks_total"])


def test_the_gateways_own_series_name_the_model_service_and_instance():
    found = scrape([])
    (labels, _), = found["splitserve_gateway_requests_waiting"]
    assert labels == {"model_name": "m", "service": "gateway", "instance": "gateway-0"}
