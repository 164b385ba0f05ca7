"""Isolation between models: model B's TTFT and ITL alone, and while model A is saturated, in one deployment.

One `splitserve up` serving two models (`--up-args`; by default A colocated on CPU 0 and B colocated on CPU 1,
the gateway, schedulers and NATS left to float). Model B gets an open-loop stream of requests (`--b-rate`
per second, `--b-requests` of them): first with A idle (solo), then while A is kept saturated by a closed loop of
`--a-concurrency` longer requests from a client process of its own. Reported: B's TTFT and ITL p50/p95/p99 in
both phases and the ratio of the p95s (issue 38's aim: at most 1.10 where the models' workers have separate
cores).

    python -m loadtest.bench_models --out loadtest/results/models_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import platform
import shlex
import tempfile
from pathlib import Path

from loadtest.bench_peer import build_workload
from services.bench.metrics import compute_metrics
from services.bench.serve import run_load
from services.bench.up_process import serving

A_NAME, B_NAME = "bench", "model-b"  # the first model is served as "bench" (services.bench.up_process.serving)


def model_dir_of(name: str) -> str:
    if name == "tiny":
        from shared.engine.default_model import default_model_dir
        return str(default_model_dir())
    from shared.engine.model_registry import resolve_model
    return str(resolve_model(name).model_dir)


def b_figures(records: list, duration_s: float) -> dict:
    figures = compute_metrics(records, duration_s)
    keep = ("completed", "failed", "ttft_ms", "itl_ms", "tpot_ms", "output_throughput")
    return {key: figures[key] for key in keep if key in figures}


def a_client(base: str, a_load: tuple, started) -> None:
    """Model A's closed loop, in a process of its own (another user's client): its streams cost B's client
    nothing, so what B measures is the deployment's doing."""
    started.set()
    asyncio.run(run_load(base, A_NAME, *a_load))


async def phase(base: str, b_load: tuple, a_load: tuple | None) -> dict:
    """B's requests, with A's closed loop running beside them (stopped once B's are done) when `a_load`."""
    a_proc = None
    if a_load:
        context = multiprocessing.get_context("spawn")
        started = context.Event()
        a_proc = context.Process(target=a_client, args=(base, a_load, started), daemon=True)
        a_proc.start()
        if not await asyncio.to_thread(started.wait, 120):
            raise RuntimeError("model A's client did not start")
    try:
        if a_proc is not None:
            await asyncio.sleep(3.0)  # A's batch is full before B's first request
        b_records, b_duration = await run_load(base, B_NAME, *b_load)
    finally:
        if a_proc is not None:
            a_proc.terminate()  # its connections close: the gateway cancels A's streams
            await asyncio.to_thread(a_proc.join, 30)
    return {"b": b_figures([record for _, record in b_records], b_duration)}


def ratio(loaded: dict, solo: dict, figure: str) -> float | None:
    before, after = (solo["b"].get(figure) or {}).get("p95"), (loaded["b"].get(figure) or {}).get("p95")
    return round(after / before, 3) if before and after else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-a", default="tiny", help="model A: a known name, a directory or a .gguf "
                        "(default: the tiny random model)")
    parser.add_argument("--model-b", default="tiny", help="model B (default: the tiny random model, served again)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--up-args", default="--topology colocated --decode 1 --cpus 0",
                        help="up's flags for model A (model B's are --b-spec)")
    parser.add_argument("--b-spec", default="topology=colocated,decode=1,cpus=1", help="model B's KEY=VALUE,...")
    parser.add_argument("--b-rate", type=float, default=2.0, help="B's requests per second (Poisson)")
    parser.add_argument("--b-requests", type=int, default=40)
    parser.add_argument("--b-input-len", type=int, default=128)
    parser.add_argument("--b-output-len", type=int, default=32)
    parser.add_argument("--a-concurrency", type=int, default=16)
    parser.add_argument("--a-input-len", type=int, default=512)
    parser.add_argument("--a-output-len", type=int, default=128)
    parser.add_argument("--out", help="the figures (JSON)")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    a_dir, b_dir = model_dir_of(args.model_a), model_dir_of(args.model_b)
    b_args, b_convs = build_workload({"num_prompts": args.b_requests, "input_len": args.b_input_len,
                                      "output_len": args.b_output_len, "request_rate": args.b_rate,
                                      "ignore_eos": True}, AutoTokenizer.from_pretrained(b_dir))
    a_args, a_convs = build_workload({"num_prompts": args.a_concurrency * 50, "input_len": args.a_input_len,
                                      "output_len": args.a_output_len, "max_concurrency": args.a_concurrency,
                                      "ignore_eos": True, "seed": 1}, AutoTokenizer.from_pretrained(a_dir))
    up_args = [*shlex.split(args.up_args), "--model", f"{b_dir}:name={B_NAME},dtype={args.dtype},{args.b_spec}"]
    with tempfile.TemporaryDirectory(prefix="splitserve-models-") as tmp:
        with serving("two-models", up_args, model_dir=a_dir, run_dir=Path(tmp) / "run",
                     dtype=args.dtype) as deployment:
            base = deployment.base_url.removesuffix("/v1")
            asyncio.run(phase(base, (b_convs[:2], b_args), None))  # warm-up
            solo = asyncio.run(phase(base, (b_convs, b_args), None))
            print(f"   B solo: {solo}", flush=True)
            loaded = asyncio.run(phase(base, (b_convs, b_args), (a_convs, a_args)))
            print(f"   B beside saturated A: {loaded}", flush=True)
    ratios = {figure: ratio(loaded, solo, figure) for figure in ("ttft_ms", "itl_ms")}
    print(f"model B's p95 under A's saturation / solo: TTFT {ratios['ttft_ms']}x, ITL {ratios['itl_ms']}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "machine": platform.platform(),
                                              "solo": solo, "loaded": loaded, "p95_ratio": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
