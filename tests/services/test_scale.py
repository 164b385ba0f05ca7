"""`splitserve scale` on a real deployment: a decode worker added serves; removed while streams run, it drains and
hands them back, and every stream ends as an undisturbed greedy run would, nothing lost; a kv-store added takes its
share of the blocks, and one removed leaves the deployment serving as before."""

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from support.metrics import matching, samples
from support.processes import ROOT, service_env
from support.sse import stream, streamed_text
from support.up import MODEL, ps, start_up
from support.waiting import wait_until

TOKENS = 600


def splitserve(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli.main", *args], capture_output=True, text=True,
                          env=service_env(), cwd=ROOT, timeout=timeout_s)


def running_on(base_url: str, instance: str) -> float:
    return sum(matching(samples(base_url), "vllm:num_requests_running", instance=instance))


def greedy_bodies(tokens: int) -> list[dict]:
    return [{"model": MODEL, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 0}
            for prompt in ("Once upon a time", "The list of primes")]


def undisturbed(url: str, bodies: list[dict]) -> list[str]:
    """Each body's streamed text, run side by side with nothing else happening: the reference."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda body: streamed_text(stream(url, body, timeout_s=120)), bodies))


def retire_under_streams(up, bodies: list[dict], references: list[str], instance: str, counts: str) -> None:
    """Streams `bodies` side by side; once `instance` runs one of them, `splitserve scale COUNTS`, which retires it;
    every stream ends with its `references` text, no error."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        streams = [pool.submit(stream, up.url, body, timeout_s=120) for body in bodies]
        wait_until(lambda: running_on(up.url, instance) >= 1, 60, f"{instance} never ran a request", poll_s=0.2)
        result = splitserve("scale", counts, "--run-dir", str(up.run_dir))
        assert result.returncode == 0 and f"retiring {instance}" in result.stdout, (result.stdout, result.stderr)
        outcomes = [s.result(timeout=150) for s in streams]
    for events, reference in zip(outcomes, references):
        assert not [e for e in events if "error" in e], events[-3:]
        assert streamed_text(events) == reference


def scale_and_wait(run_dir, *counts: str) -> subprocess.CompletedProcess:
    return splitserve("scale", *counts, "--run-dir", str(run_dir), "--wait", "--timeout", "120", timeout_s=150)


@pytest.mark.timeout(360)
def test_a_decode_worker_added_serves_one_removed_mid_stream_loses_nothing_and_kv_stores_join_and_leave(
        tmp_path, default_model):
    # A short stop timeout: a retired worker streams on for its drain (1.5 s), then hands its streams back.
    up = start_up(tmp_path / "run", "--topology", "disagg", "--stop-timeout", "6")
    try:
        bodies = greedy_bodies(TOKENS)
        references = undisturbed(up.url, bodies)

        result = scale_and_wait(up.run_dir, "decode=2")
        assert result.returncode == 0, result.stderr
        assert "starting decode-1" in result.stdout and "settled: decode 2 ready of 2" in result.stdout
        state = ps(up.run_dir)
        assert state["pools"]["decode"] == {"desired": 2, "running": 2, "retiring": 0}
        assert httpx.get(f"{up.url}/ready", timeout=5).json()["status"] == "ready"

        # One of them runs on the new worker; remove it from under its stream.
        retire_under_streams(up, bodies, references, "decode-1", "decode=1")

        wait_until(lambda: all(s["name"] != "decode-1" for s in ps(up.run_dir)["services"]), 30,
                   "decode-1 was not retired", poll_s=0.2)
        assert ps(up.run_dir)["pools"]["decode"] == {"desired": 1, "running": 1, "retiring": 0}
        assert "decode-1 exited with code 0; retired" in (up.run_dir / "logs" / "decode-1.log").read_text()
        ready = wait_until(lambda: (r := httpx.get(f"{up.url}/ready", timeout=5).json())["status"] == "ready" and r,
                           30, "/ready did not say ready at the new size", poll_s=0.2)
        assert ready["expected"]["decode"] == 1

        # A kv-store more: it takes its share of the blocks written from then on; retired, it exits 0 and the
        # next request is served as before (its blocks are misses now).
        result = scale_and_wait(up.run_dir, "kvstore=2")
        assert result.returncode == 0 and "starting kvstore-1" in result.stdout, result.stderr
        assert ps(up.run_dir)["pools"]["kvstore"] == {"desired": 2, "running": 2, "retiring": 0}
        long_prompt = " ".join(["a story of ships and the sea"] * 60)
        asked = iter(range(1000))

        def both_hold_blocks():
            body = {"model": MODEL, "prompt": f"{next(asked)} {long_prompt}", "max_tokens": 2, "temperature": 0}
            assert not [e for e in stream(up.url, body, timeout_s=60) if "error" in e]
            found = samples(up.url)
            held = [sum(matching(found, "splitserve_kvstore_blocks", instance=name)) for name in ("kvstore-0",
                                                                                                    "kvstore-1")]
            return all(held) and held
        wait_until(both_hold_blocks, 60, "the blocks written did not go to both kv-stores", poll_s=0.5)
        result = splitserve("scale", "kvstore=1", "--run-dir", str(up.run_dir), "--wait", "--timeout", "60",
                            timeout_s=90)
        assert result.returncode == 0 and "retiring kvstore-1" in result.stdout, result.stderr
        assert ps(up.run_dir)["pools"]["kvstore"] == {"desired": 1, "running": 1, "retiring": 0}
        assert "kvstore-1 exited with code 0; retired" in (up.run_dir / "logs" / "kvstore-1.log").read_text()
        assert streamed_text(stream(up.url, bodies[0], timeout_s=120)) == references[0]
        assert up.stop() == 0
    finally:
        if up.proc.poll() is None:
            os.killpg(up.proc.pid, signal.SIGKILL)


def held_through(lines: list[str], held: dict[str, str]) -> list[dict[str, str]]:
    """Each worker's CPUs after each move the launcher recorded (`CPU handover: NAME on CPUs L` / `NAME stopped`)."""
    moments = [dict(held)]
    for line in lines:
        said = line.partition("splitserve up: CPU handover: ")[2].strip()
        name, _, rest = said.partition(" ")
        if rest.startswith("on CPUs "):
            held[name] = rest.removeprefix("on CPUs ").partition(",  borrowing")[0]
        elif rest == "stopped":
            held.pop(name)
        else:
            continue
        moments.append(dict(held))
    return moments


def threads_on(pid: int) -> set[str]:
    return {line.split(":", 1)[1].strip() for task in os.listdir(f"/proc/{pid}/task")
            for line in open(f"/proc/{pid}/task/{task}/status") if line.startswith("Cpus_allowed_list")}


@pytest.mark.timeout(180)
@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1 to share out")
def test_a_scale_hands_the_running_workers_cpus_over_never_two_workers_on_one(tmp_path, default_model):
    up = start_up(tmp_path / "run", "--topology", "colocated", "--cpus", "0,1")  # 2 workers, a CPU each
    try:
        assert {s["name"]: s.get("cpus") for s in ps(up.run_dir)["services"] if s["role"] == "decode"} == \
            {"decode-0": "0,1"}
        result = splitserve("scale", "decode=2", "--run-dir", str(up.run_dir), "--wait", "--timeout", "120",
                            timeout_s=150)
        assert result.returncode == 0, result.stderr
        services = {s["name"]: s for s in ps(up.run_dir)["services"] if s["role"] == "decode"}
        assert {n: s.get("cpus") for n, s in services.items()} == {"decode-0": "0", "decode-1": "1"}
        acks = {n: json.loads((up.run_dir / "cpus" / f"{n}.cpus.ack").read_text()) for n in services}
        assert acks["decode-0"] == {"generation": 1, "applied": True, "cpus": "0", "borrow_cpus": ""}
        assert acks["decode-1"] == {"generation": 0, "applied": True, "cpus": "1", "borrow_cpus": ""}
        assert threads_on(services["decode-0"]["pid"]) == {"0"} and threads_on(services["decode-1"]["pid"]) == {"1"}
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
        assert httpx.post(f"{up.url}/v1/completions", json=body, timeout=60).status_code == 200
        assert up.stop() == 0
        moments = held_through(up.proc.stdout.read().splitlines(), {"decode-0": "0,1"})
        assert moments[-1] == {"decode-0": "0", "decode-1": "1"}, moments
        for held in moments:  # at no recorded moment is a CPU held by two workers
            cpus = [cpu for listed in held.values() for cpu in listed.split(",")]
            assert len(cpus) == len(set(cpus)), moments
    finally:
        if up.proc.poll() is None:
            os.killpg(up.proc.pid, signal.SIGKILL)
