"""`splitserve bench compare`: one workload against several topologies in turn, side by side.

Each configuration is started with `splitserve up` (its flags after the name:
`disagg`, `colocated`, `pipeline` are presets, `NAME=FLAGS` any other) on
--cores (`up --cpus`: up shares them out among the model workers and pairs
their CPU loans; --no-pin leaves placement to the OS), served the same
workload (same seed, same prompts, same sampling), and stopped before the
next. The figures print as one table and go to --out; --plot draws every
configuration's latency CDFs in one figure. This is the seed experiment:
colocated vs disaggregated on the same hardware. With --sweep-rates each
configuration is swept (the same rates and workloads for all) and the table
shows attainment and goodput per rate and each one's max rate at --attainment.

    splitserve bench compare --configs colocated,disagg --dataset mixed --num-prompts 60 --request-rate 2 \\
        --out compare.json --plot compare.png
"""

import argparse
import json
import os
import shutil
import shlex
import sys
import tempfile
from pathlib import Path

from services.bench import serve as bench_serve
from services.bench.sweep import format_compare_table
from services.bench.up_process import UpProcess

PRESETS = {
    "colocated": ["--topology", "colocated", "--decode", "2"],
    "disagg": ["--topology", "disagg", "--prefill", "1", "--decode", "1"],
    "pipeline": ["--topology", "pipeline", "--stages", "2"],
}
ROWS = (("completed", "completed", "{:.0f}"), ("failed", "failed", "{:.0f}"),
        ("request_throughput", "requests/s", "{:.2f}"), ("output_throughput", "output tok/s", "{:.1f}"),
        ("goodput", "goodput req/s", "{:.2f}"), ("slo_attainment", "SLO attainment", "{:.0%}"))
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")


def add_parser_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", default="colocated,disagg",
                        help=f"comma-separated: presets ({', '.join(PRESETS)}) or NAME=FLAGS for `splitserve up` "
                             "(default: colocated,disagg)")
    parser.add_argument("--model", metavar="NAME|DIR|FILE.gguf",
                        help="a known model's name, a model directory or a .gguf file, as `splitserve up` takes "
                             "(default: smollm2-135m-instruct)")
    parser.add_argument("--up-args", default="", help="more `splitserve up` flags for every configuration")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--cores", help="the cores the deployment's model workers share (up --cpus; default: all)")
    parser.add_argument("--no-pin", action="store_true", help="no --cpus: the OS places the workers")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--run-dir-root", help="where the deployments' run directories go (default: a temp dir)")
    bench_serve.add_workload_options(parser)
    parser.add_argument("--out", help="write every configuration's figures and requests here (JSON)")
    parser.add_argument("--plot", help="draw the latency CDFs of every configuration here (PNG)")


def parse_configs(text: str) -> dict[str, list[str]]:
    configs = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, flags = item.partition("=")
        if flags:
            configs[name] = shlex.split(flags)
        elif name in PRESETS:
            configs[name] = PRESETS[name]
        else:
            raise SystemExit(f"unknown configuration {name!r}: use a preset ({', '.join(PRESETS)}) or NAME=FLAGS")
    if not configs:
        raise SystemExit("--configs names no configuration")
    return configs


def run_config(name: str, flags: list[str], args, model_dir: str, run_root: Path) -> dict:
    # up places the workers itself (each its share of --cores, idle CPUs lent): pinning every thread of a
    # worker afterwards would stack a borrowed OpenMP team on one core.
    placement = [] if args.no_pin else ["--cpus", ",".join(map(str, args.cores))]
    deployment = UpProcess(name, [*flags, *placement, *shlex.split(args.up_args)], model_dir=model_dir,
                           served_name="bench", run_dir=run_root / "".join(c if c.isalnum() else "-" for c in name),
                           dtype=args.dtype, worker_threads=len(args.cores), ready_timeout_s=args.ready_timeout,
                           stop_timeout_s=30.0)
    print(f"\n== {name}: splitserve up {' '.join(deployment.cmd[4:])}", flush=True)
    try:
        deployment.start()
        deployment.wait_ready(args.ready_timeout + 30)
        bench_args = argparse.Namespace(**{**vars(args), "url": deployment.base_url, "model": "bench",
                                           "tokenizer": args.tokenizer or model_dir})
        result = bench_serve.run(bench_args)
        result["config"], result["flags"] = name, flags
        print(bench_serve.report(result, title=name), flush=True)
        return result
    finally:
        teardown = deployment.stop()
        if not teardown["clean"]:
            print(f"   teardown was not clean: {teardown}", flush=True)


def format_table(results: dict[str, dict]) -> str:
    if any("sweep" in result for result in results.values()):
        return format_compare_table(results)
    names = list(results)
    lines = ["| metric | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for key, label, fmt in ROWS:
        cells = ["-" if results[n].get(key) is None else fmt.format(results[n][key]) for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for key in LATENCIES:
        for stat in ("mean", "p50", "p90", "p99"):
            cells = ["-" if results[n][key][stat] is None else f"{results[n][key][stat]:.1f}" for n in names]
            lines.append(f"| {key.removesuffix('_ms').upper()} {stat} ms | " + " | ".join(cells) + " |")
    for phase in dict.fromkeys(phase for n in names for phase in results[n].get("phases", {})):  # a trace's
        attained = [results[n].get("phases", {}).get(phase, {}).get("slo_attainment") for n in names]
        lines.append(f"| SLO attainment, {phase} | " + " | ".join("-" if a is None else f"{a:.0%}" for a in attained)
                     + " |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from shared.engine import resolve_model

    configs = parse_configs(args.configs)
    bench_serve.check(args)
    args.cores = [int(c) for c in args.cores.split(",")] if args.cores else sorted(os.sched_getaffinity(0))
    model_dir = str(resolve_model(args.model).model_dir)  # fetched or converted once, before any deployment
    run_root = Path(args.run_dir_root or tempfile.mkdtemp(prefix="splitserve-compare-"))
    results = {}
    for name, flags in configs.items():
        try:
            results[name] = run_config(name, flags, args, model_dir, run_root)
        except Exception as exc:  # noqa: BLE001 -- reported; the other configurations still run
            print(f"   {name} failed: {type(exc).__name__}: {exc}", flush=True)
            results[name] = None
    done = {name: result for name, result in results.items() if result is not None}
    if done:
        print("\n" + format_table(done))
    if args.out:
        Path(args.out).write_text(json.dumps({"configs": {n: configs[n] for n in configs}, "results": results},
                                             indent=2))
        print(f"wrote {args.out}")
    if args.plot and done:
        bench_serve.plot_cdfs({label: run for name, result in done.items()
                               for label, run in bench_serve.cdf_series(name, result).items()}, args.plot)
        print(f"wrote {args.plot}")
    ok = len(done) == len(results) and all(r["completed"] for r in done.values())
    if args.run_dir_root or not ok:
        print(f"the deployments' run directories (their logs) are in {run_root}")
    else:  # a temporary directory of its own, nothing failed: nothing to look at, nothing left behind
        shutil.rmtree(run_root, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_parser_options(parser)
    sys.exit(main(parser.parse_args()))
