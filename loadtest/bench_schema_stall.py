"""Does a large JSON schema stall another user's stream? The longest gap between its tokens while two n=16
requests with the schema arrive (issue 35).

One `splitserve up` deployment (`--up-args`, by default colocated with one decode worker) streams a free completion
of `--max-tokens` tokens; at its 30th token, two chat requests of `n` 16 choices each, constrained by a JSON schema
of `--fields` string properties with patterns (172 KiB at 2,000), are sent at once. Per round: the stream's median
gap between tokens before them and after, its longest gap after, and how long the two requests took. `--fields 0`
sends them without a schema: what admitting 32 requests costs alone. `--root` runs another checkout's splitserve
(e.g. one before the change, to compare).

    python -m loadtest.bench_schema_stall --model splitserve-default-llama --fields 2000
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from services.bench.up_process import ROOT, serving

STALL_AT = 30  # the stream's token at which the constrained requests are sent


def schema(fields: int) -> dict:
    return {"type": "object", "required": [f"f{i}" for i in range(fields)],
            "properties": {f"f{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1},{i % 13 + 9}}}-[0-9]"
                                     f"{{{i % 5 + 1}}}(x|yy|zzz{i})?$"} for i in range(fields)}}


def constrained(base: str, fields: int, took: list[tuple[int, float]]) -> None:
    body = {"model": "bench", "n": 16, "max_tokens": 8, "messages": [{"role": "user", "content": "A record"}]}
    if fields:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "record", "schema": schema(fields)}}
    started = time.perf_counter()
    response = httpx.post(f"{base}/chat/completions", json=body, timeout=600)
    took.append((response.status_code, round(time.perf_counter() - started, 2)))


def one_round(base: str, fields: int, max_tokens: int) -> dict:
    body = {"model": "bench", "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    arrivals: list[float] = []
    took: list[tuple[int, float]] = []
    senders = [threading.Thread(target=constrained, args=(base, fields, took)) for _ in range(2)]
    with httpx.stream("POST", f"{base}/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter())
                if len(arrivals) == STALL_AT:
                    for sender in senders:
                        sender.start()
    for sender in senders:
        sender.join()
    gaps = [(b - a) * 1000 for a, b in zip(arrivals, arrivals[1:])]
    before, after = gaps[:STALL_AT - 1], gaps[STALL_AT - 1:]
    return {"median_gap_before_ms": round(statistics.median(before)),
            "median_gap_after_ms": round(statistics.median(after)), "longest_gap_after_ms": round(max(after)),
            "constrained_requests": took}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="splitserve-default-llama", help="a model name, directory or .gguf")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--up-args", default="--topology colocated --decode 1")
    parser.add_argument("--fields", type=int, default=2000, help="the schema's properties (0: no schema)")
    parser.add_argument("--max-tokens", type=int, default=300, help="the free stream's tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose splitserve runs")
    parser.add_argument("--out", help="the figures (JSON)")
    args = parser.parse_args(argv)
    from shared.engine.model_registry import resolve_model

    print(f"schema: {len(json.dumps(schema(args.fields))) / 1024:.0f} KiB" if args.fields else "no schema")
    model_dir = str(resolve_model(args.model).model_dir)
    with tempfile.TemporaryDirectory(prefix="splitserve-schema-stall-") as tmp:
        with serving("schema-stall", args.up_args.split(), model_dir=model_dir, run_dir=Path(tmp), dtype=args.dtype,
                     root=args.root) as deployment:
            rounds = []
            for _ in range(args.rounds):
                rounds.append(one_round(deployment.base_url, args.fields, args.max_tokens))
                print(f"   {rounds[-1]}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": {**vars(args), "root": str(args.root)}, "rounds": rounds},
                                             indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
