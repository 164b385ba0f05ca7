"""What per-instance identity costs (issue 35, item 6): throughput and latency at concurrency 16, side by side.

Three deployments of one model and topology, each run `--reps` times in turn (A B C A B C ...) so that the
machine's drift falls on all alike:

- `before`: the version before per-instance identity (`--before REV`, checked out into a temporary worktree): one
  key per role, the worker's own assignment believed;
- `identity`: this checkout as shipped: a key per instance, every request's events signed and checked against
  the scheduler's assignment, the registry hardened;
- `open`: this checkout with `--no-nats-auth` (no keys, no permissions: what the checks cost beyond them).

Each run: `splitserve bench` with the random dataset, `--num-prompts` prompts of `--input-len` tokens,
`--output-len` output tokens each (EOS ignored, greedy), `--concurrency` in flight.

    python -m loadtest.bench_auth --before f168c3c --out loadtest/results/auth_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from services.bench.up_process import ROOT, serving


def bench(url: str, args: argparse.Namespace, out: Path, num_prompts: int | None = None,
          output_len: int | None = None) -> dict:
    command = [sys.executable, "-m", "services.cli.main", "bench", "--url", url.removesuffix("/v1"), "--model",
               "bench", "--dataset", "random", "--num-prompts", str(num_prompts or args.num_prompts), "--input-len",
               str(args.input_len), "--output-len", str(output_len or args.output_len), "--range-ratio", "0",
               "--ignore-eos",
               "--temperature", "0", "--request-rate", "inf", "--max-concurrency", str(args.concurrency),
               "--no-progress", "--out", str(out)]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    result = json.loads(out.read_text())
    return {key: result[key] for key in ("completed", "failed", "output_throughput", "ttft_ms", "itl_ms")}


def main(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="bench-auth-"))
    before = work / "before"
    subprocess.run(["git", "worktree", "add", "--detach", str(before), args.before], cwd=ROOT, check=True,
                   capture_output=True)
    variants = {"before": (before, []), "identity": (ROOT, []), "open": (ROOT, ["--no-nats-auth"])}
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    try:
        for rep in range(args.reps):
            for name, (root, flags) in variants.items():
                with serving(f"{name}-{rep}", [*args.up_args.split(), *flags], model_dir=args.model,
                             run_dir=work / f"run-{name}-{rep}", dtype=args.dtype, root=root) as deployment:
                    # The first steps of each batch size, and the caches: a short run first.
                    bench(deployment.base_url, args, work / f"warm-{name}-{rep}.json", args.concurrency, 16)
                    figures = bench(deployment.base_url, args, work / f"{name}-{rep}.json")
                runs[name].append(figures)
                print(f"   {name} #{rep}: {figures['output_throughput']:.1f} tok/s, "
                      f"TTFT p50 {figures['ttft_ms']['p50']:.0f} ms, ITL p50 {figures['itl_ms']['p50']:.1f} ms",
                      flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, capture_output=True)
    table = report(runs, args)
    print("\n" + table)
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "runs": runs, "table": table}, indent=2))
        print(f"wrote {args.out}")
    return 0


def report(runs: dict[str, list[dict]], args: argparse.Namespace) -> str:
    def median(name: str, pick) -> float:
        return statistics.median(pick(r) for r in runs[name])

    base = median("before", lambda r: r["output_throughput"])
    lines = [f"{args.num_prompts} requests x {args.output_len} tokens ({args.input_len}-token prompts), concurrency "
             f"{args.concurrency}, `up {args.up_args}`, {args.dtype}; median of {args.reps} runs each (spread)",
             "", "| | output tok/s | vs before | TTFT p50 ms | ITL p50 ms | ITL p99 ms | failed |",
             "|---|---|---|---|---|---|---|"]
    for name in runs:
        tput = [r["output_throughput"] for r in runs[name]]
        lines.append(f"| {name} | {median(name, lambda r: r['output_throughput']):.1f} ({min(tput):.0f}-{max(tput):.0f})"
                     f" | {median(name, lambda r: r['output_throughput']) / base:.3f}x"
                     f" | {median(name, lambda r: r['ttft_ms']['p50']):.0f}"
                     f" | {median(name, lambda r: r['itl_ms']['p50']):.1f}"
                     f" | {median(name, lambda r: r['itl_ms']['p99']):.1f}"
                     f" | {sum(r['failed'] for r in runs[name])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="f168c3c", help="the version to compare with (a git revision)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--up-args", default="--topology colocated", help="the deployment's topology flags")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", help="write the runs and the table here (JSON)")
    sys.exit(main(parser.parse_args()))
