"""The real launcher supervising fake services (the real ones are tested end to end elsewhere).

Covers: the ready line, deployment.json and `ps` while it runs, a killed
service restarted, a second `up` refused, SIGINT/SIGTERM stopping everything,
the ready timeout and a service given up on, and a launcher killed with
SIGKILL taking its services with it.
"""

import json
import os
import signal
import socket

import pytest
from launcher_helpers import (
    cli,
    free_port,
    make_fake_model,
    make_fake_python,
    proc_alive,
    read_line,
    read_state,
    start_fake_up,
    wait_until,
)


@pytest.fixture
def fakes(tmp_path):
    return make_fake_python(tmp_path), make_fake_model(tmp_path)


def _pids(state: dict) -> list[int]:
    pids = [s["pid"] for s in state["services"] if s["pid"]]
    if state["nats"] and state["nats"]["pid"]:
        pids.append(state["nats"]["pid"])
    return pids


def _ps(run_dir) -> dict:
    result = cli("ps", "--run-dir", str(run_dir), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_up_runs_supervises_and_stops_cleanly(tmp_path, fakes):
    python, model = fakes
    run_dir, port = tmp_path / "run", free_port()
    up = start_fake_up(run_dir, port, python, model, decode=2)
    seen_pids = set()
    try:
        line = read_line(up.stdout, 20)
        assert line == f"splitserve ready: http://127.0.0.1:{port}/v1 (model fake-model, topology colocated, 2 decode workers)\n"

        state = _ps(run_dir)
        assert state["state"] == "ready" and state["launcher_pid"] == up.pid
        assert [(s["name"], s["role"], s["instance_id"], s["state"]) for s in state["services"]] == [
            ("scheduler-0", "scheduler", "scheduler-0", "running"),
            ("decode-0", "decode", "decode-0", "running"),
            ("decode-1", "decode", "decode-1", "running"),
            ("gateway-0", "gateway", "gateway-0", "running"),
        ]
        assert state["nats"]["embedded"] and state["nats"]["state"] == "running"
        seen_pids.update(_pids(state))
        gateway = state["services"][3]
        assert gateway["url"] == f"http://127.0.0.1:{port}"
        assert "--expect" in gateway["argv"] and "decode=2,scheduler=1" in gateway["argv"]
        assert gateway["argv"][gateway["argv"].index("--nats") + 1] == state["nats"]["url"]
        assert "fake gateway gateway-0" in (run_dir / "logs" / "gateway-0.log").read_text()

        # kill -9 a worker: it comes back under the same name with a new pid.
        old = state["services"][1]["pid"]
        os.kill(old, signal.SIGKILL)
        assert wait_until(lambda: (s := read_state(run_dir)["services"][1])["restarts"] == 1
                          and s["state"] == "running" and s["pid"] != old, 10)
        seen_pids.update(_pids(read_state(run_dir)))

        # kill -9 the embedded NATS: it comes back on the same URL.
        nats_pid, nats_url = state["nats"]["pid"], state["nats"]["url"]
        os.kill(nats_pid, signal.SIGKILL)
        assert wait_until(lambda: (n := read_state(run_dir)["nats"])["restarts"] == 1 and n["pid"] != nats_pid, 10)
        restarted = read_state(run_dir)["nats"]
        assert restarted["url"] == nats_url and proc_alive(restarted["pid"])
        seen_pids.add(restarted["pid"])

        # A second up on the same run directory is refused.
        second = cli("up", "--run-dir", str(run_dir), "--port", str(free_port()), "--model", model)
        assert second.returncode == 2 and "already running" in second.stderr
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(timeout=12)
    stderr = up.stderr.read()
    assert code == 0, stderr
    assert "decode-0 killed by SIGKILL; restarting" in stderr and "Traceback" not in stderr
    assert "embedded NATS server killed by SIGKILL; restarting it" in stderr
    assert up.stdout.read() == ""  # one line on stdout, ever
    assert not [pid for pid in seen_pids if proc_alive(pid)]
    final = read_state(run_dir)
    assert (run_dir / ".gitignore").read_text().endswith("*\n")
    assert final["state"] == "stopped"
    assert {s["state"] for s in final["services"]} == {"stopped"}
    assert "fake stopped" in (run_dir / "logs" / "decode-1.log").read_text()  # SIGTERM, not SIGKILL
    # The lock is free again: the next up gets as far as the port check.
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the gateway's old connections linger
        sock.bind(("127.0.0.1", port))
        sock.listen(1)
        again = cli("up", "--run-dir", str(run_dir), "--port", str(port), "--model", model)
    assert again.returncode == 2 and "already in use" in again.stderr


def test_sigint_while_starting_stops_everything(tmp_path, fakes):
    python, model = fakes
    run_dir = tmp_path / "run"
    up = start_fake_up(run_dir, free_port(), python, model, env={"FAKE_HEALTH": "503"})
    try:
        assert wait_until(lambda: (s := read_state(run_dir)) and s["nats"] and all(x["pid"] for x in s["services"]), 15)
        pids = _pids(read_state(run_dir))
    finally:
        up.send_signal(signal.SIGINT)
        code = up.wait(timeout=12)
    assert code == 0, up.stderr.read()
    assert up.stdout.read() == ""
    assert not [pid for pid in pids if proc_alive(pid)]


def test_not_ready_in_time_stops_everything_and_points_at_the_logs(tmp_path, fakes):
    python, model = fakes
    run_dir = tmp_path / "run"
    up = start_fake_up(run_dir, free_port(), python, model, ready_timeout_s=1.0, env={"FAKE_HEALTH": "503"})
    code = up.wait(timeout=20)
    stderr = up.stderr.read()
    assert code == 1
    assert "not ready within 1 s" in stderr and ": 503" in stderr and "Traceback" not in stderr
    for name in ("scheduler-0", "decode-0", "gateway-0", "nats"):
        assert str(run_dir / "logs" / f"{name}.log") in stderr
    state = read_state(run_dir)
    assert state["state"] == "failed" and "not ready" in state["message"]
    assert not [pid for pid in _pids(state) if proc_alive(pid)]


def test_a_service_that_keeps_crashing_while_starting_fails_the_deployment(tmp_path, fakes):
    python, model = fakes
    run_dir = tmp_path / "run"
    # (Without its decode worker a gateway is never ready.)
    up = start_fake_up(run_dir, free_port(), python, model,
                       env={"FAKE_CRASH": "decode", "FAKE_MAX_RESTARTS": "2", "FAKE_HEALTH": "503"})
    code = up.wait(timeout=20)
    stderr = up.stderr.read()
    assert code == 1
    assert "decode-0 keeps failing" in stderr and str(run_dir / "logs" / "decode-0.log") in stderr
    assert "fake crash" in stderr  # the log's tail
    state = read_state(run_dir)
    assert state["state"] == "failed"
    assert not [pid for pid in _pids(state) if proc_alive(pid)]


def test_a_service_that_keeps_crashing_once_serving_is_marked_failed_while_the_rest_serve(tmp_path, fakes):
    python, model = fakes
    run_dir, crash_file = tmp_path / "run", tmp_path / "crash"
    up = start_fake_up(run_dir, free_port(), python, model, decode=2,
                       env={"FAKE_CRASH_FILE": str(crash_file), "FAKE_MAX_RESTARTS": "2", "FAKE_FAILED_RETRY_S": "1"})
    try:
        assert read_line(up.stdout, 20).startswith("splitserve ready:")
        crash_file.write_text("decode")
        decode_0 = next(s for s in _ps(run_dir)["services"] if s["name"] == "decode-0")
        os.kill(decode_0["pid"], signal.SIGKILL)

        # Marked failed, with backoff; the deployment is degraded, the launcher and the other services go on.
        seen = []
        assert wait_until(lambda: seen.append(_ps(run_dir)) or seen[-1]["state"] == "degraded", 20)
        state = seen[-1]  # one snapshot: a retry may start it again any moment
        by_name = {s["name"]: s for s in state["services"]}
        assert by_name["decode-0"]["state"] == "failed" and by_name["decode-0"]["restarts"] >= 2
        assert all(by_name[n]["state"] == "running" for n in ("scheduler-0", "decode-1", "gateway-0"))
        assert up.poll() is None and proc_alive(by_name["decode-1"]["pid"])

        # Tried again after its backoff: once it starts cleanly the deployment is whole again.
        crash_file.unlink()
        assert wait_until(lambda: (s := _ps(run_dir))["state"] == "ready"
                          and {x["name"]: x["state"] for x in s["services"]}["decode-0"] == "running", 20)
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(timeout=20)
    stderr = up.stderr.read()
    assert code == 0, stderr
    assert "decode-0" in stderr and "marked failed" in stderr and "fake crash" in stderr  # with its log's tail


def test_a_launcher_killed_outright_takes_its_services_along(tmp_path, fakes):
    python, model = fakes
    run_dir = tmp_path / "run"
    up = start_fake_up(run_dir, free_port(), python, model)
    try:
        assert read_line(up.stdout, 20).startswith("splitserve ready:")
        pids = _pids(read_state(run_dir))
    finally:
        up.kill()
        up.wait()
    assert wait_until(lambda: not [pid for pid in pids if proc_alive(pid)], 5)
    state = _ps(run_dir)
    assert state["state"] == "launcher gone" and not state["launcher_alive"]
    assert {s["state"] for s in state["services"]} == {"exited"}
