"""`splitserve up` end to end: serve, survive a kill -9 of the worker mid-stream, stop leaving nothing behind."""

import json
import os
import signal
import subprocess
import sys
import uuid

import httpx
import pytest

from services.launcher.forkserver_fork import TITLE
from support.metrics import matching, samples
from support.processes import ROOT, free_port, parent_of, service_env
from support.sse import stream, streamed_text
from support.up import MODEL, ps, start_up
from support.waiting import wait_until


def splitserve(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli.main", *args], capture_output=True, text=True,
                          env=service_env(), cwd=ROOT, timeout=60, **kwargs)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def up(tmp_path, default_model):
    run = start_up(tmp_path / "run")
    yield run.proc, run.url, run.run_dir
    if run.proc.poll() is None:
        os.killpg(run.proc.pid, signal.SIGKILL)


def test_up_survives_a_worker_kill_and_stops_cleanly(up):
    proc, base_url, run_dir = up
    state = ps(run_dir)
    decode = next(s for s in state["services"] if s["role"] == "decode")
    all_pids = [s["pid"] for s in state["services"]] + [state["nats"]["pid"]]
    assert all(pid_alive(pid) for pid in all_pids)
    # Each service is a fork of the launcher's preloaded forkserver, and shows its own command line. (The launcher
    # here is itself a fork of the tests' preloaded forkserver, and forks its own: tests/launcher checks both ways.)
    (forkserver,) = {parent_of(s["pid"]) for s in state["services"]}
    assert parent_of(forkserver) == proc.pid
    assert TITLE.encode() in open(f"/proc/{forkserver}/cmdline", "rb").read()
    assert open(f"/proc/{decode['pid']}/cmdline", "rb").read().replace(b"\0", b" ").split()[1:3] == [
        b"-m", b"services.decode"]

    # A stream is in flight when the only decode worker is killed: it moves, waits for the worker the supervisor
    # starts again, and goes on there, every token once (a hang fails on the client's 30 s read timeout).
    body = {"model": MODEL, "prompt": "A story", "max_tokens": 300, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    reference = stream(base_url, body, timeout_s=30)
    events = stream(base_url, body, lambda events: len(events) == 3 and os.kill(decode["pid"], signal.SIGKILL),
                    timeout_s=30)
    assert not [e for e in events if "error" in e], events[-3:]
    assert streamed_text(events) == streamed_text(reference) and events[-1]["usage"]["completion_tokens"] == 300

    # The supervisor restarts the worker and the deployment is healthy again.
    def restarted():
        entry = next(s for s in ps(run_dir)["services"] if s["role"] == "decode")
        return entry["pid"] != decode["pid"] and pid_alive(entry["pid"]) and entry
    new_decode = wait_until(restarted, 60, "the decode worker was not restarted", poll_s=0.2)
    wait_until(lambda: httpx.get(f"{base_url}/ready", timeout=5).json()["status"] == "ready", 60,
               "/ready never said ready", poll_s=0.2)
    wait_until(lambda: httpx.post(f"{base_url}/v1/completions", timeout=30,
                                  json={"model": MODEL, "prompt": "again", "max_tokens": 4}).status_code == 200,
               60, "no completion after the restart", poll_s=0.2)

    if len(os.sched_getaffinity(0)) >= 2:  # disagg on its own CPUs: the idle prefill worker lends its CPU
        assert "--borrow-cpus" in new_decode["argv"]
        wait_until(lambda: sum(matching(samples(base_url), "splitserve_cpu_loan_events_total", instance="decode-0",
                                        event="lent")) >= 1, 30,
                   "the restarted decode worker never borrowed the idle prefill worker's CPU", poll_s=0.2)

    # SIGTERM stops every child and NATS, leaving nothing behind (within its --stop-timeout: had a service to be
    # killed at that deadline, the launcher says so, below).
    all_pids.append(new_decode["pid"])
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert not [pid for pid in all_pids if pid_alive(pid)]
    wait_until(lambda: not pid_alive(forkserver), 10, "the forkserver outlived the launcher", poll_s=0.1)
    said = proc.stdout.read()
    assert "did not stop" not in said, said  # every service stopped on SIGTERM, none had to be killed
    for log in (run_dir / "logs").glob("*.log"):  # the bus admitted every service, each within its permissions
        assert "nats refused" not in log.read_text() and "Violation" not in log.read_text(), log.name


def test_up_with_a_trace_viewer_sends_it_every_services_traces(tmp_path, default_model):
    # The viewer's command is a stand-in speaking `phoenix serve`'s settings and OTLP/HTTP (the real Phoenix is an
    # optional extra); the launcher must start it on loopback, wait for it, and point every service at it.
    viewer = tmp_path / "phoenix"
    viewer.write_text(f"#!/bin/sh\nexec {sys.executable} {ROOT / 'tests' / 'support' / 'stand_in_phoenix.py'} \"$@\"\n")
    viewer.chmod(0o755)
    viewer_port, run_dir = free_port(), tmp_path / "run"
    env = service_env(SPLITSERVE_PHOENIX=str(viewer))
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        env.pop(name, None)
    run = start_up(run_dir, "--topology", "disagg", "--max-local-prefill", "0", "--trace-viewer",
                   "--trace-viewer-port", str(viewer_port), env=env)
    try:
        said = run.proc.stdout.readline()
        assert said.strip() == f"splitserve traces: http://127.0.0.1:{viewer_port} (Arize Phoenix)", said
        assert "trace-viewer" in {s["name"] for s in ps(run_dir)["services"]}
        response = httpx.post(f"{run.url}/v1/completions", timeout=60,
                              json={"model": MODEL, "prompt": list(range(100, 180)), "max_tokens": 4})
        assert response.status_code == 200
        trace_id = response.headers["x-trace-id"]
        spans_file = run_dir / "trace-viewer" / "spans.jsonl"

        def services_seen():
            if not spans_file.exists():
                return set()
            spans = [json.loads(line) for line in spans_file.read_text().splitlines()]
            return {s["service"] for s in spans if s["trace_id"] == trace_id}

        # (each service exports its spans in batches of its own: wait for all; the kv-store's is there because
        # the prefill worker looked in it)
        wanted = {"splitserve-gateway", "splitserve-scheduler", "splitserve-decode", "splitserve-prefill",
                  "splitserve-kvstore"}
        wait_until(lambda: wanted <= services_seen(), 30, f"the viewer did not get spans of every one of {wanted}",
                   poll_s=0.2)
    finally:
        run.stop()


def test_up_api_key_reaches_the_gateway_in_its_environment_only(tmp_path, default_model):
    port, run_dir, key = free_port(), tmp_path / "run", "up-key-" + uuid.uuid4().hex
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", "up", "--model", MODEL, "--topology", "colocated",
         "--port", str(port), "--run-dir", str(run_dir), "--namespace", "ak" + uuid.uuid4().hex[:8]],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=service_env(SPLITSERVE_API_KEY=key), cwd=ROOT,
        start_new_session=True)
    try:
        line = proc.stdout.readline() + proc.stdout.readline()
        assert "splitserve ready:" in line, line
        url, body = f"http://127.0.0.1:{port}/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        assert httpx.post(url, json=body, timeout=60).status_code == 401
        assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60).status_code == 200
        services = ps(run_dir)["services"]
        assert not any(key in " ".join(s["argv"]) for s in services)  # command lines are readable by every user
        assert key not in (run_dir / "deployment.json").read_text()
        for path in [run_dir, run_dir / "deployment.json", *run_dir.rglob("*.log")]:  # the user's alone
            assert path.stat().st_mode & 0o077 == 0, (path, oct(path.stat().st_mode))
        # Only the gateway's environment holds it (the 200 above). A service forked off the preloaded spawner takes
        # its environment in memory, so /proc shows the key in no process's, the gateway's included.
        for service in services:
            with open(f"/proc/{service['pid']}/environ", "rb") as environ:
                assert key.encode() not in environ.read() or service["role"] == "gateway", service["name"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
