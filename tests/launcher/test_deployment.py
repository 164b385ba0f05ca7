"""deployment.json, the run directory lock, and `up` refusing a busy run directory."""

import json
import os
import subprocess
import sys

import pytest
from launcher_helpers import cli, free_port

from services.launcher.deployment import (
    Deployment,
    DeploymentError,
    NatsRecord,
    RunDirBusy,
    RunDirLock,
    ServiceRecord,
    default_run_dir,
    leftover_processes,
    read_deployment,
    resolve_run_dir,
    write_deployment,
)
from services.launcher.procs import process_start_time


def _deployment(run_dir, launcher_pid=None) -> Deployment:
    return Deployment(
        run_dir=str(run_dir),
        namespace="splitserve",
        topology="colocated",
        model="/models/m",
        served_model_name="m",
        gateway_url="http://127.0.0.1:8000",
        api_url="http://127.0.0.1:8000/v1",
        nats=NatsRecord(url="nats://127.0.0.1:4222", embedded=True, pid=123, log="/x/nats.log"),
        services=[
            ServiceRecord(name="scheduler-0", role="scheduler", instance_id="scheduler-0", pid=11,
                          argv=["python", "-m", "services.scheduler"], state="running"),
            ServiceRecord(name="decode-0", role="decode", instance_id="decode-0", pid=12, restarts=2,
                          state="restarting", exit_code=-9),
        ],
        state="ready",
        launcher_pid=launcher_pid,
        launcher_start_time=process_start_time(launcher_pid) if launcher_pid else None,
    )


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_deployment_json_round_trips_and_is_written_atomically(tmp_path):
    dep = _deployment(tmp_path, launcher_pid=os.getpid())
    path = write_deployment(tmp_path, dep)
    assert path == tmp_path / "deployment.json"
    assert [p.name for p in tmp_path.iterdir()] == ["deployment.json"]  # no temp file left
    back = read_deployment(tmp_path)
    assert back == dep and back.updated_at
    assert back.service("decode-0").restarts == 2 and back.nats.embedded
    raw = json.loads(path.read_text())
    assert raw["version"] == 1 and raw["services"][1]["state"] == "restarting"


def test_reading_tolerates_unknown_keys_and_reports_garbage(tmp_path):
    data = _deployment(tmp_path).to_dict()
    data["from_the_future"] = 1
    data["services"][0]["also_new"] = True
    (tmp_path / "deployment.json").write_text(json.dumps(data))
    assert read_deployment(tmp_path).services[0].name == "scheduler-0"
    (tmp_path / "deployment.json").write_text("{not json")
    with pytest.raises(DeploymentError, match="deployment.json"):
        read_deployment(tmp_path)
    assert read_deployment(tmp_path / "elsewhere") is None


def test_liveness_uses_the_pid_and_its_start_time(tmp_path):
    dep = _deployment(tmp_path, launcher_pid=os.getpid())
    assert dep.launcher_alive()
    dep.launcher_start_time += 1  # the same pid, a different process
    assert not dep.launcher_alive()
    dep.launcher_pid, dep.launcher_start_time = _dead_pid(), None
    assert not dep.launcher_alive()
    dead = _dead_pid()
    dep.services[0].pid = os.getpid()
    dep.services[1].pid = dead
    dep.nats.pid = dead
    assert leftover_processes(dep) == [("scheduler-0", os.getpid())]


def test_the_default_run_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("SPLITSERVE_RUN_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert default_run_dir() == tmp_path / ".splitserve" / "run"
    monkeypatch.setenv("SPLITSERVE_RUN_DIR", str(tmp_path / "env"))
    assert resolve_run_dir(None) == tmp_path / "env"
    assert resolve_run_dir("given") == tmp_path / "given"


def test_a_run_dir_has_one_owner(tmp_path):
    write_deployment(tmp_path, _deployment(tmp_path, launcher_pid=os.getpid()))
    with RunDirLock(tmp_path) as lock:
        assert lock.held
        with pytest.raises(RunDirBusy, match=f"already running in {tmp_path} \\(launcher pid {os.getpid()}"):
            RunDirLock(tmp_path).acquire()
    # Released: the next owner gets it.
    with RunDirLock(tmp_path):
        pass


def test_a_live_launcher_without_its_lock_file_still_owns_the_run_dir(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        write_deployment(tmp_path, _deployment(tmp_path, launcher_pid=owner.pid))
        with pytest.raises(RunDirBusy, match=f"kill {owner.pid}"):
            RunDirLock(tmp_path).acquire()
    finally:
        owner.kill()
        owner.wait()
    RunDirLock(tmp_path).acquire().release()  # a dead launcher's record does not block


def test_a_second_up_on_a_busy_run_dir_is_refused(tmp_path):
    write_deployment(tmp_path, _deployment(tmp_path, launcher_pid=os.getpid()))
    with RunDirLock(tmp_path):
        result = cli("up", "--run-dir", str(tmp_path), "--port", str(free_port()), "--model", str(tmp_path))
    assert result.returncode == 2, result.stderr
    assert "already running" in result.stderr and str(tmp_path) in result.stderr
    assert f"pid {os.getpid()}" in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""


def test_up_refuses_while_an_earlier_deployments_processes_still_run(tmp_path):
    survivor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        dep = _deployment(tmp_path, launcher_pid=_dead_pid())
        dep.services[0].pid, dep.services[0].start_time = survivor.pid, process_start_time(survivor.pid)
        dep.nats = None
        write_deployment(tmp_path, dep)
        result = cli("up", "--run-dir", str(tmp_path), "--port", str(free_port()), "--model", str(tmp_path))
    finally:
        survivor.kill()
        survivor.wait()
    assert result.returncode == 2, result.stderr
    assert f"scheduler-0 (pid {survivor.pid})" in result.stderr and "Traceback" not in result.stderr
