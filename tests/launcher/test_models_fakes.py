"""`splitserve models serve|unserve|served` against the real launcher and embedded NATS, with fake services (which
never register): a model served gets its own namespace's credentials, and the gateway's key that namespace too;
when its services do not register ready within the deadline, it is undone (its services retired, their keys and
the gateway's access revoked) and listed as failed. The first model is not unserved, bad specs are refused, and
only the operator may call."""

import json
from pathlib import Path

import pytest
from launcher_helpers import cli, free_port, make_fake_model, make_fake_python, read_line, read_state
from launcher_helpers import start_fake_up, wait_until
from peer import call_as_nobody

from services.launcher.nats_server import admits

READY_TIMEOUT_S = 6.0  # up's --ready-timeout: also how long a model served has to register


@pytest.fixture
def fake_up(tmp_path):
    run_dir = tmp_path / "run"
    up = start_fake_up(run_dir, free_port(), make_fake_python(tmp_path), make_fake_model(tmp_path),
                       ready_timeout_s=READY_TIMEOUT_S)
    try:
        assert read_line(up.stdout, 30).startswith("splitserve ready:"), up.stderr.read() if up.poll() else ""
        yield up, run_dir
    finally:
        up.terminate()
        up.wait(30)


def served(run_dir: Path) -> dict:
    result = cli("models", "served", "--run-dir", str(run_dir), "--json")
    assert result.returncode == 0, result.stderr
    return {m["name"]: m for m in json.loads(result.stdout)["models"]}


def another_model(tmp_path: Path) -> str:
    (tmp_path / "b").mkdir()
    return make_fake_model(tmp_path / "b")


def gateway_subscribes(run_dir: Path) -> list[str]:
    """The gateway user's subscribe permissions in the embedded server's config now."""
    config = json.loads((run_dir / "nats.conf").read_text())
    keys = {u["nkey"]: u["permissions"] for u in config["authorization"]["users"]}
    from services.launcher.nats_auth import public_key

    return keys[public_key((run_dir / "creds" / "gateway-0.nk").read_bytes())]["subscribe"]["allow"]


def test_a_model_served_is_admitted_in_its_namespace_and_undone_when_it_never_registers(fake_up, tmp_path):
    up, run_dir = fake_up
    first, namespace = read_state(run_dir)["served_model_name"], read_state(run_dir)["namespace"]
    assert served(run_dir)[first] | {"ready": None} == {
        "name": first, "namespace": namespace, "model": read_state(run_dir)["model"], "prefix": "", "state": "serving",
        "desired": {"decode": 1}, "error": None, "first": True, "ready": None}
    model = another_model(tmp_path)

    result = cli("models", "serve", "b", "--model", model, "topology=colocated", "decode=2", "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    b_namespace = f"{namespace}-b"
    assert result.stdout.startswith(f"serving b in namespace {b_namespace}: starting m1-scheduler-0, m1-decode-0, "
                                    "m1-decode-1")
    nats_url = read_state(run_dir)["nats"]["url"]
    creds = run_dir / "creds" / "m1-decode-0.nk"
    assert admits(nats_url, creds)  # admitted before it started
    assert f"{b_namespace}.tokens.gateway-0.*.*.*" in gateway_subscribes(run_dir)
    listed = served(run_dir)["b"]
    assert (listed["state"], listed["namespace"], listed["prefix"]) == ("starting", b_namespace, "m1-")
    ps = json.loads(cli("ps", "--run-dir", str(run_dir), "--json").stdout)
    assert {s["name"]: s["model"] for s in ps["services"] if s["name"].startswith("m1-")} == {
        "m1-scheduler-0": "b", "m1-decode-0": "b", "m1-decode-1": "b"}
    kept = tmp_path / "kept.nk"
    kept.write_bytes(creds.read_bytes())

    # The fakes never register: at the deadline the serve is undone.
    assert wait_until(lambda: served(run_dir).get("b", {}).get("state") == "failed", READY_TIMEOUT_S + 20, 0.2)
    error = served(run_dir)["b"]["error"]
    assert f"its services were not registered ready in {b_namespace} within {READY_TIMEOUT_S:g} s" in error, error
    assert "scheduler (1 more)" in error and "decode (1 more)" in error
    assert not any(s["name"].startswith("m1-") for s in json.loads(cli("ps", "--run-dir", str(run_dir),
                                                                       "--json").stdout)["services"])
    assert not creds.exists()
    assert wait_until(lambda: not admits(nats_url, kept), 5, 0.2)  # its key no longer lets anyone in
    assert not any(s.startswith(f"{b_namespace}.") for s in gateway_subscribes(run_dir))
    table = cli("models", "served", "--run-dir", str(run_dir))
    assert "b: its services were not registered ready" in table.stdout
    assert up.poll() is None


def test_what_cannot_be_served_or_unserved_is_refused_and_so_is_another_user(fake_up, tmp_path):
    up, run_dir = fake_up
    first = read_state(run_dir)["served_model_name"]
    model = another_model(tmp_path)
    for args, said in (
            (["unserve", first], "the deployment's first model cannot be unserved; stop the deployment"),
            (["unserve", "nope"], "no model is served as 'nope'"),
            (["serve", "b", "--model", model, "colour=red"], "unknown key 'colour'"),
            (["serve", "b", "--model", model, "decode=0"], "decode: Input should be greater than or equal to 1"),
            (["serve", "b", "--model", model, "name=c"], "the served name is NAME"),
            (["serve", first, "--model", model], f"a model is served as {first!r} already"),
            (["serve", "b", "--model", str(tmp_path / "absent")], "absent"),
            (["serve", "b", "--model", model, "topology=colocated", "stages=2"], "--stages splits a pipeline's layers")):
        result = cli("models", *args, "--run-dir", str(run_dir))
        assert result.returncode == 2 and said in result.stderr, (args, result.stderr)
    result = cli("scale", "--model", "nope", "decode=2", "--run-dir", str(run_dir))
    assert result.returncode == 2 and "no model is served as 'nope'" in result.stderr
    assert list(served(run_dir)) == [first]  # nothing changed

    sock = read_state(run_dir)["control_socket"]  # (its peer check: tests/launcher/test_control_socket.py)
    for request in ("POST /v1/models", f"DELETE /v1/models/{first}", "GET /v1/models"):
        assert call_as_nobody(sock, request=request) == "errno EACCES"
    assert list(served(run_dir)) == [first]
