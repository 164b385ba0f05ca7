"""How long a deployment and a restarted worker take to serve, with the services forked off the launcher's
preloaded forkserver (`up`'s default) and each in an interpreter of its own (`--no-fork-services`), one after the
other in one run: the seconds from `splitserve up` to its ready line, the CPU seconds its processes spent to get
there (the services', and the forkserver's where there is one), and the seconds from a kill -9 of decode-0 until
the new decode-0 the supervisor starts says it is ready (the restart backoff included), with its CPU seconds.

    python -m loadtest.bench_service_start --out loadtest/results/service_start.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import statistics
import tempfile
import time
from pathlib import Path

from loadtest.bench_faults import wait_healthy, worker_pid
from loadtest.bench_gateway_cpu import cpu_seconds
from services.bench.up_process import serving
from services.launcher.procs import parent_pid
from shared.engine.model_registry import resolve_model

MODES = {"fork": "--fork-services", "exec": "--no-fork-services"}
READY = '"event": "decode ready"'  # a decode worker's log line once it serves


def deployment_cpu_s(deployment) -> float:
    """CPU seconds so far of the deployment's services, and of the forkserver they were forked off (if any)."""
    pids = {s["pid"] for s in deployment.ps()["services"] if s.get("pid")}
    parents = {parent_pid(pid) for pid in pids} - {deployment.proc.pid, None}
    return sum(cpu_seconds(pid) for pid in pids | parents)


def one_run(mode: str, up_args: list[str], model_dir: str) -> dict:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="splitserve-start-") as tmp, serving(
            f"start-{mode}", [*up_args, MODES[mode]], model_dir=model_dir, run_dir=Path(tmp) / "run",
            dtype="float32") as deployment:
        ready_s = time.monotonic() - started
        cpu_s = deployment_cpu_s(deployment)
        log = deployment.run_dir / "logs" / "decode-0.log"
        readies = log.read_text().count(READY)
        os.kill(worker_pid(deployment, "decode-0"), signal.SIGKILL)
        killed = time.monotonic()
        while log.read_text().count(READY) == readies:  # the supervisor's new decode-0 says it is ready
            if time.monotonic() - killed > 300:
                raise RuntimeError("decode-0 was not ready again within 300 s")
            time.sleep(0.05)
        restart_s = time.monotonic() - killed
        restart_cpu_s = cpu_seconds(worker_pid(deployment, "decode-0"))
        asyncio.run(wait_healthy(deployment.base_url, timeout_s=300))
    return {"mode": mode, "ready_s": round(ready_s, 2), "cpu_s_at_ready": round(cpu_s, 2),
            "restart_s": round(restart_s, 2), "restarted_worker_cpu_s": round(restart_cpu_s, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="splitserve-default-llama", help="a model name, directory or .gguf "
                        "(default: the tiny random model)")
    parser.add_argument("--up-args", default="--topology disagg --prefill 1 --decode 1")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each mode, alternating")
    parser.add_argument("--out", help="the figures (JSON)")
    args = parser.parse_args(argv)
    model_dir = str(resolve_model(args.model).model_dir)
    runs = []
    for _ in range(args.repeat):
        for mode in MODES:
            runs.append(one_run(mode, shlex.split(args.up_args), model_dir))
            print(f"   {runs[-1]}", flush=True)
    medians = {mode: {key: statistics.median(r[key] for r in runs if r["mode"] == mode)
                      for key in ("ready_s", "cpu_s_at_ready", "restart_s", "restarted_worker_cpu_s")}
               for mode in MODES}
    for mode, figures in medians.items():
        print(f"{mode}: " + ", ".join(f"{key} {value:g}" for key, value in figures.items())
              + f" (median of {args.repeat}; up {args.up_args})")
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "runs": runs, "medians": medians}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
