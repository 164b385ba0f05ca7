"""`up --planner slo`: which deployments may have one, its default budget, and the command line it gets."""

import pytest

from services.common.settings import secret_env
from services.launcher.planner_spec import check_planner, default_budget, planner_spec
from services.launcher.up_settings import UpSettings
from services.planner.__main__ import settings_of


def up(**given) -> UpSettings:
    return UpSettings(**given)


@pytest.mark.parametrize("given, error", [
    ({}, None),
    ({"planner": "slo", "ttft_slo_ms": 500, "itl_slo_ms": 50}, None),
    ({"planner": "slo", "topology": "colocated", "decode": 2, "ttft_slo_ms": 500, "itl_slo_ms": 50}, None),
    ({"planner": "slo", "ttft_slo_ms": 500}, "needs both SLOs"),
    ({"planner": "slo", "topology": "pipeline", "ttft_slo_ms": 500, "itl_slo_ms": 50}, "has one pool, its pipelines"),
    ({"ttft_slo_ms": 500}, "need --planner slo"),
    ({"planner": "slo", "ttft_slo_ms": 500, "itl_slo_ms": 50, "decode": 2, "planner_budget": 2},
     "less than the 3"),
])
def test_which_deployments_may_have_a_planner(given, error):
    if error is None:
        check_planner(up(**given))
    else:
        with pytest.raises(ValueError, match=error):
            check_planner(up(**given))


@pytest.mark.parametrize("given, cpus, cpu_count, budget", [
    ({}, (0, 1, 2, 3), 8, 4),  # one worker per CPU the workers are placed on
    ({}, (), 6, 6),  # --cpus none: every CPU
    ({"decode": 3, "prefill": 2}, (0, 1), 2, 5),  # never fewer than it starts
    ({"topology": "colocated"}, (0, 1, 2), 3, 3),
    ({"device": "cuda"}, (0, 1), 2, 2),  # a GPU without a memory share: what it starts
    ({"device": "cuda", "gpu_memory_utilization": 0.2}, (0, 1), 2, 5),
    ({"prefill_device": "cuda:0", "decode_device": "cuda:1", "gpu_memory_utilization": 0.25}, (), 2, 8),
])
def test_the_default_budget(given, cpus, cpu_count, budget):
    assert default_budget(up(**given), cpus, cpu_count) == budget


def test_the_planners_command_line_reads_back():
    spec = planner_spec(up(planner="slo", ttft_slo_ms=250, itl_slo_ms=40, planner_dry_run=True,
                           api_keys=("k1",), protect_metrics=True),
                        "http://127.0.0.1:8000", "/run/control.sock", budget=3, port=12345, model_name="first")
    assert spec.name == "planner-0" and spec.module == "services.planner"
    assert spec.url == "http://127.0.0.1:12345/metrics"
    assert "k1" not in spec.args  # the key goes by its variable
    assert settings_of(list(spec.args), environ=secret_env(spec.settings)) == spec.settings
    assert spec.settings.dry_run and spec.settings.budget == 3 and spec.settings.api_key == "k1"
    assert spec.settings.model_name == "first"  # the first model's series alone: its pools are the ones it moves
