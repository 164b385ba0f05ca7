"""`splitserve bench`: a load generator for any OpenAI-compatible server.

It sends a dataset's requests (see `services/bench/datasets.py`) as streaming
completions or chat completions, arriving at --request-rate per second
(Poisson, or gamma with --burstiness; `inf` sends them all at once), at most
--max-concurrency at a time; a conversation's turns follow each other. It
reports TTFT, TPOT, ITL and E2E latency (mean, p50, p90, p95, p99), request and
token throughput and goodput (see `services/bench/metrics.py`), and writes
them with every request's record to --out; --plot draws the latency CDFs.
With --sweep-rates it runs the workload at each rate and reports each rate's
SLO attainment and the highest rate at which --attainment of the requests met
both SLOs (see `services/bench/sweep.py`); `--dataset shifting` replays a trace
whose mix and rate change, and reports each phase on its own.

    splitserve bench --url http://127.0.0.1:8000 --dataset random --num-prompts 200 --request-rate 4
    splitserve bench --dataset prefix --endpoint chat --out prefix.json --plot prefix.png
    splitserve bench --sweep-rates 0.5,1,2,4 --slo-ttft-ms 500 --slo-tpot-ms 100 --out sweep.json
    splitserve bench --dataset shifting --phase-seconds 30 --slo-ttft-ms 500 --slo-tpot-ms 100
"""

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path

from services.bench.goodput import parse_rates
from services.bench.metrics import RequestRecord, compute_metrics, metrics_by_phase, span_s
from services.bench.datasets import DATASETS, BenchRequest, build_dataset
from services.bench.sweep import format_sweep, run_sweep, sweep_problem


def add_workload_options(parser: argparse.ArgumentParser) -> None:
    """What is sent and how fast: shared by `splitserve bench` and `splitserve bench compare`."""
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    parser.add_argument("--dataset", default="random", help=f"one of {', '.join(DATASETS)} (default: random)")
    parser.add_argument("--num-prompts", type=int, default=100, help="requests (prefix: conversations; 0 = all)")
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens (prefix: a turn's question)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens")
    parser.add_argument("--range-ratio", type=float, default=0.0, help="lengths vary within +- this fraction")
    parser.add_argument("--long-input-len", type=int, default=2048, help="mixed: a long prompt's tokens")
    parser.add_argument("--long-output-len", type=int, default=64, help="mixed: a long request's output tokens")
    parser.add_argument("--long-fraction", type=float, default=0.1, help="mixed: the share of long prompts")
    parser.add_argument("--prefix-len", type=int, default=2000, help="prefix: a shared document's tokens")
    parser.add_argument("--prefix-groups", type=int, default=4, help="prefix: documents")
    parser.add_argument("--conversations-per-group", type=int, default=2, help="prefix: conversations per document")
    parser.add_argument("--turns", type=int, default=3, help="prefix: turns per conversation")
    parser.add_argument("--fixed-output-len", action="store_true", help="sharegpt: --output-len for every request")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests (conversations) per second; inf: all at once (default)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the gaps between arrivals: 1 is Poisson, < 1 burstier, > 1 steadier")
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", help="a local tokenizer directory (default: the served model's, if local)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly the output length (extension)")
    parser.add_argument("--extra-body", type=json.loads, default=None, metavar="JSON",
                        help="more fields for every request's body, a JSON object (server-specific options)")
    parser.add_argument("--slo-ttft-ms", type=float, help="goodput: a request must get its first token within this")
    parser.add_argument("--slo-tpot-ms", type=float, help="goodput: ... and its later tokens within this each")
    parser.add_argument("--sweep-rates", type=_rates, metavar="R1,R2,...",
                        help="run the workload at each of these request rates and report the highest at which "
                             "--attainment of the requests met both SLOs")
    parser.add_argument("--attainment", type=float, default=0.9,
                        help="the share of requests that must meet both SLOs at a rate (default: 0.9, DistServe's)")
    parser.add_argument("--phase-seconds", type=float, default=30.0, help="shifting: each phase's length")
    parser.add_argument("--trace-rate-scale", type=float, default=1.0, help="shifting: times every phase's rate")
    parser.add_argument("--decode-heavy-input-len", type=int, default=32, help="shifting: a decode-heavy prompt")
    parser.add_argument("--decode-heavy-output-len", type=int, default=512, help="shifting: ... and its output")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_parser_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (with or without /v1)")
    parser.add_argument("--model", help="the model name to ask for (default: the server's first)")
    add_workload_options(parser)
    parser.add_argument("--out", help="write the figures and every request's record here (JSON)")
    parser.add_argument("--plot", help="draw the latency CDFs here (PNG; needs matplotlib)")


def arrival_times(count: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Offsets (s) at which `count` arrivals come: gamma-distributed gaps of mean 1/rate (Poisson at burstiness 1)."""
    if rate == float("inf") or count == 0:
        return [0.0] * count
    if rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    import numpy as np  # here, not at the top: every `splitserve` command builds this module's parser

    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=count)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def _rates(text: str) -> list[float]:
    try:
        return parse_rates(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def start_times(conversations: list[list[BenchRequest]], args) -> list[float]:
    """When each conversation starts (s): the workload's own arrival times where it has them (a trace), else
    arrivals at --request-rate."""
    if conversations and conversations[0][0].arrival_s is not None:
        return [conversation[0].arrival_s for conversation in conversations]
    return arrival_times(len(conversations), args.request_rate, args.burstiness, args.seed)


def resolve_tokenizer(path: str | None, model: str):
    """The tokenizer prompts are made with, or None (text of random words)."""
    from transformers import AutoTokenizer

    from shared.engine import ModelLoadError, resolve_model

    if path is None:
        try:  # a served name that is a known model's (in the cache) or a directory's
            path = str(resolve_model(model, fetch=False).model_dir)
        except ModelLoadError:
            return None
    return AutoTokenizer.from_pretrained(path)


def served_model(client, base: str) -> str:
    models = client.get(f"{base}/v1/models", timeout=30).json()["data"]
    if not models:
        raise SystemExit(f"{base} serves no model")
    return models[0]["id"]


async def send(client, base: str, model: str, request: BenchRequest, args, origin: float) -> RequestRecord:
    """One streaming request, timed with perf_counter seconds from `origin`."""
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": request.output_len, "temperature": args.temperature}
    if args.ignore_eos:
        body["ignore_eos"] = True
    body.update(args.extra_body or {})
    if args.endpoint == "chat":
        url, body["messages"] = f"{base}/v1/chat/completions", [{"role": "user", "content": request.text}]
    else:
        url, body["prompt"] = f"{base}/v1/completions", request.token_ids or request.text
    record = RequestRecord(sent=time.perf_counter() - origin, prompt_tokens=request.prompt_len)
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:300]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                now = time.perf_counter() - origin
                record.end = now  # the last data received (as vllm times a request's latency)
                chunk = json.loads(payload)
                if "error" in chunk:
                    record.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return record
                for choice in chunk.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content") if args.endpoint == "chat" else choice.get("text")
                    if text:
                        record.chunk_times.append(now)
                        record.text += text
                usage = chunk.get("usage")
                if usage:
                    record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
                    record.output_tokens = usage.get("completion_tokens", 0)
                    record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        if not record.output_tokens:
            record.output_tokens = len(record.chunk_times)
        if not record.chunk_times:
            record.error = "the stream ended without any text"
    except Exception as exc:  # noqa: BLE001 -- a failed request is counted, never fatal
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    return record


async def run_load(base: str, model: str, conversations: list[list[BenchRequest]], args) -> tuple[list, float]:
    """Send every conversation at its arrival time; returns [(request, record)] and the duration (s)."""
    import httpx
    from tqdm import tqdm

    starts = start_times(conversations, args)
    slots = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    total = sum(len(c) for c in conversations)
    progress = tqdm(total=total, disable=args.no_progress, desc="requests", unit="req")
    results: list[tuple[BenchRequest, RequestRecord]] = []
    limits = httpx.Limits(max_connections=min(total, args.max_concurrency or total) + 4)
    origin = time.perf_counter()

    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
        async def converse(start: float, conversation: list[BenchRequest]) -> None:
            await asyncio.sleep(max(0.0, start - (time.perf_counter() - origin)))
            for request in conversation:
                if slots is not None:
                    async with slots:
                        record = await send(client, base, model, request, args, origin)
                else:
                    record = await send(client, base, model, request, args, origin)
                results.append((request, record))
                progress.update(1)

        await asyncio.gather(*(converse(s, c) for s, c in zip(starts, conversations)))
    progress.close()
    return results, span_s([record for _, record in results], until=time.perf_counter() - origin)


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark; returns the result object (also written to --out)."""
    import httpx

    base = args.url.rstrip("/").removesuffix("/v1")
    with httpx.Client() as client:
        model = args.model or served_model(client, base)
    tokenizer = resolve_tokenizer(args.tokenizer, model)
    if args.sweep_rates:
        return run_sweep(base, model, tokenizer, args, measure)
    return measure(base, model, build_dataset(args, tokenizer), args)


def measure(base: str, model: str, conversations: list[list[BenchRequest]], args: argparse.Namespace) -> dict:
    """Send `conversations` to the server at `base` as `args` says; the figures and every request's record."""
    import numpy as np

    results, duration = asyncio.run(run_load(base, model, conversations, args))
    figures = compute_metrics([record for _, record in results], duration, args.slo_ttft_ms, args.slo_tpot_ms)
    in_order = sorted(results, key=lambda done: (done[0].conversation, done[0].turn))
    if any(request.phase for request, _ in in_order):
        figures["phases"] = metrics_by_phase([request.phase for request, _ in in_order],
                                             [record for _, record in in_order], args.slo_ttft_ms, args.slo_tpot_ms)
    return {
        **figures,
        "model": model, "url": base, "endpoint": args.endpoint, "dataset": args.dataset,
        "settings": {k: (str(v) if isinstance(v, float) and not np.isfinite(v) else v)  # "inf": valid JSON
                     for k, v in vars(args).items() if k not in ("run", "out", "plot")},
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "requests": [{"conversation": request.conversation, "turn": request.turn, "phase": request.phase,
                      "sent_s": record.sent,
                      "ttft_ms": record.ttft * 1000 if record.ok else None, "tpot_ms": _ms(record.tpot if record.ok else None),
                      "e2el_ms": record.e2el * 1000 if record.ok else None, "itl_ms": [g * 1000 for g in record.itls],
                      "prompt_tokens": record.prompt_tokens, "output_tokens": record.output_tokens,
                      "cached_tokens": record.cached_tokens, "text": record.text, "error": record.error}
                     for request, record in results],
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def format_report(result: dict, title: str = "splitserve bench") -> str:
    lines = [f"============ {title} ============",
             f"{'Successful requests:':<34}{result['completed']}",
             f"{'Failed requests:':<34}{result['failed']}",
             f"{'Benchmark duration (s):':<34}{result['duration_s']:.2f}",
             f"{'Total input tokens:':<34}{result['total_input_tokens']}",
             f"{'Total generated tokens:':<34}{result['total_output_tokens']}",
             f"{'Request throughput (req/s):':<34}{result['request_throughput']:.2f}",
             f"{'Output token throughput (tok/s):':<34}{result['output_throughput']:.2f}",
             f"{'Total token throughput (tok/s):':<34}{result['total_token_throughput']:.2f}"]
    if result["goodput"] is not None:
        lines.append(f"{'Request goodput (req/s):':<34}{result['goodput']:.2f}")
    if result["slo_attainment"] is not None:
        lines.append(f"{'SLO attainment:':<34}{result['slo_attainment']:.1%}")
    for key, label in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        lines.append(f"{'-' * 10}{label}{'-' * 10}")
        for stat, value in result[key].items():
            shown = "-" if value is None else f"{value:.2f}"
            lines.append(f"{(stat.capitalize() if stat == 'mean' else stat.upper()) + ' (ms):':<34}{shown}")
    if "phases" in result:
        lines.append(format_phases(result["phases"]))
    return "\n".join(lines)


def format_phases(phases: dict[str, dict]) -> str:
    lines = [f"{'-' * 10}Per phase{'-' * 10}",
             "| phase | completed | failed | req/s | attainment | TTFT p90 ms | TPOT p90 ms |", "|---" * 7 + "|"]
    for name, figures in phases.items():
        cells = [name, str(figures["completed"]), str(figures["failed"]), f"{figures['request_throughput']:.2f}",
                 "-" if figures["slo_attainment"] is None else f"{figures['slo_attainment']:.0%}",
                 *("-" if figures[key]["p90"] is None else f"{figures[key]['p90']:.1f}"
                   for key in ("ttft_ms", "tpot_ms"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(result: dict, title: str = "splitserve bench") -> str:
    """The result on stdout: a run's report, or a sweep's table."""
    if "sweep" in result:
        return format_sweep(result, title)
    return format_report(result, title)


def cdf_series(name: str, result: dict) -> dict[str, dict]:
    """The runs a result's CDFs are drawn from, by label: itself, or a sweep's run at each rate."""
    if "sweep" in result:
        return {f"{name} @ {row['rate']:g} req/s": run for row, run in zip(result["sweep"]["rows"], result["runs"])}
    return {name: result}


def plot_cdfs(results: dict[str, dict], path: str) -> None:
    """One figure: the CDF of TTFT, TPOT, ITL and E2E latency, one line per result (a configuration)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install 'splitserve[bench]'") from exc
    import numpy as np
    figure, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for axis, (key, label) in zip(axes, (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                                         ("e2el_ms", "E2E latency"))):
        for name, result in results.items():
            if key == "itl_ms":
                values = [gap for r in result["requests"] for gap in r["itl_ms"]]
            else:
                values = [r[key] for r in result["requests"] if r[key] is not None]
            if values:
                ordered = np.sort(values)
                axis.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered), label=name, drawstyle="steps-post")
        axis.set_xlabel(f"{label} (ms)")
        axis.set_ylabel("fraction of requests" if key != "itl_ms" else "fraction of gaps")
        axis.grid(alpha=0.3)
        axis.set_xscale("log")
        axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def check(args: argparse.Namespace) -> None:
    """Refuse options that do not go together, before anything is sent."""
    problem = sweep_problem(args) if args.sweep_rates else None
    if args.dataset == "shifting" and (args.phase_seconds <= 0 or args.trace_rate_scale < 0):
        problem = "the shifting trace needs --phase-seconds > 0 and --trace-rate-scale >= 0"
    if problem:
        raise SystemExit(f"error: {problem}")


def main(args: argparse.Namespace) -> int:
    check(args)
    result = run(args)
    print(report(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    if args.plot:
        plot_cdfs(cdf_series(result["model"], result), args.plot)
        print(f"wrote {args.plot}")
    return 0 if result["completed"] else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_parser_options(parser)
    sys.exit(main(parser.parse_args()))
