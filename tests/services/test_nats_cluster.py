"""`splitserve up --nats-cluster 3`: three NATS servers clustered, every stream and bucket on all three, and the
loss of any one of them under streaming load costs no request."""

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from support.jetstream import all_current, stream_replicas
from support.processes import ROOT, service_env
from support.sse import stream, streamed_text
from support.up import MODEL, ps, start_up
from support.waiting import wait_until


def admin_creds(nats_state: dict) -> None:
    """The embedded deployment's admin key stays in its launcher: these tests watch an open bus."""
    assert nats_state["creds_dir"] is None
    return None


@pytest.mark.timeout(300)
def test_a_three_node_cluster_keeps_three_copies_and_a_nodes_loss_costs_no_request(tmp_path, default_model):
    run = start_up(tmp_path / "run", "--nats-cluster", "3", "--no-nats-auth")
    try:
        state = ps(run.run_dir)
        nodes = [("nats-0", state["nats"]["pid"]), *((n["name"], n["pid"]) for n in state["nats"]["nodes"])]
        assert [name for name, _ in nodes] == ["nats-0", "nats-1", "nats-2"]
        assert len(state["nats"]["url"].split(",")) == 3  # every service is given every server
        gateway = next(s for s in state["services"] if s["role"] == "gateway")
        assert gateway["argv"][gateway["argv"].index("--nats") + 1] == state["nats"]["url"]
        # The request and prefill queues and the registry's bucket: each on all three nodes.
        replicas = stream_replicas(state["nats"]["url"], admin_creds(state["nats"]))
        assert {name.removeprefix(run.namespace + "-").removeprefix("KV_" + run.namespace + "-")
                for name in replicas} >= {"requests", "prefill", "registry"}, replicas
        assert {r for r, _ in replicas.values()} == {3}, replicas

        # Long enough to stream well past a node's loss (killed at the 50th chunk) and the reconnects it causes.
        body = {"model": MODEL, "prompt": "A story about the sea", "max_tokens": 600, "ignore_eos": True,
                "temperature": 0}
        reference = streamed_text(stream(run.url, body))
        # Each node in turn is killed under six streams (the launcher starts it again, on its port): the
        # services on it reconnect to another, the streams whose leader it held elect another.
        for name, _ in nodes:
            pid = next(n["pid"] for n in [state["nats"], *state["nats"]["nodes"]]
                       if n.get("name", "nats-0") == name)
            killed = []
            with ThreadPoolExecutor(7) as pool:
                def kill_the_node(events, pid=pid):
                    if len(events) == 50 and not killed:
                        os.kill(pid, signal.SIGKILL)
                        # A request submitted at once: its queue may have lost its leader with the node.
                        killed.append(pool.submit(stream, run.url, {**body, "max_tokens": 16}))

                streams = [pool.submit(stream, run.url, body, kill_the_node if i == 0 else lambda events: None)
                           for i in range(6)]
                results = [s.result(timeout=240) for s in streams]
                assert killed, f"the streams ended before {name} could be killed"
                results.append(killed[0].result(timeout=60))
            errors = [e for events in results for e in events if "error" in e]
            assert not errors, (name, errors[:3])
            assert streamed_text(results[-1]), name
            assert [streamed_text(events) for events in results[:6]] == [reference] * 6, name
            # Back, and current again in every stream, before the next node goes.
            state = wait_until(lambda: (lambda s: s if all(n["state"] == "running" for n in s["nats"]["nodes"])
                                        and s["nats"]["state"] == "running" else None)(ps(run.run_dir)),
                               60, f"{name} was not started again", poll_s=0.5)
            wait_until(lambda: all_current(state["nats"]["url"], admin_creds(state["nats"])), 60,
                       f"the streams did not get {name} back as a current replica", poll_s=0.5)
        assert run.stop() == 0
        assert "did not stop" not in run.proc.stdout.read()
        assert not [pid for _, pid in nodes if os.path.exists(f"/proc/{pid}") and
                    open(f"/proc/{pid}/stat").read().split()[2] != "Z"]
    finally:
        run.stop(timeout_s=30)


def test_replicas_the_cluster_cannot_hold_are_refused_before_anything_starts(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "up", "--model", MODEL, "--nats-cluster", "2",
         "--nats-replicas", "3", "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, env=service_env(), cwd=ROOT, timeout=60)
    assert result.returncode == 2
    assert "--nats-replicas 3 needs a NATS cluster of 3 nodes or more; this one has 2" in result.stdout + result.stderr
