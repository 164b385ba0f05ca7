"""Pipeline benchmark: throughput and TPOT with 1, 2 and 4 stages against the micro-batches in flight.

For each stage count p and micro-batch count m, one `splitserve up` deployment
(p = 1: `--topology colocated --decode 1`; p > 1: `--topology pipeline
--stages p --microbatches m`), each worker process pinned to one core
(round-robin over --cores, every thread of it, OMP_NUM_THREADS=1), serves the
same closed-loop load: --requests streaming completions of --prompt-tokens
random token ids and --max-tokens output tokens (`ignore_eos`, greedy),
--concurrency at a time. Measured: output tokens/s over the load's wall time,
TPOT per request ((e2e - TTFT) / (tokens - 1), p50/p95), and from the
gateway's /metrics, before and after the load, each stage's busy and idle
seconds (idle = waiting for input between steps, gaps up to 1 s) and the
activation bytes the stages sent on. The measured bubble (idle / (busy +
idle), averaged over the stages) sits beside the (p-1)/(m+p-1) estimate of a
pipeline whose stages take equal time.

    python -m loadtest.bench_pipeline --preset 100m --output loadtest/results/pipeline_cpu_100m.json
    python -m loadtest.bench_pipeline --preset tiny --stages 1,2 --microbatches 1,2 --requests 4   # quick check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtest.bench_interference import prepare_model, send_request
from services.bench.up_process import UpProcess, fetch_metrics, write_deployment_results

RESULT_KEYS = ("machine", "model", "settings", "runs")
RUN_KEYS = ("stages", "microbatches", "ok", "output_tokens_per_s", "tpot_ms", "ttft_ms", "bubble_measured",
            "bubble_estimate", "activation_bytes_per_token", "stage_metrics")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=("tiny", "100m"), default="100m",
                        help="tiny: splitserve's default model; 100m: bench_engine's ~100M-parameter random llama")
    parser.add_argument("--model", help="a local model directory instead of the preset")
    parser.add_argument("--stages", default="1,2,4", help="comma-separated stage counts")
    parser.add_argument("--microbatches", default="1,2,4", help="comma-separated micro-batch counts (for p > 1)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--cores", default=None, help="cores to pin workers to, e.g. 0,1 (default: all)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--stop-timeout", type=float, default=30.0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--run-dir-root", help="where the deployments' run dirs go (default: a temp dir)")
    parser.add_argument("--output", help="write the results as JSON here")
    return parser


def bubble_estimate(stages: int, microbatches: int) -> float:
    return (stages - 1) / (microbatches + stages - 1)


def per_stage(before: dict[str, float], after: dict[str, float]) -> dict[str, dict[str, float]]:
    """{instance: {busy_s, idle_s, activation_bytes}} over the load (after - before)."""
    stages: dict[str, dict[str, float]] = {}
    for name, value in after.items():
        metric, _, labels = name.partition("{")
        fields = dict(item.split("=", 1) for item in labels.rstrip("}").split(",") if "=" in item)
        instance = fields.get('instance', '').strip('"')
        delta = value - before.get(name, 0.0)
        entry = stages.setdefault(instance, {"busy_s": 0.0, "idle_s": 0.0, "activation_bytes": 0.0})
        if metric == "splitserve_pipeline_stage_busy_seconds_total":
            entry["busy_s"] += delta
        elif metric == "splitserve_pipeline_stage_idle_seconds_total":
            entry["idle_s"] += delta
        elif metric == "splitserve_pipeline_activation_bytes_total":
            entry["activation_bytes"] += delta
    return {k: v for k, v in stages.items() if k and (v["busy_s"] or v["activation_bytes"])}


async def run_load(base_url: str, model_name: str, prompts: list[list[int]], args) -> list[dict[str, Any]]:
    import httpx

    limits = httpx.Limits(max_connections=args.concurrency + 4)
    options = argparse.Namespace(long_max_tokens=args.max_tokens, short_max_tokens=args.max_tokens)
    queue: asyncio.Queue = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    records: list[dict[str, Any]] = []
    origin = time.perf_counter()

    async with httpx.AsyncClient(base_url=base_url, timeout=args.request_timeout, limits=limits) as client:
        async def worker():
            while not queue.empty():
                prompt = queue.get_nowait()
                records.append(await send_request(client, model_name, {"kind": "long", "prompt": prompt}, options,
                                                  None, origin))

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return records


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in records if r["error"] is None and r["chunks"]]
    if not done:
        return {"completed": 0, "failed": len(records), "errors": [r["error"] for r in records][:3]}
    start = min(r["sent"] for r in done)
    end = max(r["end"] for r in done)
    tokens = sum(r["tokens"] for r in done)
    ttft = [1e3 * (r["chunks"][0] - r["sent"]) for r in done]
    tpot = [1e3 * (r["end"] - r["chunks"][0]) / (r["tokens"] - 1) for r in done if r["tokens"] > 1]

    def pct(values, q):
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]

    return {"completed": len(done), "failed": len(records) - len(done), "output_tokens": tokens,
            "wall_s": end - start, "output_tokens_per_s": tokens / (end - start),
            "ttft_ms": {"p50": pct(ttft, 50), "p95": pct(ttft, 95)},
            "tpot_ms": {"p50": pct(tpot, 50), "p95": pct(tpot, 95), "mean": statistics.fmean(tpot)}}


def run_one(stages: int, microbatches: int, args, model_dir: str, prompts, run_root: Path) -> dict[str, Any]:
    flags = (["--topology", "colocated", "--decode", "1"] if stages == 1 else
             ["--topology", "pipeline", "--stages", str(stages), "--microbatches", str(microbatches)])
    label = f"p{stages}-m{microbatches}"
    dep = UpProcess(label, flags, model_dir=model_dir, served_name="bench", run_dir=run_root / label,
                    dtype=args.dtype, worker_threads=1, ready_timeout_s=args.ready_timeout,
                    stop_timeout_s=args.stop_timeout)
    result: dict[str, Any] = {"stages": stages, "microbatches": microbatches, "ok": False, "command": dep.cmd}
    print(f"\n== {stages} stage(s), {microbatches} micro-batch(es)", flush=True)
    try:
        dep.start()
        dep.wait_ready(args.ready_timeout + 30)
        result["pinned"] = dep.pin_workers(("decode", "stage"), args.cores)
        warm = asyncio.run(run_load(dep.base_url, "bench", prompts[:2], argparse.Namespace(**{**vars(args), "concurrency": 2})))
        if any(r["error"] for r in warm):
            raise RuntimeError(f"warm-up failed: {[r['error'] for r in warm if r['error']][0]}")
        before = fetch_metrics(dep.base_url, "splitserve_pipeline_")  # every stage's counters as of now
        records = asyncio.run(run_load(dep.base_url, "bench", prompts, args))
        after = fetch_metrics(dep.base_url, "splitserve_pipeline_")
        summary = summarize(records)
        result.update(summary)
        stage_metrics = per_stage(before, after)
        result["stage_metrics"] = stage_metrics
        fractions = [m["idle_s"] / (m["busy_s"] + m["idle_s"]) for m in stage_metrics.values()
                     if m["busy_s"] + m["idle_s"] > 0]
        result["bubble_measured"] = statistics.fmean(fractions) if fractions and stages > 1 else None
        result["bubble_estimate"] = bubble_estimate(stages, microbatches)
        processed = summary.get("output_tokens", 0) + summary.get("completed", 0) * args.prompt_tokens
        moved = sum(m["activation_bytes"] for m in stage_metrics.values())
        result["activation_bytes_per_token"] = moved / processed if processed and stages > 1 else 0.0
        result["ok"] = summary.get("completed", 0) == len(prompts)
        print(f"   {summary.get('output_tokens_per_s', 0):.1f} output tokens/s, TPOT p50 "
              f"{summary.get('tpot_ms', {}).get('p50', float('nan')):.1f} ms, bubble measured "
              f"{result['bubble_measured'] if result['bubble_measured'] is None else round(result['bubble_measured'], 3)}"
              f" vs estimate {result['bubble_estimate']:.3f}", flush=True)
    except Exception as exc:  # noqa: BLE001 -- recorded; the next configuration still runs
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(f"   failed: {result['error']}", flush=True)
    finally:
        result["teardown"] = dep.stop()
    for key in RUN_KEYS:
        result.setdefault(key, None)
    return result


def format_table(runs: list[dict[str, Any]]) -> str:
    lines = ["| stages | micro-batches | output tok/s | TPOT p50 ms | TPOT p95 ms | bubble measured | (p-1)/(m+p-1) "
             "| activation bytes/token |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if not r["ok"]:
            lines.append(f"| {r['stages']} | {r['microbatches']} | failed: {r.get('error')} |||||")
            continue
        bubble = "-" if r["bubble_measured"] is None else f"{r['bubble_measured']:.2f}"
        lines.append(f"| {r['stages']} | {r['microbatches']} | {r['output_tokens_per_s']:.1f} | "
                     f"{r['tpot_ms']['p50']:.1f} | {r['tpot_ms']['p95']:.1f} | {bubble} | "
                     f"{r['bubble_estimate']:.2f} | {r['activation_bytes_per_token']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.cores = ([int(c) for c in args.cores.split(",")] if args.cores else sorted(os.sched_getaffinity(0)))
    stage_counts = [int(v) for v in args.stages.split(",")]
    micro_counts = [int(v) for v in args.microbatches.split(",")]
    model_dir = prepare_model(argparse.Namespace(model=args.model, preset=args.preset))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, config["vocab_size"]) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    run_root = Path(args.run_dir_root or tempfile.mkdtemp(prefix="bench-pipeline-"))
    runs = []
    for stages in stage_counts:
        for microbatches in ([1] if stages == 1 else micro_counts):
            runs.append(run_one(stages, microbatches, args, model_dir, prompts, run_root))
    write_deployment_results(args, model_dir, config, runs, format_table(runs))
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
