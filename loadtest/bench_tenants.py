"""Fairness between tenants: a quiet tenant's time to first token, alone and beside a tenant sending 8× its load.

One `splitserve up` (`--up-args`, by default colocated with one decode worker) with two tenants' keys. The quiet
tenant sends a streamed request every 1/`--quiet-rps` seconds for `--seconds`; first alone (solo), then with the
noisy tenant sending `--noise`× as many at the same time, each tenant's client a process of its own. Reported: the quiet tenant's TTFT p50/p95 solo and
under noise, the ratio of the p95s (the aim: at most 1.25), the noisy tenant's outcomes, and each tenant's ITL
p50/p95 (the gaps between a stream's events, all streams together). `--fifo` runs the
noisy phase once more on a deployment first come first served throughout (no fair queue at the gateway,
`--max-dispatched 0`, and workers taking requests by arrival, `--scheduling-policy fcfs`); `--gate-only` once more
with the gateway's fair queue but workers by arrival, to see what each part does.

    python -m loadtest.bench_tenants --out loadtest/results/tenants.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import shlex
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx

from loadtest.bench_admission import percentile
from services.bench.up_process import serving

KEYS = {"quiet": "bench-quiet-key", "noisy": "bench-noisy-key"}


async def one_request(client: httpx.AsyncClient, base: str, key: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    started, out = time.monotonic(), {"status": None, "ttft_s": None, "itl_s": []}
    last = None
    try:
        async with client.stream("POST", f"{base}/completions", json=body, timeout=300,
                                 headers={"Authorization": f"Bearer {key}"}) as response:
            out["status"] = response.status_code
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    now = time.monotonic()
                    if out["ttft_s"] is None:
                        out["ttft_s"] = now - started
                    else:
                        out["itl_s"].append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        out["status"] = repr(exc)
    return out


async def tenant_load(client, base: str, tenant: str, rps: float, seconds: float, max_tokens: int) -> list[dict]:
    """Open loop: a request every 1/rps seconds, whatever the answers do."""
    tasks, start, i = [], time.monotonic(), 0
    while (due := start + i / rps) < start + seconds:
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        prompt = f"{tenant} request {i}: tell me about the sea, the ships and the people who sail them"
        tasks.append(asyncio.create_task(one_request(client, base, KEYS[tenant], prompt, max_tokens)))
        i += 1
    return list(await asyncio.gather(*tasks))


def summary(results: list[dict]) -> dict:
    ttfts = [r["ttft_s"] for r in results if r["status"] == 200 and r["ttft_s"] is not None]
    gaps = [gap for r in results if r["status"] == 200 for gap in r["itl_s"]]  # between a stream's events
    return {"requests": len(results), "ok": len(ttfts), "refused_429": sum(r["status"] == 429 for r in results),
            "ttft_s_p50": percentile(ttfts, 0.5), "ttft_s_p95": percentile(ttfts, 0.95),
            "itl_ms_p50": _ms(percentile(gaps, 0.5)), "itl_ms_p95": _ms(percentile(gaps, 0.95))}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


async def client_load(base: str, tenant: str, rps: float, seconds: float, max_tokens: int, start_at: float) -> list[dict]:
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        return await tenant_load(client, base, tenant, rps, seconds, max_tokens)


def run_client(base: str, tenant: str, rps: float, seconds: float, max_tokens: int, start_at: float) -> list[dict]:
    """One tenant's client, in a process of its own (as tenants' clients are): the noisy one's hundreds of streams
    cost the quiet one's client nothing, so what the quiet one measures is the deployment's doing."""
    return asyncio.run(client_load(base, tenant, rps, seconds, max_tokens, start_at))


def phase(base: str, args, noisy: bool) -> dict:
    async def warm_up() -> None:
        async with httpx.AsyncClient() as client:
            await one_request(client, base, KEYS["quiet"], "Warm up:", 4)

    asyncio.run(warm_up())
    tenants = [("quiet", args.quiet_rps)] + ([("noisy", args.quiet_rps * args.noise)] if noisy else [])
    start_at = time.time() + 2.0  # both clients started and ready before the first request
    with ProcessPoolExecutor(len(tenants), mp_context=multiprocessing.get_context("spawn")) as pool:
        loads = [pool.submit(run_client, base, tenant, rps, args.seconds, args.max_tokens, start_at)
                 for tenant, rps in tenants]
        results = [load.result(timeout=args.seconds + 600) for load in loads]
    return {tenant: summary(result) for (tenant, _), result in zip(tenants, results)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="splitserve-default-llama", help="a model name, directory or .gguf "
                        "(default: the tiny random model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--up-args", default="--topology colocated --decode 1")
    parser.add_argument("--quiet-rps", type=float, default=2.0)
    parser.add_argument("--noise", type=float, default=8.0, help="the noisy tenant's load, times the quiet one's")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--fifo", action="store_true", help="also run the noisy phase first come first served")
    parser.add_argument("--gate-only", action="store_true", help="also run it with the gateway's fair queue and "
                        "workers first come first served")
    parser.add_argument("--out", help="the figures (JSON)")
    args = parser.parse_args(argv)
    if args.model == "splitserve-default-llama":
        from shared.engine.default_model import default_model_dir
        model_dir = str(default_model_dir())
    else:
        from shared.engine.model_registry import resolve_model
        model_dir = str(resolve_model(args.model).model_dir)
    keys = [a for tenant, key in KEYS.items() for a in ("--api-key", f"{key}:{tenant}")]
    runs = {}
    with tempfile.TemporaryDirectory(prefix="splitserve-tenants-") as tmp:
        fcfs = ["--scheduling-policy", "fcfs"]
        variants = ([("fair", [])] + ([("gate_only", fcfs)] if args.gate_only else [])
                    + ([("fifo", ["--max-dispatched", "0", *fcfs])] if args.fifo else []))
        for name, extra in variants:
            with serving(name, [*shlex.split(args.up_args), *keys, *extra], model_dir=model_dir,
                         run_dir=Path(tmp) / name, dtype=args.dtype) as deployment:
                if name == "fair":
                    runs["solo"] = phase(deployment.base_url, args, noisy=False)
                    print(f"   solo: {runs['solo']}", flush=True)
                runs[name] = phase(deployment.base_url, args, noisy=True)
                print(f"   {name}: {runs[name]}", flush=True)
    solo = runs["solo"]["quiet"]["ttft_s_p95"]
    ratios = {name: round(runs[name]["quiet"]["ttft_s_p95"] / solo, 2) for name in ("fair", "gate_only", "fifo")
              if name in runs}
    print(f"quiet p95 TTFT solo {solo} s; under {args.noise:g}x noise: "
          + ", ".join(f"{n} {runs[n]['quiet']['ttft_s_p95']} s ({r}x)" for n, r in ratios.items()))
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "runs": runs, "p95_ratio": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
