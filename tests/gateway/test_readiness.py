"""What /ready and /health judge, as pure functions (the probes themselves are tested end to end)."""

import json

from contracts import ServiceInfo
from services.gateway.readiness import (ANOTHER_MODEL_NEEDS, fully_ready, judge_model, judge_ready, launcher_failures,
                                        needed_to_serve, ready_counts)
from services.launcher.deployment import Deployment, ServiceRecord, write_deployment


def _entry(role: str, state: str = "ready", n: int = 0) -> ServiceInfo:
    return ServiceInfo(instance_id=f"{role}-{n}", role=role, boot_id=f"boot-{role}-{n}", state=state,
                       started_ms=1, heartbeat_ms=1)


def test_ready_counts_count_only_ready_entries():
    services = [_entry("decode", n=0), _entry("decode", n=1), _entry("decode", "draining", n=2), _entry("scheduler")]
    assert ready_counts(services) == {"decode": 2, "scheduler": 1}


def test_what_a_request_cannot_do_without():
    assert needed_to_serve({"scheduler": 1, "decode": 4}) == {"scheduler": 1, "decode": 1}
    # disagg: prefill workers and the kv-store are optional (a decode worker prefills and computes itself)
    assert needed_to_serve({"scheduler": 1, "decode": 2, "prefill": 2, "kvstore": 1}) == {"scheduler": 1, "decode": 1}
    # a pipeline needs every stage; a prefill pipeline's stages are optional with its head
    assert needed_to_serve({"scheduler": 1, "decode": 1, "stage": 3}) == {"scheduler": 1, "decode": 1, "stage": 3}
    assert needed_to_serve({"scheduler": 1, "decode": 1, "prefill": 1, "stage": 2}) == {"scheduler": 1, "decode": 1}
    assert needed_to_serve({"decode": 0}) == {}


def _judged(counts, expect, connected=True) -> dict:
    return {"m": judge_model(counts, expect, connected=connected)}


def test_ready_degraded_and_unavailable():
    expect = {"scheduler": 1, "decode": 2, "prefill": 1}
    status, body = judge_ready(_judged({"scheduler": 1, "decode": 2, "prefill": 1}, expect), connected=True,
                               draining=False)
    assert (status, body["status"], body["missing"]) == (200, "ready", {})
    status, body = judge_ready(_judged({"scheduler": 1, "decode": 1}, expect), connected=True, draining=False)
    assert (status, body["status"], body["missing"]) == (200, "degraded", {"decode": 1, "prefill": 1})
    status, body = judge_ready(_judged({"scheduler": 1, "prefill": 1}, expect), connected=True, draining=False)
    assert (status, body["status"]) == (503, "unavailable") and body["reason"] == "no ready decode (1 more)"
    ready = _judged({"scheduler": 1, "decode": 2, "prefill": 1}, expect)
    status, body = judge_ready(ready, connected=False, draining=False)
    assert status == 503 and "NATS" in body["reason"]
    status, body = judge_ready(ready, connected=True, draining=True)
    assert status == 503 and "shutting down" in body["reason"]


def test_each_model_is_judged_on_its_own_and_one_without_workers_leaves_the_others_served():
    first = judge_model({"scheduler": 1, "decode": 1}, {"scheduler": 1, "decode": 1}, connected=True)
    other = judge_model({"scheduler": 1}, ANOTHER_MODEL_NEEDS, connected=True)
    assert (other["status"], other["missing"]) == ("unavailable", {"decode": 1})
    status, body = judge_ready({"a": first, "b": other}, connected=True, draining=False)
    assert (status, body["status"], body["reason"]) == (200, "degraded", "b: no ready decode (1 more)")
    assert body["models"]["a"]["status"] == "ready" and body["models"]["b"]["missing"] == {"decode": 1}
    assert body["ready"] == {"scheduler": 1, "decode": 1}  # the first model's counts lead, as with one model
    assert not fully_ready(status, json.dumps(body))  # `up` waits for every model
    served = judge_model({"scheduler": 1, "decode": 3}, ANOTHER_MODEL_NEEDS, connected=True)
    status, body = judge_ready({"a": first, "b": served}, connected=True, draining=False)
    assert (status, body["status"]) == (200, "ready") and fully_ready(status, json.dumps(body))
    cut_off = judge_model({"scheduler": 1, "decode": 1}, ANOTHER_MODEL_NEEDS, connected=False)
    none = judge_model({}, {"scheduler": 1, "decode": 1}, connected=True)
    status, body = judge_ready({"a": none, "b": cut_off}, connected=True, draining=False)
    assert status == 503 and body["reason"] == ("a: no ready scheduler (1 more), decode (1 more); "
                                                "b: the gateway is not connected to NATS")


def test_fully_ready_reads_the_answer():
    assert fully_ready(200, json.dumps({"status": "ready"}))
    assert not fully_ready(200, json.dumps({"status": "degraded"}))
    assert not fully_ready(503, json.dumps({"status": "ready"}))
    assert not fully_ready(200, "not json") and not fully_ready(None, "") and not fully_ready(200, "[]")


def test_launcher_failures_come_from_its_deployment_file(tmp_path):
    assert launcher_failures(None) == [] and launcher_failures(str(tmp_path)) == []
    services = [ServiceRecord(name="decode-0", role="decode", instance_id="decode-0", argv=[], state="failed"),
                ServiceRecord(name="decode-1", role="decode", instance_id="decode-1", argv=[], state="running")]
    write_deployment(tmp_path, Deployment(run_dir=str(tmp_path), namespace="ns", topology="colocated", services=services))
    assert launcher_failures(str(tmp_path)) == ["decode-0"]
    (tmp_path / "deployment.json").write_text("{broken")
    assert launcher_failures(str(tmp_path)) == []
