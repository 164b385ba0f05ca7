"""Interference benchmark: do long prompts stall the tokens of short requests?

The experiment that motivates prefill/decode disaggregation (issue 4). One run
measures two deployments of the same model, one after the other, under the
same request schedule:

- `colocated`: `splitserve up --topology colocated --decode 2` (two workers
  that each prefill and decode);
- `disagg`: `splitserve up --topology disagg --prefill 1 --decode 1
  --max-local-prefill 256` (long prompts go to the prefill worker; the short
  ones are prefilled locally by the decode worker).

Each worker process (role decode or prefill) is pinned to its own core with
`sched_setaffinity` (every thread of it), and runs with OMP_NUM_THREADS set to
--worker-threads (default 1). NATS, the scheduler, the gateway and this load
generator are not pinned: they share the same cores with the workers.

The load, identical for both topologies (generated once from --seed):
- short chat requests (streaming, a ~--short-prompt-tokens prompt including
  the chat template, --short-max-tokens output tokens with `ignore_eos`,
  temperature 0), sent open-loop with Poisson arrivals at --short-rate per
  second for --duration seconds; an arrival that finds --max-concurrency short
  requests already in flight is dropped (and counted);
- one long completion (a prompt of --long-prompt-tokens random token ids,
  --long-max-tokens output tokens) every --long-every seconds, the first at
  half that period.

Before the measured window, a warm-up sends a few requests of both kinds (not
counted), so first-call costs (allocator, kernels) do not land in the figures.

Measured per short request with httpx streaming: TTFT (request sent -> first
SSE chunk with text) and inter-token latencies (ITL: the gaps between
successive SSE chunks that carry text). ITL percentiles pool the gaps of all
completed short requests. Throughput = output tokens (from the usage chunk) of
every completed request, short and long, / the window: --duration, or longer
when the last request completes after it. The 100m model's context
(max_position_embeddings 4096, the default model config's) holds the 2048-token
long prompt; lengths are checked against the model's limit before starting.

    python -m loadtest.bench_interference --preset 100m --output loadtest/results/interference_cpu_100m.json
    python -m loadtest.bench_interference --preset tiny --duration 3   # quick check
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from services.bench.up_process import UpProcess, pin_process

ROOT = Path(__file__).resolve().parent.parent

TOPOLOGIES = ("colocated", "disagg")
WORKER_ROLES = ("prefill", "decode")

# Per-preset defaults of the flags that default to None. The 100m figures are
# sized for the 2-core CPU machine with one thread per worker: a 2048-token
# prefill of the 100m model takes several seconds on one core, so a long prompt
# every 10 s keeps the prefill worker below saturation.
PRESETS: dict[str, dict[str, Any]] = {
    "100m": dict(duration=120.0, short_rate=1.0, long_every=10.0, ready_timeout=300.0, drain_timeout=180.0),
    "tiny": dict(duration=5.0, short_rate=2.0, long_every=2.0, ready_timeout=120.0, drain_timeout=30.0),
}

RESULT_KEYS = ("benchmark", "config", "machine", "model", "topologies", "comparison", "notes")
TOPOLOGY_KEYS = (
    "topology", "ok", "error", "command", "workers", "unpinned", "ready_s", "short", "long",
    "elapsed_s", "output_tokens", "output_tokens_per_s", "metrics", "teardown",
)
SHORT_KEYS = ("scheduled", "sent", "dropped_at_cap", "completed", "failed", "unfinished", "output_tokens",
              "itl_ms", "ttft_ms", "tpot_ms", "e2e_s")
LONG_KEYS = ("scheduled", "sent", "completed", "failed", "unfinished", "output_tokens", "ttft_ms", "e2e_s")
PERCENTILES = (50, 95, 99)

# Gateway /metrics series worth keeping (they show where long prompts were prefilled).
METRIC_PREFIXES = (
    "splitserve_disagg_decisions_total",
    "splitserve_prefill_outcomes_total",
    "splitserve_kv_transfer_bytes_total",
    "splitserve_kv_transfer_seconds_count",
    "splitserve_kv_transfer_seconds_sum",
)


# ---------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_interference",
        description="Short streaming chat requests plus a periodic long prompt, against a colocated (2 workers) and "
        "a disaggregated (1 prefill + 1 decode) deployment, each worker pinned to its own core: p50/p95/p99 "
        "inter-token latency of the short requests and overall throughput, side by side.",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="100m",
                        help="100m: the ~100M-parameter random llama of bench_engine (built once, cached), full "
                        "durations; tiny: splitserve's default model and short durations (default: 100m)")
    parser.add_argument("--model", metavar="DIR", help="serve this Hugging Face model directory instead")
    parser.add_argument("--topologies", nargs="+", choices=TOPOLOGIES, default=list(TOPOLOGIES),
                        help="which deployments to measure, in this order (default: colocated disagg)")
    parser.add_argument("--duration", type=float, default=None, metavar="S",
                        help="seconds of load per topology (100m: 120, tiny: 5)")
    parser.add_argument("--short-rate", type=float, default=None, metavar="R",
                        help="short requests per second, Poisson arrivals (100m: 1.0, tiny: 2.0)")
    parser.add_argument("--short-prompt-tokens", type=int, default=32, metavar="N",
                        help="short chat prompt length in tokens, chat template included (default: 32)")
    parser.add_argument("--short-max-tokens", type=int, default=64, metavar="N",
                        help="output tokens per short request, EOS ignored (default: 64)")
    parser.add_argument("--long-every", type=float, default=None, metavar="S",
                        help="one long request every S seconds, the first at S/2 (100m: 10, tiny: 2)")
    parser.add_argument("--long-prompt-tokens", type=int, default=2048, metavar="N",
                        help="long prompt length in token ids (default: 2048)")
    parser.add_argument("--long-max-tokens", type=int, default=8, metavar="N",
                        help="output tokens per long request, EOS ignored (default: 8)")
    parser.add_argument("--max-concurrency", type=int, default=32, metavar="N",
                        help="short requests in flight at most; later arrivals are dropped and counted (default: 32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrivals and prompts (default: 0)")
    parser.add_argument("--colocated-workers", type=int, default=2, metavar="N",
                        help="colocated: number of workers (--decode N; default: 2)")
    parser.add_argument("--disagg-prefill", type=int, default=1, metavar="N",
                        help="disagg: prefill workers (default: 1)")
    parser.add_argument("--disagg-decode", type=int, default=1, metavar="N", help="disagg: decode workers (default: 1)")
    parser.add_argument("--max-local-prefill", type=int, default=256, metavar="N",
                        help="disagg: prompts with more uncached tokens are prefilled remotely (default: 256)")
    parser.add_argument("--kv-transport", choices=["auto", "shm", "tcp"], default="auto",
                        help="disagg: KV side channel (default: auto)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="workers' dtype (default: float32)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                        help="every worker's token budget per step, the same in both topologies: long prompts are "
                        "prefilled in chunks of N tokens mixed with decodes (default: the engine's, 2048)")
    parser.add_argument("--cores", metavar="LIST",
                        help="comma-separated cores for the workers, one each in order (default: the first cores "
                        "this process may run on); fewer cores than workers: workers share them round-robin")
    parser.add_argument("--worker-threads", type=int, default=1, metavar="N",
                        help="OMP_NUM_THREADS/MKL_NUM_THREADS of the deployment's processes (default: 1, one thread "
                        "per pinned worker)")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="skip the uncounted warm-up requests before each measured window")
    parser.add_argument("--ready-timeout", type=float, default=None, metavar="S",
                        help="deadline for the 'splitserve ready' line (100m: 300, tiny: 120)")
    parser.add_argument("--drain-timeout", type=float, default=None, metavar="S",
                        help="after the load, wait at most S seconds for requests in flight; the rest are cancelled "
                        "and counted as unfinished (100m: 180, tiny: 30)")
    parser.add_argument("--request-timeout", type=float, default=300.0, metavar="S",
                        help="HTTP timeout of one request (default: 300)")
    parser.add_argument("--stop-timeout", type=float, default=30.0, metavar="S",
                        help="after SIGTERM, wait this long for the deployment to exit before killing it (default: 30)")
    parser.add_argument("--run-dir-root", metavar="DIR",
                        help="where the deployments' run directories go (default: a new temporary directory)")
    parser.add_argument("--keep-run-dirs", action="store_true",
                        help="keep the run directories (logs) even when everything went well")
    parser.add_argument("--output", metavar="FILE.json", help="write the results as JSON here")
    return parser


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    for name, value in PRESETS[args.preset].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    # Each topology once, in the order given.
    args.topologies = list(dict.fromkeys(args.topologies))
    problems = []
    for flag in ("duration", "short_rate", "long_every", "ready_timeout", "drain_timeout", "request_timeout",
                 "stop_timeout"):
        if not getattr(args, flag) > 0:
            problems.append(f"--{flag.replace('_', '-')} must be positive")
    for flag in ("short_prompt_tokens", "short_max_tokens", "long_prompt_tokens", "long_max_tokens",
                 "max_concurrency", "colocated_workers", "disagg_prefill", "disagg_decode", "worker_threads"):
        if getattr(args, flag) < 1:
            problems.append(f"--{flag.replace('_', '-')} must be at least 1")
    if args.short_max_tokens < 2:
        problems.append("--short-max-tokens must be at least 2 (an ITL needs two tokens)")
    if args.max_local_prefill < 0:
        problems.append("--max-local-prefill must not be negative")
    if args.cores:
        try:
            args.cores = [int(c) for c in args.cores.split(",") if c.strip()]
        except ValueError:
            problems.append("--cores must be a comma-separated list of core numbers")
        else:
            if not args.cores:
                problems.append("--cores names no core")
    else:
        args.cores = sorted(os.sched_getaffinity(0))
    if problems:
        raise SystemExit("bench_interference: " + "; ".join(problems))
    return args


# ---------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------
def prepare_model(args: argparse.Namespace) -> str:
    """--model, else splitserve's default model (tiny) or bench_engine's cached 100m random llama."""
    if args.model:
        return str(Path(args.model).resolve())
    if args.preset == "tiny":
        from shared.engine.default_model import default_model_dir

        return str(default_model_dir())
    from loadtest import bench_engine

    return bench_engine.prepare_model(argparse.Namespace(model=None, preset=args.preset))


def _safetensors_parameters(path: Path) -> int:
    """Number of parameters in one .safetensors file, from its header alone."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    total = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        count = 1
        for dim in entry["shape"]:
            count *= dim
        total += count
    return total


def describe_model(model_dir: str) -> dict[str, Any]:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    files = sorted(Path(model_dir).glob("*.safetensors"))
    heads = config.get("num_attention_heads")
    return {
        "dir": model_dir,
        "model_type": config.get("model_type"),
        "num_parameters": sum(_safetensors_parameters(p) for p in files) if files else None,
        "hidden_size": config.get("hidden_size"),
        "num_hidden_layers": config.get("num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": config.get("num_key_value_heads", heads),
        "intermediate_size": config.get("intermediate_size"),
        "vocab_size": config.get("vocab_size"),
        "max_position_embeddings": config.get("max_position_embeddings"),
    }


def check_lengths(args: argparse.Namespace, model: dict[str, Any], short_prompt_max: int) -> None:
    """Fail early when a request would not fit the model's context."""
    limit = model.get("max_position_embeddings")
    if not limit:
        return
    problems = []
    if args.long_prompt_tokens + args.long_max_tokens > limit:
        problems.append(f"--long-prompt-tokens {args.long_prompt_tokens} + --long-max-tokens {args.long_max_tokens} "
                        f"exceeds the model's max_position_embeddings {limit}")
    if short_prompt_max + args.short_max_tokens > limit:
        problems.append(f"a short prompt of {short_prompt_max} tokens + --short-max-tokens {args.short_max_tokens} "
                        f"exceeds the model's max_position_embeddings {limit}")
    if problems:
        raise SystemExit("bench_interference: " + "; ".join(problems))


# ---------------------------------------------------------------------------------
# Workload (one schedule for every topology)
# ---------------------------------------------------------------------------------
def _words() -> list[str]:
    from shared.engine.default_model import TOKENIZER_CORPUS

    words = [w for w in TOKENIZER_CORPUS.split() if w.isascii()]
    return words or ["hello", "world"]


def make_short_messages(tokenizer, rng: random.Random, words: list[str], target: int) -> tuple[list[dict], int]:
    """A user message whose chat-templated prompt has about `target` tokens: (messages, prompt tokens)."""

    def templated(content: str) -> int:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return len(ids)

    overhead = templated("")
    picked: list[str] = []
    while True:
        picked.append(rng.choice(words))
        if overhead + len(tokenizer(" ".join(picked), add_special_tokens=False).input_ids) >= target:
            break
    content = " ".join(picked)
    return [{"role": "user", "content": content}], templated(content)


def make_schedule(args: argparse.Namespace, tokenizer) -> dict[str, Any]:
    """Arrival times and prompts of the measured window and of the warm-up."""
    rng = random.Random(args.seed)
    words = _words()
    specials = set(tokenizer.all_special_ids)
    vocab = len(tokenizer)
    pool = [t for t in range(vocab) if t not in specials]

    def short() -> dict[str, Any]:
        messages, n = make_short_messages(tokenizer, rng, words, args.short_prompt_tokens)
        return {"kind": "short", "messages": messages, "prompt_tokens": n}

    def long() -> dict[str, Any]:
        # Fresh random ids every time: no long prompt is a prefix-cache hit.
        return {"kind": "long", "prompt": [rng.choice(pool) for _ in range(args.long_prompt_tokens)],
                "prompt_tokens": args.long_prompt_tokens}

    events: list[tuple[float, dict[str, Any]]] = []
    t = rng.expovariate(args.short_rate)
    while t < args.duration:
        events.append((t, short()))
        t += rng.expovariate(args.short_rate)
    t = args.long_every / 2
    while t < args.duration:
        events.append((t, long()))
        t += args.long_every
    events.sort(key=lambda e: e[0])
    warmup_short = [short() for _ in range(4)]
    warmup_long = [long() for _ in range(4)]
    shorts = [e for _, e in events if e["kind"] == "short"]
    lens = [e["prompt_tokens"] for e in shorts + warmup_short]
    return {
        "events": events,
        "warmup_short": warmup_short,
        "warmup_long": warmup_long,
        "short_scheduled": len(shorts),
        "long_scheduled": len(events) - len(shorts),
        "short_prompt_tokens": {"min": min(lens), "max": max(lens), "mean": sum(lens) / len(lens)},
    }


# ---------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: list[float], scale: float = 1.0) -> dict[str, Any]:
    """count, mean, max and p50/p95/p99 of `values` times `scale` (None when empty)."""
    out: dict[str, Any] = {"count": len(values)}
    if not values:
        out.update({"mean": None, "max": None, **{f"p{q}": None for q in PERCENTILES}})
        return out
    scaled = [v * scale for v in values]
    out["mean"] = sum(scaled) / len(scaled)
    out["max"] = max(scaled)
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(scaled, q)
    return out


# ---------------------------------------------------------------------------------
# Load generator (asyncio + httpx streaming)
# ---------------------------------------------------------------------------------
async def send_request(client, model_name: str, item: dict[str, Any], args: argparse.Namespace,
                       scheduled: float | None, origin: float) -> dict[str, Any]:
    """One streaming request; times are perf_counter seconds relative to `origin`."""
    short = item["kind"] == "short"
    body: dict[str, Any] = {
        "model": model_name,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        "ignore_eos": True,
        "max_tokens": args.short_max_tokens if short else args.long_max_tokens,
    }
    if short:
        url, body["messages"] = "/chat/completions", item["messages"]
    else:
        url, body["prompt"] = "/completions", item["prompt"]
    rec: dict[str, Any] = {"kind": item["kind"], "scheduled": scheduled, "sent": time.perf_counter() - origin,
                           "chunks": [], "tokens": None, "cached_tokens": None, "end": None, "error": None}
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec["error"] = f"HTTP {resp.status_code}: {text[:300]}"
                return rec
            async for line in resp.aiter_lines():
                now = time.perf_counter() - origin
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                obj = json.loads(payload)
                if "error" in obj:
                    rec["error"] = f"stream error: {json.dumps(obj['error'])[:300]}"
                    return rec
                for choice in obj.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content") if short else choice.get("text")
                    if text:
                        rec["chunks"].append(now)
                usage = obj.get("usage")
                if usage:
                    rec["tokens"] = usage.get("completion_tokens")
                    rec["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        rec["end"] = time.perf_counter() - origin
        if rec["tokens"] is None:
            rec["tokens"] = len(rec["chunks"])
        if not rec["chunks"]:
            rec["error"] = "the stream ended without any text"
    except asyncio.CancelledError:
        rec["error"] = "cancelled"
        raise
    except Exception as exc:  # noqa: BLE001 -- a failed request is counted, never fatal
        rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return rec


async def run_load(base_url: str, model_name: str, schedule: dict[str, Any], args: argparse.Namespace,
                   warmup_long: int, warmup_short: int) -> dict[str, Any]:
    import httpx

    connections = args.max_concurrency + 16
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        warm: dict[str, Any] = {"requests": 0, "failed": 0, "seconds": 0.0}
        if args.warmup:
            origin = time.perf_counter()
            items = schedule["warmup_long"][:warmup_long] + schedule["warmup_short"][:warmup_short]
            tasks = [asyncio.create_task(send_request(client, model_name, it, args, None, origin)) for it in items]
            done, pending = await asyncio.wait(tasks, timeout=args.drain_timeout)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            warm = {"requests": len(items), "failed": len(pending) + sum(1 for t in done if t.result()["error"]),
                    "seconds": time.perf_counter() - origin}

        loop = asyncio.get_running_loop()
        origin = time.perf_counter()
        start = loop.time()
        tasks: list[asyncio.Task] = []
        kinds: dict[asyncio.Task, str] = {}
        in_flight = {"short": 0}
        dropped = 0

        def finished(task: asyncio.Task) -> None:
            in_flight["short"] -= 1

        for at, item in schedule["events"]:
            delay = start + at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if item["kind"] == "short":
                if in_flight["short"] >= args.max_concurrency:
                    dropped += 1
                    continue
                in_flight["short"] += 1
            task = asyncio.create_task(send_request(client, model_name, item, args, at, origin))
            if item["kind"] == "short":
                task.add_done_callback(finished)
            kinds[task] = item["kind"]
            tasks.append(task)
        load_end = time.perf_counter() - origin
        pending: set = set()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=args.drain_timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        records = [t.result() for t in tasks if t not in pending]
        unfinished = {"short": 0, "long": 0}
        for task in pending:
            unfinished[kinds[task]] += 1
        return {"records": records, "unfinished_kinds": unfinished, "dropped": dropped, "warmup": warm,
                "load_end_s": load_end, "drain_end_s": time.perf_counter() - origin}


def analyse(load: dict[str, Any], schedule: dict[str, Any], window: float) -> dict[str, Any]:
    records = load["records"]
    shorts = [r for r in records if r["kind"] == "short"]
    longs = [r for r in records if r["kind"] == "long"]
    ok_short = [r for r in shorts if r["error"] is None]
    ok_long = [r for r in longs if r["error"] is None]

    itl, ttft, tpot, e2e, lateness = [], [], [], [], []
    chunks = 0
    for r in ok_short:
        times = r["chunks"]
        ttft.append(times[0] - r["sent"])
        itl.extend(b - a for a, b in zip(times, times[1:]))
        e2e.append(r["end"] - r["sent"])
        if r["tokens"] and r["tokens"] > 1:
            tpot.append((times[-1] - times[0]) / (r["tokens"] - 1))
        chunks += len(times)
    for r in shorts + longs:
        lateness.append(r["sent"] - r["scheduled"])
    short_tokens = sum(r["tokens"] or 0 for r in ok_short)
    long_tokens = sum(r["tokens"] or 0 for r in ok_long)
    # The window runs from the first scheduled arrival slot (t=0) to --duration, or to the last completion
    # when requests are still finishing after it.
    ends = [r["end"] for r in ok_short + ok_long]
    elapsed = max([window, *ends])
    errors = sorted({r["error"] for r in shorts + longs if r["error"]})[:5]
    unfinished = load["unfinished_kinds"]
    return {
        "short": {
            "scheduled": schedule["short_scheduled"],
            "sent": len(shorts) + unfinished["short"],
            "dropped_at_cap": load["dropped"],
            "completed": len(ok_short),
            "failed": len(shorts) - len(ok_short),
            "unfinished": unfinished["short"],
            "output_tokens": short_tokens,
            "text_chunks": chunks,
            "tokens_per_text_chunk": short_tokens / chunks if chunks else None,
            "itl_ms": summarize(itl, 1000.0),
            "ttft_ms": summarize(ttft, 1000.0),
            "tpot_ms": summarize(tpot, 1000.0),
            "e2e_s": summarize(e2e),
        },
        "long": {
            "scheduled": schedule["long_scheduled"],
            "sent": len(longs) + unfinished["long"],
            "completed": len(ok_long),
            "failed": len(longs) - len(ok_long),
            "unfinished": unfinished["long"],
            "output_tokens": long_tokens,
            "ttft_ms": summarize([r["chunks"][0] - r["sent"] for r in ok_long], 1000.0),
            "e2e_s": summarize([r["end"] - r["sent"] for r in ok_long]),
        },
        "send_lateness_ms": summarize(lateness, 1000.0),
        "errors": errors,
        "warmup": load["warmup"],
        "load_window_s": load["load_end_s"],
        "elapsed_s": elapsed,
        "output_tokens": short_tokens + long_tokens,
        "output_tokens_per_s": (short_tokens + long_tokens) / elapsed,
        "short_output_tokens_per_s": short_tokens / elapsed,
    }


# ---------------------------------------------------------------------------------
# Deployment: start, pin, tear down
# ---------------------------------------------------------------------------------
def deployment_for(topology: str, args: argparse.Namespace, model_dir: str, served_name: str,
                   run_dir: Path) -> UpProcess:
    if topology == "colocated":
        flags = ["--topology", topology, "--decode", str(args.colocated_workers)]
    else:
        flags = ["--topology", topology, "--prefill", str(args.disagg_prefill), "--decode", str(args.disagg_decode),
                 "--max-local-prefill", str(args.max_local_prefill), "--kv-transport", args.kv_transport]
    if args.max_num_batched_tokens is not None:
        flags += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return UpProcess(topology, flags, model_dir=model_dir, served_name=served_name, run_dir=run_dir, dtype=args.dtype,
                     worker_threads=args.worker_threads, ready_timeout_s=args.ready_timeout,
                     stop_timeout_s=args.stop_timeout)


def pin_workers(dep: UpProcess, cores: list[int]) -> tuple[list[dict[str, Any]], list[str]]:
    """Workers (prefill first, then decode) each on the next core: (workers, unpinned service names)."""
    data = dep.ps()
    services = data.get("services", [])
    workers = [s for s in services if s["role"] in WORKER_ROLES]
    workers.sort(key=lambda s: (WORKER_ROLES.index(s["role"]), s["name"]))
    if not workers:
        raise RuntimeError("splitserve ps lists no worker")
    out = []
    for i, s in enumerate(workers):
        if not s.get("pid"):
            raise RuntimeError(f"worker {s['name']} has no pid")
        core = cores[i % len(cores)]
        tids = pin_process(s["pid"], core)
        out.append({"name": s["name"], "role": s["role"], "pid": s["pid"], "core": core, "threads_pinned": len(tids),
                    "affinity_after": sorted(os.sched_getaffinity(s["pid"]))})
    unpinned = [s["name"] for s in services if s["role"] not in WORKER_ROLES]
    if (data.get("nats") or {}).get("embedded"):
        unpinned.insert(0, "nats")
    return out, unpinned


def scrape_metrics(base_url: str) -> dict[str, float]:
    import httpx

    root = base_url[: -len("/v1")] if base_url.endswith("/v1") else base_url
    try:
        text = httpx.get(root + "/metrics", timeout=10.0).text
    except Exception as exc:  # noqa: BLE001 -- diagnostics only
        return {"error": str(exc)}
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(METRIC_PREFIXES):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                samples[name] = float(value)
    return samples


def restarts_of_workers(dep: UpProcess, workers: list[dict[str, Any]]) -> dict[str, Any]:
    """Workers whose pid changed or that restarted (a new process is not pinned)."""
    try:
        data = dep.ps()
    except Exception as exc:  # noqa: BLE001
        return {"error": str(exc)}
    now = {s["name"]: s for s in data.get("services", [])}
    out = {}
    for w in workers:
        s = now.get(w["name"], {})
        if s.get("pid") != w["pid"] or s.get("restarts", 0):
            out[w["name"]] = {"pid_before": w["pid"], "pid_after": s.get("pid"), "restarts": s.get("restarts")}
    return out


def run_topology(topology: str, args: argparse.Namespace, model_dir: str, served_name: str, schedule: dict[str, Any],
                 run_root: Path) -> dict[str, Any]:
    run_dir = run_root / topology
    dep = deployment_for(topology, args, model_dir, served_name, run_dir)
    result: dict[str, Any] = {"topology": topology, "ok": False, "error": None, "command": dep.cmd,
                              "run_dir": str(run_dir), "workers": [], "unpinned": [], "ready_s": None,
                              "metrics": {}, "teardown": None}
    print(f"\n== {topology}: starting `splitserve up` (port {dep.port}, namespace {dep.namespace}) ...", flush=True)
    try:
        dep.start()
        # A little beyond the launcher's own --ready-timeout, so its message (with the logs) comes first.
        result["ready_s"] = dep.wait_ready(args.ready_timeout + 30.0)
        workers, unpinned = pin_workers(dep, args.cores)
        result["workers"], result["unpinned"] = workers, unpinned
        for w in workers:
            print(f"  pinned {w['name']} (pid {w['pid']}, {w['threads_pinned']} threads) to core {w['core']}",
                  flush=True)
        print(f"  not pinned (share the cores): {', '.join(unpinned)}, and this load generator", flush=True)
        if topology == "colocated":
            warm_long = args.colocated_workers
            warm_short = 2 * args.colocated_workers
        else:
            warm_long = args.disagg_prefill
            warm_short = 2 * args.disagg_decode
        print(f"  load: {schedule['short_scheduled']} short + {schedule['long_scheduled']} long requests over "
              f"{args.duration:g} s" + (" (after a warm-up)" if args.warmup else ""), flush=True)
        load = asyncio.run(run_load(dep.base_url, served_name, schedule, args, min(warm_long, 4), min(warm_short, 4)))
        result.update(analyse(load, schedule, args.duration))
        result["metrics"] = scrape_metrics(dep.base_url)
        result["worker_restarts"] = restarts_of_workers(dep, result["workers"])
        result["ok"] = result["short"]["completed"] > 0
        if not result["ok"]:
            result["error"] = "no short request completed" + (f": {result['errors'][0]}" if result["errors"] else "")
    except Exception as exc:  # noqa: BLE001 -- recorded; the next topology still runs
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(f"  {topology} failed: {result['error']}", flush=True)
    finally:
        result["teardown"] = dep.stop()
        how = "cleanly" if result["teardown"]["clean"] else f"after killing {', '.join(result['teardown']['killed'])}"
        print(f"  {topology} deployment stopped {how} in {result['teardown']['seconds']:.1f} s", flush=True)
    _fill_missing(result)
    return result


def _fill_missing(result: dict[str, Any]) -> None:
    """A failed topology still has every key (with empty figures)."""
    empty = summarize([])
    result.setdefault("short", {k: (dict(empty) if k.endswith(("_ms", "_s")) else 0) for k in SHORT_KEYS})
    result.setdefault("long", {k: (dict(empty) if k.endswith(("_ms", "_s")) else 0) for k in LONG_KEYS})
    for key in ("elapsed_s", "output_tokens", "output_tokens_per_s"):
        result.setdefault(key, None)


# ---------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b:
        return None
    return a / b


def compare(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    c, d = results.get("colocated"), results.get("disagg")
    if not (c and d and c["ok"] and d["ok"]):
        return {"available": False}
    p95 = _ratio(d["short"]["itl_ms"]["p95"], c["short"]["itl_ms"]["p95"])
    tput = _ratio(d["output_tokens_per_s"], c["output_tokens_per_s"])
    return {
        "available": True,
        "p95_itl_ratio_disagg_over_colocated": p95,
        "p50_itl_ratio_disagg_over_colocated": _ratio(d["short"]["itl_ms"]["p50"], c["short"]["itl_ms"]["p50"]),
        "p99_itl_ratio_disagg_over_colocated": _ratio(d["short"]["itl_ms"]["p99"], c["short"]["itl_ms"]["p99"]),
        "throughput_ratio_disagg_over_colocated": tput,
        "target": "disagg p95 ITL <= 0.5 x colocated, throughput >= 0.8 x colocated (issue 4)",
        "target_met": bool(p95 is not None and tput is not None and p95 <= 0.5 and tput >= 0.8),
    }


def format_report(results: dict[str, Any]) -> str:
    cfg, tops = results["config"], results["topologies"]
    names = list(tops)
    model = results["model"]
    params = f"{model['num_parameters']:,} params" if model.get("num_parameters") else "? params"
    lines = [
        "",
        f"Interference -- {model['model_type']} {params}, {cfg['dtype']}, {results['machine']['cpu_count']} CPUs "
        f"({results['machine']['cpu_model']}), torch {results['machine']['torch_version']}",
        f"short: chat, ~{cfg['short_prompt_tokens']}-token prompt, {cfg['short_max_tokens']} output tokens, "
        f"{cfg['short_rate']:g}/s Poisson (seed {cfg['seed']}, at most {cfg['max_concurrency']} in flight); "
        f"long: {cfg['long_prompt_tokens']}-token prompt, {cfg['long_max_tokens']} output tokens, every "
        f"{cfg['long_every']:g} s; {cfg['duration']:g} s per topology",
    ]
    for name in names:
        t = tops[name]
        pins = ", ".join(f"{w['name']}->core {w['core']}" for w in t["workers"]) or "none"
        lines.append(f"  {name}: workers pinned {pins}; unpinned, sharing those cores: "
                     f"{', '.join(t['unpinned'] + ['load generator']) if t['unpinned'] else 'n/a'}")
    rows: list[tuple[str, list[Any], bool]] = []

    def row(label: str, get, ratio: bool = False) -> None:
        values = []
        for name in names:
            try:
                values.append(get(tops[name]))
            except (KeyError, TypeError):
                values.append(None)
        rows.append((label, values, ratio))

    row("short completed", lambda t: t["short"]["completed"])
    row("short failed/unfinished/dropped",
        lambda t: f"{t['short']['failed']}/{t['short']['unfinished']}/{t['short'].get('dropped_at_cap', 0)}")
    for q in PERCENTILES:
        row(f"ITL p{q} [ms]", lambda t, q=q: t["short"]["itl_ms"][f"p{q}"], True)
    for q in PERCENTILES:
        row(f"TTFT p{q} [ms]", lambda t, q=q: t["short"]["ttft_ms"][f"p{q}"], True)
    row("output tokens/s (short+long)", lambda t: t["output_tokens_per_s"], True)
    row("long completed", lambda t: t["long"]["completed"])
    row("long e2e p50 [s]", lambda t: t["long"]["e2e_s"]["p50"], True)

    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3f}"
        return str(v)

    show_ratio = set(names) == {"colocated", "disagg"}
    header = f"  {'':32s}" + "".join(f"{n:>14s}" for n in names) + (f"{'disagg/coloc.':>16s}" if show_ratio else "")
    lines += ["", header]
    for label, values, ratio in rows:
        line = f"  {label:32s}" + "".join(f"{fmt(v):>14s}" for v in values)
        if show_ratio and ratio:
            r = _ratio(values[names.index("disagg")], values[names.index("colocated")])
            line += f"{(f'{r:.2f}x' if r is not None else '-'):>16s}"
        lines.append(line)
    comp = results["comparison"]
    if comp.get("available"):
        lines += ["", f"disagg/colocated: p95 ITL {comp['p95_itl_ratio_disagg_over_colocated']:.2f}x, throughput "
                  f"{comp['throughput_ratio_disagg_over_colocated']:.2f}x; target ({comp['target']}): "
                  f"{'met' if comp['target_met'] else 'not met'}"]
    for name in names:
        t = tops[name]
        if t.get("error"):
            lines.append(f"ERROR {name}: {t['error']}")
        elif t.get("errors"):
            lines.append(f"{name}: request errors (first {len(t['errors'])}): {'; '.join(t['errors'])}")
    lines += [f"note: {n}" for n in results["notes"]]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from loadtest.bench_engine import machine_info

    args = resolve_args(args)
    model_dir = prepare_model(args)
    model = describe_model(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    schedule = make_schedule(args, tokenizer)
    check_lengths(args, model, schedule["short_prompt_tokens"]["max"])
    machine = machine_info("cpu")
    machine["worker_threads"] = args.worker_threads
    served_name = "bench-interference"
    n_workers = {"colocated": args.colocated_workers, "disagg": args.disagg_prefill + args.disagg_decode}
    notes = [
        "each worker process (role prefill/decode) is pinned to one core, all its threads, with "
        f"OMP_NUM_THREADS={args.worker_threads}; NATS, the scheduler, the gateway and the load generator are not "
        f"pinned and share cores {args.cores} with the workers",
        "ITL = gaps between successive SSE chunks carrying text, pooled over completed short requests; "
        "TTFT = request sent -> first text chunk; throughput = output tokens of completed requests (short+long) / "
        "max(--duration, time from the start of the window to the last completion)",
        "the 'metrics' of each topology are the gateway's /metrics counters after the load, warm-up included (the "
        "gateway asks every service for them as /metrics is read)",
    ]
    for top in args.topologies:
        if n_workers[top] > len(args.cores):
            notes.append(f"{top}: {n_workers[top]} workers but only {len(args.cores)} core(s) given: "
                         "workers share cores")

    print(f"model {model_dir}: {model['model_type']}, "
          f"{model['num_parameters']:,} parameters" if model["num_parameters"] else f"model {model_dir}", flush=True)

    config = {
        "preset": args.preset,
        "model_arg": args.model,
        "topologies": args.topologies,
        "duration": args.duration,
        "short_rate": args.short_rate,
        "short_prompt_tokens": args.short_prompt_tokens,
        "short_prompt_tokens_actual": schedule["short_prompt_tokens"],
        "short_max_tokens": args.short_max_tokens,
        "long_every": args.long_every,
        "long_prompt_tokens": args.long_prompt_tokens,
        "long_max_tokens": args.long_max_tokens,
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "short_scheduled": schedule["short_scheduled"],
        "long_scheduled": schedule["long_scheduled"],
        "colocated_workers": args.colocated_workers,
        "disagg_prefill": args.disagg_prefill,
        "disagg_decode": args.disagg_decode,
        "max_local_prefill": args.max_local_prefill,
        "kv_transport": args.kv_transport,
        "dtype": args.dtype,
        "cores": args.cores,
        "worker_threads": args.worker_threads,
        "warmup": args.warmup,
        "ready_timeout": args.ready_timeout,
        "drain_timeout": args.drain_timeout,
        "request_timeout": args.request_timeout,
        "stop_timeout": args.stop_timeout,
        "temperature": 0.0,
        "ignore_eos": True,
    }

    if args.run_dir_root:
        run_root = Path(args.run_dir_root).resolve()
        run_root.mkdir(parents=True, exist_ok=True)
        remove_root = False
    else:
        run_root = Path(tempfile.mkdtemp(prefix="bench-interference-"))
        remove_root = True
    topologies: dict[str, dict[str, Any]] = {}
    try:
        for top in args.topologies:
            topologies[top] = run_topology(top, args, model_dir, served_name, schedule, run_root)
    finally:
        all_ok = len(topologies) == len(args.topologies) and all(t["ok"] for t in topologies.values())
        if all_ok and not args.keep_run_dirs:
            for top in topologies:
                shutil.rmtree(run_root / top, ignore_errors=True)
            if remove_root:
                shutil.rmtree(run_root, ignore_errors=True)
        else:
            print(f"run directories (logs) kept in {run_root}", flush=True)
    return {
        "benchmark": "interference",
        "config": config,
        "machine": machine,
        "model": model,
        "topologies": topologies,
        "comparison": compare(topologies),
        "notes": notes,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def on_sigterm(signum, frame):  # tear the deployments down as for Ctrl-C
        raise KeyboardInterrupt(f"signal {signum}")

    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        results = run(args)
    except KeyboardInterrupt as exc:  # the deployments were torn down on the way out
        print(f"bench_interference: interrupted ({exc or 'Ctrl-C'})", file=sys.stderr, flush=True)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print(format_report(results), flush=True)
    if args.output:
        path = Path(args.output)
        if path.parent != Path(""):
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")
        print(f"results written to {path}", flush=True)
    return 0 if all(t["ok"] for t in results["topologies"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
