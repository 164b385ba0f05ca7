"""Faults under load: what a worker's death, stall or stop costs the streams it serves, with and without moves.

For each `--migration-limits` value, one `splitserve up` deployment (`--up-args`, by default colocated with two
decode workers) serves `--streams` concurrent greedy streams of `--max-tokens` tokens, first with nothing
happening (the reference texts), then once per `--faults` entry, injected with a real signal into `--target`
(decode-0; stage-1 with `--up-args "--topology pipeline --stages 2"`) after `--fault-after-s`:

- `kill`: SIGKILL (the launcher starts it again);
- `stop`: SIGSTOP, SIGCONT `--stop-s` later (the worker is frozen, its registry entry lapses);
- `term`: SIGTERM (a graceful drain; the launcher starts it again).

Per fault: streams lost (ended with an error), streams moved (their text identical to the reference is
checked too), the fault-to-next-token time of the streams it hit (their longest gap), and the inter-token
latency of those streams outside that gap against the untouched ones'. Between faults the deployment is
let back to health (`/ready` says every service is ready).

    python -m loadtest.bench_faults --model smollm2-135m-instruct --out loadtest/results/faults.json \\
        --table loadtest/results/faults.md
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

import httpx

from services.bench.up_process import UpProcess, serving
from services.gateway.readiness import fully_ready

FAULTS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}
HIT_GAP_S = 1.0  # a stream whose longest gap is this long was hit by the fault


async def one_stream(client: httpx.AsyncClient, base: str, prompt: str, max_tokens: int) -> dict:
    """One greedy stream: its text, chunk arrival times, and the error it ended with (None: none)."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, times, error = [], [], None
    try:
        async with client.stream("POST", f"{base}/completions", json=body, timeout=300) as response:
            if response.status_code != 200:
                return {"text": "", "times": [], "error": f"HTTP {response.status_code}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    error = event["error"].get("code") or "error"
                    break
                times.append(time.monotonic())
                text.append(event["choices"][0]["text"])
    except httpx.HTTPError as exc:
        error = type(exc).__name__
    return {"text": "".join(text), "times": times, "error": error}


async def run_streams(base: str, prompts: list[str], max_tokens: int, fault=None) -> list[dict]:
    """All streams at once; `fault()` (if any) runs beside them."""
    async with httpx.AsyncClient() as client:
        streams = [asyncio.create_task(one_stream(client, base, p, max_tokens)) for p in prompts]
        if fault is not None:
            await fault()
        return await asyncio.gather(*streams)


def worker_pid(deployment: UpProcess, name: str) -> int:
    service = next(s for s in deployment.ps()["services"] if s["name"] == name)
    return service["pid"]


async def wait_healthy(base: str, timeout_s: float = 120.0) -> None:
    """Until the gateway's /ready says every service of the deployment is ready again."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            try:
                response = await client.get(base.removesuffix("/v1") + "/ready", timeout=5)
                if fully_ready(response.status_code, response.text):
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError("the deployment did not come back to health")


def summarize(streams: list[dict], reference: list[str] | None, fault_at: float | None) -> dict:
    lost = [s for s in streams if s["error"]]
    gaps = [[b - a for a, b in zip(s["times"], s["times"][1:])] for s in streams]
    hit = [i for i, g in enumerate(gaps) if g and max(g) >= HIT_GAP_S]
    rest = [i for i in range(len(streams)) if i not in hit]

    def itl_ms(indices, drop_longest: bool) -> float | None:
        values = []
        for i in indices:
            g = sorted(gaps[i])
            values += g[:-1] if drop_longest and g else g
        return round(statistics.median(values) * 1000, 1) if values else None

    return {
        "streams": len(streams), "lost": len(lost), "errors": sorted({s["error"] for s in lost}),
        "hit": len(hit),
        "identical_to_reference": (sum(s["text"] == r for s, r in zip(streams, reference)) if reference else None),
        "fault_to_next_token_s": ([round(max(gaps[i]), 2) for i in hit] if fault_at is not None else []),
        "hit_itl_p50_ms_outside_the_gap": itl_ms(hit, True),
        "untouched_itl_p50_ms": itl_ms(rest, False),
    }


async def measure(deployment: UpProcess, args, prompts: list[str]) -> dict:
    base = deployment.base_url
    results = {}
    reference = await run_streams(base, prompts, args.max_tokens)
    results["none"] = summarize(reference, None, None)
    texts = [s["text"] for s in reference]
    for name in args.faults:
        await wait_healthy(base)
        pid = worker_pid(deployment, args.target)
        fault_at: list[float] = []

        async def fault(name=name, pid=pid):
            await asyncio.sleep(args.fault_after_s)
            fault_at.append(time.monotonic())
            os.kill(pid, FAULTS[name])
            if name == "stop":
                await asyncio.sleep(args.stop_s)
                os.kill(pid, signal.SIGCONT)

        streams = await run_streams(base, prompts, args.max_tokens, fault)
        results[name] = summarize(streams, texts, fault_at[0] if fault_at else None)
        print(f"   {name}: {results[name]}", flush=True)
    return results


def table(runs: dict) -> str:
    lines = ["| fault | migration limit | streams lost | streams hit | identical to the uninterrupted run | "
             "fault to next token (s) | hit streams' ITL p50 outside the gap | untouched streams' ITL p50 |",
             "|---|---|---|---|---|---|---|---|"]
    for limit, results in runs.items():
        for fault, r in results.items():
            if fault == "none":
                continue
            gaps = ", ".join(f"{g:.1f}" for g in sorted(r["fault_to_next_token_s"])) or "-"
            lines.append(f"| {fault} | {limit} | {r['lost']} of {r['streams']} | {r['hit']} | "
                         f"{r['identical_to_reference']} of {r['streams']} | {gaps} | "
                         f"{r['hit_itl_p50_ms_outside_the_gap']} ms | {r['untouched_itl_p50_ms']} ms |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model name, directory or .gguf")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--up-args", default="--topology colocated --decode 2",
                        help="the deployment's `splitserve up` flags (by default two colocated decode workers)")
    parser.add_argument("--migration-limits", default="0,3", help="comma-separated: each gets a deployment")
    parser.add_argument("--faults", default="kill,stop,term", help=f"comma-separated, of {', '.join(FAULTS)}")
    parser.add_argument("--target", default="decode-0", help="the service the faults hit, by name (`splitserve ps`)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--fault-after-s", type=float, default=2.0)
    parser.add_argument("--stop-s", type=float, default=20.0, help="how long a `stop` fault freezes the worker")
    parser.add_argument("--out", help="the figures (JSON)")
    parser.add_argument("--table", help="the markdown table")
    args = parser.parse_args(argv)
    args.faults = [f for f in args.faults.split(",") if f]
    unknown = [f for f in args.faults if f not in FAULTS]
    if unknown:
        parser.error(f"unknown faults: {', '.join(unknown)}")
    from shared.engine.model_registry import resolve_model

    model_dir = str(resolve_model(args.model).model_dir)
    prompts = [f"Story {i}: once upon a time in a town by the sea, there lived" for i in range(args.streams)]
    runs = {}
    with tempfile.TemporaryDirectory(prefix="splitserve-faults-") as tmp:
        for limit in [int(x) for x in args.migration_limits.split(",")]:
            with serving(f"limit{limit}", [*shlex.split(args.up_args), "--migration-limit", str(limit)],
                         model_dir=model_dir, run_dir=Path(tmp) / f"limit{limit}", dtype=args.dtype) as deployment:
                runs[str(limit)] = asyncio.run(measure(deployment, args, prompts))
    rendered = table(runs)
    print(rendered)
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": {k: v for k, v in vars(args).items()}, "runs": runs},
                                             indent=2))
    if args.table:
        Path(args.table).write_text(rendered + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
