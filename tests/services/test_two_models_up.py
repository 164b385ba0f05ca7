"""Several models on one deployment through `up`, end to end (issue 38): each model's scheduler and workers in a
namespace of their own, registered there; the gateway routes by the request's `model`; a model served and
unserved at runtime (`splitserve models serve|unserve`)."""

import json
import os
import signal

import httpx
import pytest

from support.up import MODEL, ps, start_up
from test_scale import splitserve

pytestmark = [pytest.mark.timeout(300)]


def served(run_dir) -> dict:
    result = splitserve("models", "served", "--run-dir", str(run_dir), "--json")
    assert result.returncode == 0, result.stderr
    return {m["name"]: m for m in json.loads(result.stdout)["models"]}


def registered(model: dict) -> dict[str, int]:
    """A model's scheduler and workers registered ready in its namespace (`splitserve models served`)."""
    return {role: n for role, n in model["ready"].items() if role in ("scheduler", "decode", "prefill")}


def complete(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60,
                      json={"model": model, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})


def test_up_serves_two_models_each_in_its_own_namespace(tmp_path, default_model, model_zoo):
    up = start_up(tmp_path / "run", "--topology", "colocated", "--model", f"{model_zoo['qwen2-bias']}:name=b")
    try:
        namespace = f"{up.namespace}-b"
        models = served(up.run_dir)
        assert [(m["name"], m["state"], m["namespace"]) for m in models.values()] == [
            (MODEL, "serving", up.namespace), ("b", "serving", namespace)]
        assert registered(models["b"]) == {"scheduler": 1, "decode": 1}  # in its own namespace
        assert {s["name"]: s["model"] for s in ps(up.run_dir)["services"] if s["role"] != "gateway"} == {
            "scheduler-0": MODEL, "decode-0": MODEL, "m1-scheduler-0": "b", "m1-decode-0": "b"}
        rows = [line.split() for line in splitserve("ps", "--run-dir", str(up.run_dir)).stdout.splitlines()]
        assert ["m1-decode-0", "decode", "b", "m1-decode-0"] in [row[:4] for row in rows]  # NAME ROLE MODEL ID
        # The gateway's part: it routes by the request's model, and knows no third.
        assert complete(up.url, MODEL).status_code == 200 and complete(up.url, "b").status_code == 200
        assert complete(up.url, "nope").status_code == 404
        result = splitserve("models", "unserve", "b", "--run-dir", str(up.run_dir), "--wait", "--timeout", "60",
                            timeout_s=90)
        assert result.returncode == 0, result.stderr
        assert complete(up.url, "b").status_code == 404 and complete(up.url, MODEL).status_code == 200
        assert not (up.run_dir / "creds" / "m1-decode-0.nk").exists()
        assert up.stop() == 0
    finally:
        if up.proc.poll() is None:
            os.killpg(up.proc.pid, signal.SIGKILL)


def test_a_model_served_at_runtime_registers_in_its_own_namespace(tmp_path, default_model, model_zoo):
    up = start_up(tmp_path / "run", "--topology", "colocated")
    try:
        namespace = f"{up.namespace}-b"
        result = splitserve("models", "serve", "b", "--model", model_zoo["qwen2-bias"], "topology=colocated",
                            "--run-dir", str(up.run_dir), "--wait", "--timeout", "150", timeout_s=180)
        assert f"serving b in namespace {namespace}: starting m1-scheduler-0, m1-decode-0" in result.stdout
        assert result.returncode == 0 and f"serving b (namespace {namespace})" in result.stdout, result.stderr
        assert registered(served(up.run_dir)["b"]) == {"scheduler": 1, "decode": 1}
        assert complete(up.url, "b").status_code == 200
        result = splitserve("models", "unserve", "b", "--run-dir", str(up.run_dir), "--wait", timeout_s=90)
        assert result.returncode == 0, result.stderr
        assert complete(up.url, "b").status_code == 404
        assert not any(s["name"].startswith("m1-") for s in ps(up.run_dir)["services"])
        assert not (up.run_dir / "creds" / "m1-decode-0.nk").exists()
        assert complete(up.url, MODEL).status_code == 200  # the first model served throughout
        assert up.stop() == 0
    finally:
        if up.proc.poll() is None:
            os.killpg(up.proc.pid, signal.SIGKILL)
