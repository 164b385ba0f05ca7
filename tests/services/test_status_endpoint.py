"""A bus service's status endpoint (`--status-port`): what a kubelet's or compose's probes read."""

import os
import signal

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.status_server import liveness, readiness
from support.waiting import wait_until


@pytest.mark.parametrize("state, fresh, code", [
    ("ready", True, 200),
    ("starting", True, 503),
    ("draining", True, 503),   # leaving: no new work
    ("waiting", True, 503),    # a pipeline head whose stage is gone
    ("ready", False, 503),     # its registry entry is not being kept (NATS away): nobody routes to it
])
def test_ready_only_when_ready_and_registered(state, fresh, code):
    assert readiness(state, fresh)[0] == code


def test_alive_unless_its_nats_connection_is_closed_for_good():
    assert liveness(False)[0] == 200 and liveness(True)[0] == 503


def test_a_pipeline_heads_status_follows_its_stages(two_stages):
    deployment, status = two_stages, two_stages.status_url
    assert httpx.get(f"{status}/health", timeout=5).json() == {"status": "ok"}
    wait_until(lambda: httpx.get(f"{status}/ready", timeout=5).status_code == 200, 10, "the head never ready")
    # Its own series, as of now: the engine's, labelled as the gateway's one-stop view labels them.
    own = {s.name: s for family in text_string_to_metric_families(httpx.get(f"{status}/metrics", timeout=5).text)
           for s in family.samples}
    head = own["vllm:kv_cache_usage_perc"]
    assert head.labels["service"] == "decode" and head.labels["instance"] == "stage-0" and 0 <= head.value < 1
    assert own["splitserve_kv_blocks_total"].value > 0
    os.kill(deployment.procs["stage-1"].pid, signal.SIGKILL)

    def waiting():
        response = httpx.get(f"{status}/ready", timeout=5)
        return response.status_code == 503 and response.json()["state"] == "waiting"

    wait_until(waiting, 20, "the head's /ready did not say it waits for its stage")
    assert httpx.get(f"{status}/health", timeout=5).status_code == 200  # alive all the while
    deployment.restart("stage-1")
    wait_until(lambda: httpx.get(f"{status}/ready", timeout=5).status_code == 200, 60,
               "the head was not ready again once its stage was back")
