"""`splitserve scale` against the real launcher and embedded NATS, with fake services: workers start and retire,
their NATS credentials are admitted and revoked, `ps` shows desired vs running, and only the operator may call."""

import json
import shutil
import stat
from pathlib import Path

import pytest
from launcher_helpers import cli, free_port, make_fake_model, make_fake_python, proc_alive, read_line, read_state
from launcher_helpers import start_fake_up, wait_until
from peer import call_as_nobody

from services.launcher.nats_server import admits


@pytest.fixture
def fake_up(tmp_path):
    run_dir = tmp_path / "run"
    up = start_fake_up(run_dir, free_port(), make_fake_python(tmp_path), make_fake_model(tmp_path))
    try:
        assert read_line(up.stdout, 30).startswith("splitserve ready:"), up.stderr.read() if up.poll() else ""
        yield up, run_dir
    finally:
        up.terminate()
        up.wait(30)


def ps(run_dir: Path) -> dict:
    result = cli("ps", "--run-dir", str(run_dir), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def service(state: dict, name: str) -> dict | None:
    return next((s for s in state["services"] if s["name"] == name), None)


def test_scale_up_and_down_admits_and_revokes_the_workers(fake_up, tmp_path):
    up, run_dir = fake_up
    state = read_state(run_dir)
    sock, nats_url = state["control_socket"], state["nats"]["url"]
    assert stat.S_IMODE(Path(sock).stat().st_mode) == 0o600 and state["desired"] == {"decode": 1}

    result = cli("scale", "decode=2", "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    assert "starting decode-1; retiring none" in result.stdout
    assert wait_until(lambda: (s := service(ps(run_dir), "decode-1")) and s["state"] == "running", 10, 0.2)
    state = ps(run_dir)
    assert state["pools"] == {"decode": {"desired": 2, "running": 2, "retiring": 0}}
    assert "pools (running/desired): decode 2/2" in cli("ps", "--run-dir", str(run_dir)).stdout
    creds = run_dir / "creds" / "decode-1.nk"
    assert admits(nats_url, creds)  # the embedded server took the new instance's key before it started
    kept = shutil.copy(creds, tmp_path / "decode-1.nk")
    pid = service(state, "decode-1")["pid"]

    result = cli("scale", "decode=1", "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    assert "starting none; retiring decode-1" in result.stdout
    assert wait_until(lambda: service(ps(run_dir), "decode-1") is None, 15, 0.2)
    assert not proc_alive(pid) and up.poll() is None
    assert ps(run_dir)["pools"] == {"decode": {"desired": 1, "running": 1, "retiring": 0}}
    assert not creds.exists()
    assert wait_until(lambda: not admits(nats_url, kept), 5, 0.2)  # its key no longer lets anyone in


def test_what_cannot_scale_is_refused_and_so_is_another_user(fake_up, tmp_path):
    up, run_dir = fake_up
    for args, said in ((["stage=2"], "stage workers do not scale on their own: a pipeline deployment scales whole pipelines"),
                       (["prefill=2"], "--topology colocated has no prefill pool"),
                       (["decode=0"], "at least 1"), (["decode"], "is not ROLE=N")):
        result = cli("scale", *args, "--run-dir", str(run_dir))
        assert result.returncode == 2 and said in result.stderr, (args, result.stderr)
    result = cli("scale", "decode=2", "--run-dir", str(tmp_path / "elsewhere"))
    assert result.returncode == 1 and "no deployment is running" in result.stderr
    sock = read_state(run_dir)["control_socket"]
    assert call_as_nobody(sock) == "errno EACCES"
    assert read_state(run_dir)["desired"] == {"decode": 1}
