"""Disagg against colocated with the services on different hosts (network namespaces, `loadtest.across_hosts`).

Each topology gets a fresh set of three hosts, a NATS server on each (one cluster):

- colocated: scheduler and gateway on a; one colocated worker on c, on both CPUs;
- disagg: scheduler and gateway on a; a prefill worker on b (CPU 0), a decode worker on c (CPU 1), the KV
  crossing from b to c over TCP.

The same workload (`splitserve bench`'s options) is sent from host a to each, and the figures (TTFT, TPOT, ITL,
E2E at p50/p95/p99, throughput) are printed side by side. Needs root (network namespaces).

    python -m loadtest.bench_across_hosts --dataset mixed --num-prompts 40 --request-rate 2 \\
        --out loadtest/results/across_hosts_cpu.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from loadtest.across_hosts import HostsDeployment
from services.bench.serve import add_workload_options, format_report, measure, resolve_tokenizer
from services.bench.datasets import build_dataset
from loadtest.netns import Hosts, netns_unavailable

GATEWAY = "http://127.0.0.1:8000"
SERVED = "bench"
PLACEMENT = {  # host -> what runs there, per topology (beside scheduler-0 and gateway-0 on a)
    "colocated": [("c", "decode", "decode-0", ["--mode", "colocated", "--cpus", "0,1"])],
    "disagg": [("b", "prefill", "prefill-0", ["--cpus", "0"]),
               ("c", "decode", "decode-0", ["--mode", "disagg", "--cpus", "1"])],
}


def deploy(deployment: HostsDeployment, topology: str, model_dir: str, dtype: str) -> None:
    model = ["--model", model_dir, "--served-model-name", SERVED]
    deployment.start_nats()
    deployment.serve("a", "scheduler", "scheduler-0")
    workers = PLACEMENT[topology]
    for host, role, instance, args in workers:
        deployment.serve(host, role, instance, *model, "--dtype", dtype, *args)
    counts = {"scheduler": 1, **{role: sum(1 for _, r, _, _ in workers if r == role) for _, role, _, _ in workers}}
    deployment.serve("a", "gateway", "gateway-0", *model, "--port", "8000",
                     "--expect", ",".join(f"{role}={n}" for role, n in counts.items()))
    deadline = time.monotonic() + 600
    while not deployment.gateway_ready(GATEWAY):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {topology} deployment across hosts was not ready in 600 s; logs in "
                               f"{deployment.dir}")
        time.sleep(1.0)
    if topology == "disagg":  # the scheduler routes by its own view: wait until it sees the prefill worker
        while not deployment.workers_seen().get("prefill"):
            time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model name, directory or .gguf")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--topologies", default="colocated,disagg")
    parser.add_argument("--out", help="the figures of both (JSON)")
    add_workload_options(parser)
    args = parser.parse_args(argv)
    reason = netns_unavailable()
    if reason is not None:
        raise SystemExit(f"cannot build hosts here: {reason}")
    from shared.engine.model_registry import resolve_model

    model_dir = str(resolve_model(args.model).model_dir)
    conversations = build_dataset(args, resolve_tokenizer(args.tokenizer, model_dir))
    args.no_progress = True
    results = {}
    for topology in [t for t in args.topologies.split(",") if t]:
        hosts = Hosts(["a", "b", "c"])
        with tempfile.TemporaryDirectory(prefix=f"across-{topology}-") as tmp:
            deployment = HostsDeployment(hosts, Path(tmp))
            try:
                deploy(deployment, topology, model_dir, args.dtype)
                results[topology] = deployment.on("a", measure, GATEWAY, SERVED, conversations, args)
            finally:
                deployment.stop()
                hosts.close()
        print(format_report(results[topology], f"{topology}, across hosts"), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "results": {
            t: {k: v for k, v in r.items() if k != "requests"} for t, r in results.items()}}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
