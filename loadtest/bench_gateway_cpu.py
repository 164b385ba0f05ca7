"""What the gateway's CPU costs per streamed token: `--requests` streamed completions, `--concurrency` in flight, on
one `splitserve up` (`--up-args`, by default colocated with one decode worker and the tiny random model), and the
gateway process's CPU seconds (user + system, from /proc) over them, per SSE event sent. The gateway turns every
token into an SSE event on its event loop; at a few hundred open streams on a small machine that loop is what a
client waits on (bench_tenants' noisy phase), so its cost per event is worth keeping in sight.

    python -m loadtest.bench_gateway_cpu --out loadtest/results/gateway_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from loadtest.bench_faults import worker_pid
from services.bench.up_process import serving
from shared.engine.model_registry import resolve_model


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of the process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_stream(client: httpx.AsyncClient, base: str, i: int, max_tokens: int) -> int:
    """The SSE events with a chunk (not [DONE]) the request's stream carried."""
    body = {"model": "bench", "prompt": f"request {i}: tell me about the sea", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    events = 0
    async with client.stream("POST", f"{base}/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            events += line.startswith("data: {")
    return events


async def streams(base: str, requests: int, concurrency: int, max_tokens: int) -> int:
    slots = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 8)) as client:
        async def run(i: int) -> int:
            async with slots:
                return await one_stream(client, base, i, max_tokens)

        return sum(await asyncio.gather(*(run(i) for i in range(requests))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="splitserve-default-llama", help="a model name, directory or .gguf "
                        "(default: the tiny random model)")
    parser.add_argument("--up-args", default="--topology colocated --decode 1")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=2, help="measured runs on the one deployment")
    parser.add_argument("--out", help="the figures (JSON)")
    args = parser.parse_args(argv)
    model_dir = str(resolve_model(args.model).model_dir)
    runs = []
    with tempfile.TemporaryDirectory(prefix="splitserve-gateway-cpu-") as tmp, serving(
            "gateway-cpu", shlex.split(args.up_args), model_dir=model_dir, run_dir=Path(tmp) / "run",
            dtype="float32") as deployment:
        gateway = worker_pid(deployment, "gateway-0")
        asyncio.run(streams(deployment.base_url, 4, 4, 4))  # warm: the first requests' one-time costs
        for _ in range(args.repeat):
            cpu, started = cpu_seconds(gateway), time.monotonic()
            events = asyncio.run(streams(deployment.base_url, args.requests, args.concurrency, args.max_tokens))
            cpu, wall = cpu_seconds(gateway) - cpu, time.monotonic() - started
            runs.append({"events": events, "gateway_cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
                         "gateway_cpu_us_per_event": round(1e6 * cpu / max(events, 1), 1)})
            print(f"   {runs[-1]}", flush=True)
    per_event = statistics.median(r["gateway_cpu_us_per_event"] for r in runs)
    print(f"gateway CPU per streamed event: {per_event:.1f} us (median of {len(runs)}), "
          f"{args.requests} requests x {args.max_tokens} tokens, {args.concurrency} in flight")
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
