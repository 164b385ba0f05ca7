"""Admission control under a burst: what the admitted requests' latency is, with and without a bound.

For each `--bounds` value, one `splitserve up` deployment (`--up-args`, by default colocated with one decode
worker) is sent `--burst` streamed requests at once, each for `--max-tokens` tokens. With a bound
(`--max-waiting-requests N`) the requests past it are refused with 429 and Retry-After before anything is
queued; without one (0) every request waits its turn. Per bound: requests admitted and refused, how fast a
refusal comes, and the admitted requests' time to first token and end-to-end time (p50 and p99).

    python -m loadtest.bench_admission --model smollm2-135m-instruct --out loadtest/results/admission.json \\
        --table loadtest/results/admission.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import tempfile
import time
from pathlib import Path

import httpx

from services.bench.up_process import serving


async def one_request(client: httpx.AsyncClient, base: str, prompt: str, max_tokens: int) -> dict:
    """Status, seconds to the answer's head, to the first token and to the end (from the burst's start)."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    started = time.monotonic()
    out = {"status": None, "head_s": None, "first_token_s": None, "end_s": None, "retry_after": None}
    try:
        async with client.stream("POST", f"{base}/completions", json=body, timeout=600) as response:
            out["status"], out["head_s"] = response.status_code, time.monotonic() - started
            out["retry_after"] = response.headers.get("retry-after")
            async for line in response.aiter_lines():
                if line.startswith("data: {") and out["first_token_s"] is None:
                    out["first_token_s"] = time.monotonic() - started
        out["end_s"] = time.monotonic() - started
    except httpx.HTTPError as exc:
        out["status"] = repr(exc)
    return out


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def summarize(results: list[dict]) -> dict:
    admitted = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 429]
    return {
        "requests": len(results), "admitted": len(admitted), "refused": len(refused),
        "other": sorted({str(r["status"]) for r in results if r["status"] not in (200, 429)}),
        "refusals_with_retry_after": sum(1 for r in refused if r["retry_after"]),
        "refusal_s_p50": percentile([r["head_s"] for r in refused], 0.5),
        "refusal_s_max": percentile([r["head_s"] for r in refused], 1.0),
        "admitted_ttft_s_p50": percentile([r["first_token_s"] for r in admitted if r["first_token_s"]], 0.5),
        "admitted_ttft_s_p99": percentile([r["first_token_s"] for r in admitted if r["first_token_s"]], 0.99),
        "admitted_end_s_p50": percentile([r["end_s"] for r in admitted if r["end_s"]], 0.5),
        "admitted_end_s_p99": percentile([r["end_s"] for r in admitted if r["end_s"]], 0.99),
    }


async def burst(base: str, size: int, max_tokens: int) -> list[dict]:
    limits = httpx.Limits(max_connections=size + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        # One short warm request first: the burst should not pay for the engine's first step.
        await one_request(client, base, "Warm up:", 4)
        prompts = [f"Request {i}: tell me about the sea, the ships and the people who sail them" for i in range(size)]
        return await asyncio.gather(*(one_request(client, base, p, max_tokens) for p in prompts))


def table(runs: dict) -> str:
    lines = ["| bound (--max-waiting-requests) | admitted | refused (429, with Retry-After) | refusal time p50 / max | "
             "admitted TTFT p50 / p99 | admitted end-to-end p50 / p99 |", "|---|---|---|---|---|---|"]
    for bound, r in runs.items():
        lines.append(f"| {bound if bound != '0' else 'none (0)'} | {r['admitted']} of {r['requests']} | "
                     f"{r['refused']} ({r['refusals_with_retry_after']}) | {r['refusal_s_p50']} / {r['refusal_s_max']} s "
                     f"| {r['admitted_ttft_s_p50']} / {r['admitted_ttft_s_p99']} s | "
                     f"{r['admitted_end_s_p50']} / {r['admitted_end_s_p99']} s |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model name, directory or .gguf")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--up-args", default="--topology colocated --decode 1")
    parser.add_argument("--bounds", default="0,16", help="comma-separated --max-waiting-requests values (0: none)")
    parser.add_argument("--burst", type=int, default=128, help="requests sent at once")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", help="the figures (JSON)")
    parser.add_argument("--table", help="the markdown table")
    args = parser.parse_args(argv)
    from shared.engine.model_registry import resolve_model

    model_dir = str(resolve_model(args.model).model_dir)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="splitserve-admission-") as tmp:
        for bound in [int(x) for x in args.bounds.split(",")]:
            with serving(f"bound{bound}", [*shlex.split(args.up_args), "--max-waiting-requests", str(bound)],
                         model_dir=model_dir, run_dir=Path(tmp) / f"bound{bound}", dtype=args.dtype) as deployment:
                runs[str(bound)] = summarize(asyncio.run(burst(deployment.base_url, args.burst, args.max_tokens)))
                print(f"   {runs[str(bound)]}", flush=True)
    rendered = table(runs)
    print(rendered)
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "runs": runs}, indent=2))
    if args.table:
        Path(args.table).write_text(rendered + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
