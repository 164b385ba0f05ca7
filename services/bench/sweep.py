"""`splitserve bench --sweep-rates R1,R2,...`: the workload at each rate in turn, and the highest rate at which
--attainment of the requests met both SLOs (see services/bench/goodput.py for how it is read).

Each rate gets new prompts and arrivals (the seed plus SEED_STRIDE times the rate's index), so that a prefix
cache warmed at one rate does not flatter the next; the same rate gets the same workload in every run and every
configuration of `bench compare`.
"""

import argparse

from services.bench import goodput
from services.bench.datasets import build_dataset

SEED_STRIDE = 1000


def sweep_problem(args: argparse.Namespace) -> str | None:
    """Why `args` cannot be swept, or None."""
    if args.slo_ttft_ms is None and args.slo_tpot_ms is None:
        return "--sweep-rates needs an SLO to attain: --slo-ttft-ms and/or --slo-tpot-ms"
    if args.dataset == "shifting":
        return "the shifting trace has its own rates (scale them with --trace-rate-scale): no --sweep-rates"
    if not 0 < args.attainment <= 1:
        return "--attainment is a share of requests, in (0, 1]"
    return None


def run_sweep(base: str, model: str, tokenizer, args: argparse.Namespace, measure) -> dict:
    """`measure(base, model, conversations, args)` (services/bench/serve.py) at each of args.sweep_rates."""
    runs = []
    for index, rate in enumerate(args.sweep_rates):
        seed = args.seed + SEED_STRIDE * index
        rate_args = argparse.Namespace(**{**vars(args), "request_rate": rate, "seed": seed})
        print(f"-- {rate:g} req/s", flush=True)
        runs.append(measure(base, model, build_dataset(rate_args, tokenizer), rate_args))
    rows = [goodput.sweep_row(rate, run) for rate, run in zip(args.sweep_rates, runs)]
    return {"sweep": {**goodput.headline(rows, args.attainment), "slo_ttft_ms": args.slo_ttft_ms,
                      "slo_tpot_ms": args.slo_tpot_ms, "rows": rows},
            "completed": sum(run["completed"] for run in runs), "failed": sum(run["failed"] for run in runs),
            "model": model, "url": base, "endpoint": args.endpoint, "dataset": args.dataset, "runs": runs}


def _cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def format_headline(sweep: dict) -> str:
    target = f"{sweep['attainment_target']:.0%}"
    if sweep["max_rate"] is None:
        return f"max rate at >= {target} SLO attainment: none (the lowest rate swept missed it)"
    return (f"max rate at >= {target} SLO attainment: {sweep['max_rate']:g} req/s (a swept rate; interpolated "
            f"{sweep['max_rate_interpolated']:.2f} req/s)")


def format_sweep(result: dict, title: str = "splitserve bench sweep") -> str:
    sweep = result["sweep"]
    lines = [f"============ {title} ============",
             "| rate req/s | attainment | goodput req/s | req/s | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms "
             "| TPOT p90 ms | failed |", "|---" * 9 + "|"]
    for row in sweep["rows"]:
        cells = [f"{row['rate']:g}", _cell(row["slo_attainment"], "{:.0%}"), _cell(row["goodput"], "{:.2f}"),
                 f"{row['request_throughput']:.2f}",
                 *(_cell(row[key], "{:.1f}") for key in ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms")),
                 str(row["failed"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([*lines, format_headline(sweep)])


def format_compare_table(results: dict[str, dict]) -> str:
    """`bench compare` with a sweep: attainment and goodput per rate, and the headline, one column a config."""
    names = list(results)
    sweeps = [results[name]["sweep"] for name in names]
    lines = ["| metric | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    by_rate = [{row["rate"]: row for row in sweep["rows"]} for sweep in sweeps]
    for rate in sorted(set().union(*by_rate)):
        for key, label, fmt in (("slo_attainment", "attainment", "{:.0%}"), ("goodput", "goodput req/s", "{:.2f}")):
            cells = [_cell(rows[rate][key] if rate in rows else None, fmt) for rows in by_rate]
            lines.append(f"| {label} @ {rate:g} req/s | " + " | ".join(cells) + " |")
    target = f"{sweeps[0]['attainment_target']:.0%}"
    for key, label, fmt in (("max_rate", f"max rate @ {target}", "{:g}"),
                            ("max_rate_interpolated", f"max rate @ {target}, interpolated", "{:.2f}")):
        lines.append(f"| {label} | " + " | ".join(_cell(sweep[key], fmt) for sweep in sweeps) + " |")
    return "\n".join(lines)
