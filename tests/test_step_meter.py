"""The engine step counts a worker keeps, and the Prometheus series its stats become."""

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.common.service_metrics import StatsCollector
from services.common.step_meter import StepMeter


def test_steps_count_by_kind():
    meter = StepMeter()
    meter.record(0.020, 4, 0)
    meter.record(0.030, 6, 0)
    meter.record(0.100, 1, 512)
    assert meter.details() == {
        "decode": {"steps": 2, "seconds": 0.05, "sequences": 10, "prompt_tokens": 0},
        "prompt": {"steps": 1, "seconds": 0.1, "sequences": 1, "prompt_tokens": 512}}


def test_a_workers_step_counts_are_counters_by_kind():
    meter = StepMeter()
    meter.record(0.5, 3, 0)
    meter.record(2.0, 0, 1000)
    entry = SimpleNamespace(role="decode", instance_id="decode-0", kv_blocks_total=0,
                            details={"engine_steps": meter.details()})
    registry = CollectorRegistry()
    registry.register(StatsCollector(lambda: [entry]))
    found = {(s.name, s.labels.get("kind")): s.value
             for family in text_string_to_metric_families(generate_latest(registry).decode())
             for s in family.samples if s.labels.get("instance") == "decode-0"}
    assert found[("splitserve_engine_steps_total", "decode")] == 1
    assert found[("splitserve_engine_steps_total", "prompt")] == 1
    assert found[("splitserve_engine_step_seconds_total", "prompt")] == 2.0
    assert found[("splitserve_engine_step_sequences_total", "decode")] == 3
    assert found[("splitserve_engine_step_prompt_tokens_total", None)] == 1000


def test_a_stages_own_step_counts_are_not_read_as_engine_steps():
    """A pipeline stage's details have "steps" of their own (forwarded, failed): the scrape still works."""
    stage = SimpleNamespace(role="stage", instance_id="stage-1", kv_blocks_total=0,
                            details={"steps": {"forwarded": 3}, "utilization": {"idle_fraction": 0.5,
                                                                                  "busy_seconds": 1.5,
                                                                                  "idle_seconds": 1.5}})
    registry = CollectorRegistry()
    registry.register(StatsCollector(lambda: [stage]))
    text = generate_latest(registry).decode()
    assert 'splitserve_pipeline_stage_busy_seconds_total{instance="stage-1",service="stage"} 1.5' in text or \
        'splitserve_pipeline_stage_busy_seconds_total{service="stage",instance="stage-1"} 1.5' in text
    assert "splitserve_engine_steps_total{" not in text
