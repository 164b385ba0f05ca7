"""A worker moved to other CPUs at runtime through its placement file: a real engine loop in its own process
(CPU affinity and torch's thread counts are process-wide), read from outside through /proc."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from services.common.cpu_placement import Placement, placement_acked, read_ack, write_placement
from support.waiting import wait_until

needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="moving a worker needs two CPUs")

TOKENS = 600

# A worker's engine loop bound to its --cpus, following its --cpus-file, running one greedy request after another:
# it prints how many tokens the running request has, and each finished request's tokens, the placement it was on
# when each token came, and its engine thread's torch thread count at the end.
WORKER = textwrap.dedent("""
    import json, os, sys, threading, torch
    from services.common.cpus import bind_cpus
    bind_cpus((int(sys.argv[3]),))  # as `apply_engine_placement` binds a worker to its --cpus
    from services.common.cpu_follow import CpuFollower
    from services.common.engine_loop import AddRequest, EngineLoop
    from services.common.engine_thread import EngineThread
    from shared.engine import EngineConfig, LLMEngine, SamplingParams

    thread = EngineThread()
    engine = thread.submit(LLMEngine, EngineConfig(model=sys.argv[2], max_num_seqs=2)).result(300)
    follower = CpuFollower(sys.argv[1])
    tokens, generations, lock = [], [], threading.Lock()

    def emit(outputs):
        for out in outputs:
            tokens.extend(out.new_token_ids)
            generations.extend([follower.applied.generation if follower.applied else None] * len(out.new_token_ids))
            print(json.dumps({"tokens": len(tokens)}), flush=True)  # (emit runs on the engine thread)
            if out.finished:
                print(json.dumps({"done": tokens, "generations": generations,
                                  "threads": torch.get_num_threads()}), flush=True)

    loop = EngineLoop(engine, emit, thread, cpu_share=follower)
    loop.start()
    for n, line in enumerate(sys.stdin):  # one request a line
        tokens.clear(); generations.clear()
        params = SamplingParams(max_tokens=int(line), temperature=0.0, ignore_eos=True)
        loop.add(AddRequest(f"r{n}", list(range(5, 60)), params))
""")


def cpus_allowed(pid: int) -> set[str]:
    """Each thread's Cpus_allowed_list, as the kernel says."""
    lists = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                lists.add(line.split(":", 1)[1].strip())
    return lists


class Worker:
    def __init__(self, placement_file: Path, model: str, cpu: int):
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, str(placement_file), model, str(cpu)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.logs: list[str] = []  # its log lines (on stdout too)

    def request(self, max_tokens: int) -> None:
        self.proc.stdin.write(f"{max_tokens}\n")
        self.proc.stdin.flush()

    def read_until(self, key: str, at_least: int = 0) -> dict:
        while True:
            line = self.proc.stdout.readline()
            assert line, "the worker died"
            if not line.startswith("{"):
                self.logs.append(line)
                continue
            record = json.loads(line)
            if key in record and (key != "tokens" or record[key] >= at_least):
                return record


def acked(path: Path, generation: int):
    wait_until(lambda: placement_acked(path, generation) is not None, 60,
               f"no ack for generation {generation}", poll_s=0.01)
    return read_ack(path)


@needs_two_cpus
def test_a_worker_follows_its_placement_between_steps_and_its_greedy_output_stays_the_same(tmp_path, default_model):
    first, second = sorted(os.sched_getaffinity(0))[:2]
    path = tmp_path / "placements" / "decode-0.cpus"
    path.parent.mkdir()
    write_placement(path, Placement(1, (first,)))
    worker = Worker(path, default_model, first)
    try:
        assert acked(path, 1).applied  # as it starts
        assert cpus_allowed(worker.proc.pid) == {str(first)}
        worker.request(TOKENS)
        alone = worker.read_until("done")
        assert alone["threads"] == 1

        worker.request(TOKENS)
        worker.read_until("tokens", at_least=20)
        write_placement(path, Placement(2, (first, second)))
        assert acked(path, 2).applied
        assert cpus_allowed(worker.proc.pid) == {f"{first},{second}" if second != first + 1 else f"{first}-{second}"}
        moved = worker.read_until("done")
        assert moved["done"] == alone["done"]  # token-exact across the move
        assert moved["threads"] == 2  # one torch thread per CPU
        assert 1 in moved["generations"] and 2 in moved["generations"]  # it moved in the middle of the request

        write_placement(path, Placement(3, (second,)))
        assert acked(path, 3).applied
        assert cpus_allowed(worker.proc.pid) == {str(second)}
    finally:
        worker.proc.kill()
        worker.proc.wait(10)


@needs_two_cpus
def test_a_placement_naming_cpus_the_worker_may_not_use_is_refused_and_changes_nothing(tmp_path, default_model):
    first = min(os.sched_getaffinity(0))
    outside = max(os.sched_getaffinity(0)) + 1
    path = tmp_path / "decode-0.cpus"
    write_placement(path, Placement(1, (first,)))
    worker = Worker(path, default_model, first)
    try:
        acked(path, 1)
        write_placement(path, Placement(2, (first, outside)))
        ack = acked(path, 2)
        assert not ack.applied and f"CPUs {outside} are not available to this worker" in ack.error
        path.write_text("{not json")
        wait_until(lambda: read_ack(path).generation is None, 60, "no answer to a file that is no placement",
                   poll_s=0.01)
        assert "is not a CPU placement" in read_ack(path).error
        worker.request(5)
        worker.read_until("done")  # it still serves
        time.sleep(0.2)
        assert cpus_allowed(worker.proc.pid) == {str(first)}
        assert oct(path.with_name(path.name + ".ack").stat().st_mode & 0o777) == "0o600"
    finally:
        worker.proc.kill()
        worker.proc.wait(10)
    logs = "".join(worker.logs) + worker.proc.stdout.read()
    assert logs.count("CPU placement refused") == 2  # once each, though looked at many times


KERNEL_REFUSES = textwrap.dedent("""
    import json, os, sys
    from services.common.cpu_follow import CpuFollower
    from services.common.cpu_placement import Placement, read_ack, write_placement

    before = sorted(os.sched_getaffinity(0))
    follower = CpuFollower(sys.argv[1], allowed=(*before, 1023))  # a CPU this machine has not got, let through
    write_placement(sys.argv[1], Placement(1, (1023,)))
    follower.follow()
    ack = read_ack(sys.argv[1])
    print(json.dumps({"applied": ack.applied, "error": ack.error, "unchanged": sorted(os.sched_getaffinity(0)) == before,
                      "placement": follower.details()["generation"]}))
""")


def test_a_placement_the_kernel_refuses_leaves_the_worker_where_it_was(tmp_path):
    out = subprocess.run([sys.executable, "-c", KERNEL_REFUSES, str(tmp_path / "w.cpus")], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    answer = json.loads(out.strip().splitlines()[-1])
    assert answer["applied"] is False and "the kernel refused the CPUs" in answer["error"]
    assert answer["unchanged"] and answer["placement"] is None


@needs_two_cpus
def test_a_decode_worker_moves_between_requests_and_says_so_in_its_stats(tmp_path, nats_server, default_model):
    import httpx

    from support.deployment import start_deployment

    first, second = sorted(os.sched_getaffinity(0))[:2]
    path = tmp_path / "decode-0.cpus"
    write_placement(path, Placement(1, (first,)))
    deployment = start_deployment(nats_server.url, tmp_path, default_model,
                                  decode_args=("--cpus", str(first), "--cpus-file", str(path)))
    body = {"model": "splitserve-default-llama", "prompt": list(range(5, 40)), "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    try:
        before = deployment.token_ids(httpx.post(f"{deployment.api}/completions", json=body, timeout=120).json())
        write_placement(path, Placement(2, (second,)))
        assert acked(path, 2).applied
        assert cpus_allowed(deployment.procs["decode-0"].pid) == {str(second)}
        after = deployment.token_ids(httpx.post(f"{deployment.api}/completions", json=body, timeout=120).json())
        assert after == before and len(after) == 24
        placement = deployment.stats("decode-0").details["cpu_placement"]
        assert placement == {"generation": 2, "cpus": str(second), "changes": 2, "refused": 0}
    finally:
        deployment.stop()


def test_a_stage_after_the_head_refuses_a_placement_file(tmp_path, default_model):
    """It runs no engine loop to follow one between steps: it says so rather than ignore it."""
    done = subprocess.run([sys.executable, "-m", "services.stage", "--model", default_model, "--layers", "2:4",
                           "--cpus-file", str(tmp_path / "stage-1.cpus")], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "a stage after the head runs no engine loop" in done.stderr
