"""Shared-prefix benchmark: how much a kv-store and KV-aware routing cut the time to first token.

The workload (generated once from --seed, the same for every configuration):
--groups documents of --prefix-tokens random token ids; each is read by
--conversations conversations of --turns turns. Turn k's prompt is the
document, then each earlier turn's question (--question-tokens) and reply,
then turn k's question: what a chat client sends. The API returns text, not
token ids, so the transcript carries a stand-in reply of --max-tokens random
ids where the model's reply went (the cache sees the same prefix structure).
Each conversation runs its turns one after another (streaming completions,
greedy, `ignore_eos`); conversation i starts i x --stagger seconds after the
first, so every conversation after a document's first finds it computed.

Each configuration is one `splitserve up` deployment on --cores (`up --cpus`:
up gives each worker its share). The defaults compare, on two workers:

- `load`: `--topology colocated --decode 2 --no-kv-store
  --router load` (each worker's own prefix cache only);
- `load+store`: `... --kv-store --router load` (a worker that has not seen
  the document loads it from the kv-store);
- `kv+store`: `... --kv-store --router kv` (requests go where the prefix
  is cached, the kv-store behind);
- `disagg`: `--topology disagg --prefill 1 --decode 1` (its defaults: kv-store
  on, KV-aware routing).

Reported per configuration: TTFT p50/p95 of cold requests (a conversation's
first turn on a document nobody has read yet) and of warm ones (every other),
their ratio (the target: warm p50 at most a third of cold), the hit rate
(cached prompt tokens / prompt tokens, from each response's
`usage.prompt_tokens_details.cached_tokens`), and the prompt tokens the
workers computed (`splitserve_prompt_tokens_computed_total` on /metrics).

    python -m loadtest.bench_prefix --preset 100m --output loadtest/results/prefix_cpu_100m.json
    python -m loadtest.bench_prefix --preset tiny --groups 2 --conversations 2 --turns 2   # quick check
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

CONFIGS = {
    "load": ["--topology", "colocated", "--decode", "2", "--no-kv-store", "--router", "load"],
    "load+store": ["--topology", "colocated", "--decode", "2", "--kv-store", "--router", "load"],
    "kv+store": ["--topology", "colocated", "--decode", "2", "--kv-store", "--router", "kv"],
    "disagg": ["--topology", "disagg", "--prefill", "1", "--decode", "1"],
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=("tiny", "100m"), default="100m",
                        help="tiny: splitserve's default model; 100m: bench_engine's ~100M-parameter random llama")
    parser.add_argument("--model", help="a local model directory instead of the preset")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from: {', '.join(CONFIGS)}")
    parser.add_argument("--groups", type=int, default=4, help="documents")
    parser.add_argument("--conversations", type=int, default=2, help="conversations per document")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--stagger", type=float, default=3.0, help="seconds between conversation starts")
    parser.add_argument("--cores", default=None, help="the cores the workers share (up --cpus), e.g. 0,1 (default: all)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--stop-timeout", type=float, default=30.0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--run-dir-root", help="where the deployments' run dirs go (default: a temp dir)")
    parser.add_argument("--output", help="write the results as JSON here")
    return parser


def make_conversations(args, vocab_size: int) -> list[dict[str, Any]]:
    """[{group, index, turns: [prompt, ...]}], in start order: every document's conversations interleaved."""
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab_size) for _ in range(n)]

    documents = [tokens(args.prefix_tokens) for _ in range(args.groups)]
    conversations = []
    for index in range(args.conversations):
        for group, document in enumerate(documents):
            transcript, turns = list(document), []
            for _ in range(args.turns):
                transcript += tokens(args.question_tokens)
                turns.append(list(transcript))
                transcript += tokens(args.max_tokens)  # the stand-in reply
            conversations.append({"group": group, "index": index, "turns": turns})
    return conversations


async def run_conversations(base_url: str, conversations, args) -> list[dict[str, Any]]:
    import httpx

    options = argparse.Namespace(long_max_tokens=args.max_tokens, short_max_tokens=args.max_tokens)
    origin = time.perf_counter()
    records: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=len(conversations) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=args.request_timeout, limits=limits) as client:
        async def converse(position: int, conversation: dict[str, Any]) -> None:
            await asyncio.sleep(position * args.stagger)
            for turn, prompt in enumerate(conversation["turns"]):
                record = await send_request(client, "bench", {"kind": "long", "prompt": prompt}, options, None, origin)
                record.update(group=conversation["group"], conversation=conversation["index"], turn=turn,
                              prompt_tokens=len(prompt),
                              cold=conversation["index"] == 0 and turn == 0)  # nobody has read the document yet
                records.append(record)

        await asyncio.gather(*(converse(i, c) for i, c in enumerate(conversations)))
    return records


def prompt_tokens_computed(base_url: str) -> float:
    return sum(fetch_metrics(base_url, "splitserve_prompt_tokens_computed_total{").values())


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in records if r["error"] is None and r["chunks"]]
    ttft = {kind: [1e3 * (r["chunks"][0] - r["sent"]) for r in done if r["cold"] == (kind == "cold")]
            for kind in ("cold", "warm")}
    summary = {"completed": len(done), "failed": len(records) - len(done),
               "errors": [r["error"] for r in records if r["error"]][:3]}
    for kind, values in ttft.items():
        summary[f"ttft_{kind}_ms"] = {"p50": pct(values, 50), "p95": pct(values, 95),
                                      "mean": statistics.fmean(values) if values else None, "n": len(values)}
    cold, warm = summary["ttft_cold_ms"]["p50"], summary["ttft_warm_ms"]["p50"]
    summary["warm_over_cold_p50"] = warm / cold if cold and warm is not None else None
    prompt = sum(r["prompt_tokens"] for r in done)
    cached = sum(r.get("cached_tokens") or 0 for r in done)
    summary.update(prompt_tokens=prompt, cached_tokens=cached, hit_rate=cached / prompt if prompt else None)
    return summary


def run_one(label: str, flags: list[str], args, model_dir: str, conversations, run_root: Path) -> dict[str, Any]:
    slug = "".join(c if c.isalnum() else "-" for c in label)
    # up shares --cores out among the workers itself (and pairs their CPU loans): never re-pin its threads.
    dep = UpProcess(slug, [*flags, "--cpus", ",".join(map(str, args.cores))], model_dir=model_dir,
                    served_name="bench", run_dir=run_root / slug, dtype=args.dtype, worker_threads=len(args.cores),
                    ready_timeout_s=args.ready_timeout, stop_timeout_s=args.stop_timeout)
    result: dict[str, Any] = {"config": label, "flags": flags, "ok": False, "command": dep.cmd}
    print(f"\n== {label}: {' '.join(flags)}", flush=True)
    try:
        dep.start()
        dep.wait_ready(args.ready_timeout + 30)
        warm_up = [{"group": -1, "index": -1, "turns": [[11 + i for i in range(64)]]}]
        asyncio.run(run_conversations(dep.base_url, warm_up, args))  # first-call costs, not counted
        before = prompt_tokens_computed(dep.base_url)  # the gateway's /metrics asks every service as it is read
        records = asyncio.run(run_conversations(dep.base_url, conversations, args))
        result["prompt_tokens_computed"] = prompt_tokens_computed(dep.base_url) - before
        result.update(summarize(records))
        result["records"] = [{k: r[k] for k in ("group", "conversation", "turn", "cold", "prompt_tokens",
                                                 "cached_tokens", "error")}
                             | {"ttft_ms": 1e3 * (r["chunks"][0] - r["sent"]) if r["chunks"] else None}
                             for r in records]
        result["ok"] = result["completed"] == len(records)
        print(f"   TTFT p50 cold {result['ttft_cold_ms']['p50']} ms, warm {result['ttft_warm_ms']['p50']} ms, "
              f"hit rate {result['hit_rate']}, prompt tokens computed {result['prompt_tokens_computed']:.0f}",
              flush=True)
    except Exception as exc:  # noqa: BLE001 -- recorded; the next configuration still runs
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(f"   failed: {result['error']}", flush=True)
    finally:
        result["teardown"] = dep.stop()
    return result


def format_table(runs: list[dict[str, Any]]) -> str:
    def ms(value):
        return "-" if value is None else f"{value:.0f}"

    lines = ["| configuration | TTFT cold p50 / p95 ms | TTFT warm p50 / p95 ms | warm/cold p50 | hit rate "
             "| prompt tokens computed |", "|---|---|---|---|---|---|"]
    for r in runs:
        if not r["ok"]:
            lines.append(f"| {r['config']} | failed: {r.get('error') or r.get('errors')} |||||")
            continue
        cold, warm = r["ttft_cold_ms"], r["ttft_warm_ms"]
        ratio = "-" if r["warm_over_cold_p50"] is None else f"{r['warm_over_cold_p50']:.2f}"
        lines.append(f"| {r['config']} | {ms(cold['p50'])} / {ms(cold['p95'])} | {ms(warm['p50'])} / "
                     f"{ms(warm['p95'])} | {ratio} | {r['hit_rate']:.2f} | {r['prompt_tokens_computed']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.cores = ([int(c) for c in args.cores.split(",")] if args.cores else sorted(os.sched_getaffinity(0)))
    labels = [label.strip() for label in args.configs.split(",")]
    unknown = [label for label in labels if label not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configurations {unknown}; choose from {list(CONFIGS)}")
    model_dir = prepare_model(argparse.Namespace(model=args.model, preset=args.preset))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    longest = args.prefix_tokens + args.turns * (args.question_tokens + args.max_tokens)
    limit = config.get("max_position_embeddings")
    if limit and longest >= limit:
        raise SystemExit(f"the last turn needs {longest} tokens; the model holds {limit}")
    conversations = make_conversations(args, config["vocab_size"])
    run_root = Path(args.run_dir_root or tempfile.mkdtemp(prefix="bench-prefix-"))
    runs = [run_one(label, CONFIGS[label], args, model_dir, conversations, run_root) for label in labels]
    write_deployment_results(args, model_dir, config, runs, format_table(runs))
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
