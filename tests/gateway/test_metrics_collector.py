"""The gateway's one-stop /metrics from the services' stats: vLLM's engine series for model workers only, which
services answered the scrape, and every series labelled with the model it is of."""

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from contracts import ServiceInfo, ServiceStats
from services.gateway.metrics import GatewayMetrics
from services.gateway.service_stats import ScrapedStats, labelled


def scrape(answered, silent=(), models=(("m", 0, 0),), observe=None) -> dict:
    async def ask():
        return ScrapedStats(answered=list(answered), silent=list(silent))

    metrics = GatewayMetrics(ask, instance="gateway-0", models_now=lambda: models)
    if observe is not None:
        observe(metrics)
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


def test_two_models_services_of_the_same_names_are_told_apart_by_model():
    """Each model's pools live in a namespace of their own, where instance names repeat: the gateway labels
    every series of a service, scheduler and kv-store too, with the model whose namespace it answered in."""
    def of(model: str, role: str, iid: str, **fields) -> ServiceStats:
        return labelled(ScrapedStats([ServiceStats.of(ServiceInfo(instance_id=iid, role=role, served_model_name="",
                                                                  **fields), {"routed": {"assigned": 2}})], []),
                        model).answered[0]

    answered = [of("a", "scheduler", "scheduler-0"), of("b", "scheduler", "scheduler-0"),
                of("a", "decode", "decode-0", kv_blocks_total=10, kv_blocks_free=10),
                of("b", "decode", "decode-0", kv_blocks_total=10, kv_blocks_free=5)]

    def requests(metrics):
        metrics.of_model("b").request_ended("completions", "ok")
        metrics.of_model("b").ttft.observe(0.1)

    found = scrape(answered, models=(("a", 1, 0), ("b", 2, 3)), observe=requests)
    assert sorted((l["model_name"], l["instance"]) for l, _ in found["splitserve_scheduler_routed_total"]) == [
        ("a", "scheduler-0"), ("b", "scheduler-0")]
    usage = {l["model_name"]: v for l, v in found["vllm:kv_cache_usage_perc"]}
    assert usage == {"a": 0.0, "b": 0.5}
    assert sorted((l["model_name"], l["service"]) for l, _ in found["splitserve_service_up"]) == [
        ("a", "decode"), ("a", "scheduler"), ("b", "decode"), ("b", "scheduler")]
    assert {l["model_name"]: v for l, v in found["splitserve_gateway_requests_waiting"]} == {"a": 1, "b": 2}
    assert {l["model_name"]: v for l, v in found["splitserve_gateway_forged_events_total"]} == {"a": 0, "b": 3}
    (labels, count), = [(l, v) for l, v in found["splitserve_requests_total"]]
    assert (labels["model_name"], count) == ("b", 1)
    assert [l["model_name"] for l, v in found["vllm:time_to_first_token_seconds_count"] if v] == ["b"]
    # One label order everywhere: the model, the service, the instance, then the series' own.
    text = asyncio.run(GatewayMetrics(_no_services, instance="g").exposition()).decode()
    assert all(not line.split("{")[1].startswith(("service", "instance")) for line in text.splitlines()
               if "{" in line and not line.startswith("#"))


async def _no_services():
    return ScrapedStats([], [])
