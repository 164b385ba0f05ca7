"""`splitserve up` errors, `serve` and `ps`, through the real CLI."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from launcher_helpers import ROOT, cli, free_port

from services.cli import serve
from services.launcher.deployment import Deployment, NatsRecord, ServiceRecord, write_deployment
from services.launcher.launch_checks import LaunchError, check_port_free
from services.launcher.launcher import Launcher
from services.launcher.up_settings import UpSettings
from services.launcher.procs import process_start_time


def test_up_on_a_port_in_use_is_a_one_line_error(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        result = cli("up", "--port", str(port), "--run-dir", str(tmp_path / "run"), "--model", str(tmp_path))
    assert result.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert result.stdout == ""
    assert not (tmp_path / "run" / "nats").exists()  # nothing was started


def test_port_checks():
    check_port_free("127.0.0.1", free_port())
    with pytest.raises(LaunchError, match="cannot listen on no-such-host.invalid"):
        check_port_free("no-such-host.invalid", 8000)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--namespace", "a.b"], "namespace 'a.b' may only contain"),
        (["--model", "/no/such/model"], "model directory /no/such/model does not exist"),
        (["--model", "no-such-model"], "unknown model 'no-such-model': not a directory, a .gguf file or a known "
                                       "model (known: smollm2-135m-instruct, splitserve-default-llama)"),
    ],
)
def test_up_reports_bad_settings_without_a_traceback(tmp_path, args, message):
    result = cli("up", "--port", str(free_port()), "--run-dir", str(tmp_path / "run"), *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_up_with_an_unreachable_nats_is_a_clear_error(tmp_path, capsys):
    options = UpSettings(run_dir=tmp_path / "run", port=free_port(), nats="nats://127.0.0.1:1", nats_connect_timeout_s=0.2)
    assert Launcher(options).run() == 2
    assert "cannot reach a NATS server at nats://127.0.0.1:1" in capsys.readouterr().err
    assert not (tmp_path / "run" / "logs").exists()


def test_up_flag_values_are_checked_by_the_parser(tmp_path):
    for args in (["--decode", "0"], ["--port", "70000"], ["--topology", "ring"], ["--ready-timeout", "-1"],
                 ["--stages", "0"], ["--microbatches", "0"]):
        result = cli("up", "--run-dir", str(tmp_path), *args)
        assert result.returncode == 2 and "Traceback" not in result.stderr, args


@pytest.mark.parametrize("args", [["--stages", "2"], ["--layer-split", "0:2,2:4"], ["--topology", "disagg", "--stages", "2"]])
def test_a_pipeline_split_without_a_pipeline_is_refused_not_ignored(tmp_path, args):
    result = cli("up", "--run-dir", str(tmp_path / "run"), "--port", str(free_port()), *args)
    assert result.returncode == 2 and "needs --topology pipeline" in result.stderr, result.stderr
    assert not (tmp_path / "run" / "logs").exists()


@pytest.mark.parametrize("args, message", [
    (["--layer-split", "0:3,2:4"], "overlaps"),
    (["--layer-split", "0:2"], "in no stage"),
    (["--stages", "9"], "at most one stage per layer"),
    (["--stages", "1"], "at least 2 stages"),
    (["--stages", "2", "--layer-split", "0:2,2:4"], "not both"),
])
def test_a_bad_pipeline_split_is_refused_before_anything_starts(tmp_path, default_model, args, message):
    result = cli("up", "--run-dir", str(tmp_path / "run"), "--port", str(free_port()), "--model", default_model,
                 "--topology", "pipeline", *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "logs").exists()  # nothing was started


def test_serve_an_unknown_service_lists_the_choices():
    result = cli("serve", "nosuch", "--nats", "nats://x:4222")
    assert result.returncode == 2
    assert "nosuch" in result.stderr
    for name in ("gateway", "scheduler", "decode"):
        assert name in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_runs_the_module_as_python_dash_m_would(tmp_path, monkeypatch, capsys):
    pkg = tmp_path / "fakesvc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(
        "import sys\n"
        "print('name', __name__, 'args', sys.argv[1:])\n"
        "if __name__ == '__main__':\n"
        "    sys.exit(7)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    with pytest.raises(SystemExit) as exit_info:
        serve.run_module("fakesvc", ["--nats", "nats://n:4222", "--help"])
    assert exit_info.value.code == 7
    assert "name __main__ args ['--nats', 'nats://n:4222', '--help']" in capsys.readouterr().out
    with pytest.raises(ModuleNotFoundError):
        serve.run_module("fakesvc_missing", [])


def test_serve_help_lists_the_services():
    result = cli("serve", "--help")
    assert result.returncode == 0 and "gateway, scheduler, decode, prefill" in result.stdout


def _written_deployment(run_dir, sleeper_pid):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    dep = Deployment(
        run_dir=str(run_dir), namespace="ns1", topology="colocated", model="/m", served_model_name="m1",
        gateway_url="http://127.0.0.1:8123", api_url="http://127.0.0.1:8123/v1",
        nats=NatsRecord(url="nats://127.0.0.1:4999", embedded=True, pid=dead.pid),
        services=[
            ServiceRecord("scheduler-0", "scheduler", "scheduler-0", pid=sleeper_pid,
                          start_time=process_start_time(sleeper_pid), state="running", model="m1"),
            ServiceRecord("decode-0", "decode", "decode-0", pid=dead.pid, restarts=3, state="restarting", cpus="2,3",
                          model="m1"),
            ServiceRecord("gateway-0", "gateway", "gateway-0", pid=dead.pid, state="running",
                          url="http://127.0.0.1:8123"),
        ],
        state="ready", launcher_pid=os.getpid(), launcher_start_time=process_start_time(os.getpid()),
    )
    write_deployment(run_dir, dep)


def test_ps_shows_each_service_with_its_live_state(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        _written_deployment(tmp_path, sleeper.pid)
        table = cli("ps", "--run-dir", str(tmp_path))
        as_json = cli("ps", "--run-dir", str(tmp_path), "--json")
    finally:
        sleeper.kill()
        sleeper.wait()
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert "ready" in lines[0] and f"launcher pid {os.getpid()}" in lines[0]
    assert "m1" in lines[1] and "ns1" in lines[1] and "http://127.0.0.1:8123/v1" in lines[1]
    assert lines[2].split() == ["NAME", "ROLE", "MODEL", "INSTANCE", "PID", "STATE", "RESTARTS", "CPUS", "URL"]
    rows = {line.split()[0]: line.split() for line in lines[3:]}
    assert rows["scheduler-0"][2:6] == ["m1", "scheduler-0", str(sleeper.pid), "running"]
    assert rows["decode-0"][2] == "m1" and rows["decode-0"][5:8] == ["restarting", "3", "2,3"]
    assert rows["gateway-0"][2] == "-"  # it serves every model
    assert rows["gateway-0"][5] == "exited" and rows["gateway-0"][7:] == ["-", "http://127.0.0.1:8123"]
    assert rows["nats"][5] == "exited" and rows["nats"][8] == "nats://127.0.0.1:4999"

    data = json.loads(as_json.stdout)
    assert data["launcher_alive"] is True and data["state"] == "ready"
    states = {s["name"]: (s["state"], s["alive"]) for s in data["services"]}
    assert states == {"scheduler-0": ("running", True), "decode-0": ("restarting", False), "gateway-0": ("exited", False)}


def test_ps_into_a_reader_that_left_is_no_error(tmp_path):
    """`splitserve ps | head`: the reader gone before the table is written is not a traceback."""
    _written_deployment(tmp_path, os.getpid())
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader left
    try:
        result = subprocess.run([sys.executable, "-m", "services.cli.main", "ps", "--run-dir", str(tmp_path)],
                                stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=30, cwd=ROOT)
    finally:
        os.close(write_end)
    assert result.returncode == 0 and "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr


def test_ps_without_a_deployment(tmp_path):
    result = cli("ps", "--run-dir", str(tmp_path))
    assert result.returncode == 1 and "no deployment" in result.stderr and "Traceback" not in result.stderr


def test_every_subcommand_is_registered():
    result = cli("--help")
    assert result.returncode == 0
    for name in ("generate", "up", "ps", "serve", "doctor", "bench", "models"):
        assert name in result.stdout


def test_up_with_a_trace_viewer_that_is_not_installed_says_how_to_get_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SPLITSERVE_PHOENIX"} | {"PATH": "/usr/bin:/bin"}
    if (Path(sys.executable).parent / "phoenix").exists():
        pytest.skip("Arize Phoenix is installed in this environment")
    result = cli("up", "--trace-viewer", "--port", str(free_port()), "--run-dir", str(tmp_path / "run"), env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "pip install 'splitserve[trace-viewer]'" in result.stderr
