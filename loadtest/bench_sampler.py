"""The sampler's cost per step, and its race noise drawn two ways side by side.

A sampled row (temperature > 0) draws one Exp(1) per vocabulary entry from a generator seeded by (seed, step):
`exponential_` on the CPU generator, or a uniform draw U and -log(1 - U) (the inverse CDF; the same distribution).
This times both noise draws and the whole `sample()` (which uses the second) for a few batch sizes, in one run.

    .venv/bin/python loadtest/bench_sampler.py --vocab 49152 --output loadtest/results/sampler_cpu_epyc.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from shared.engine.sampler import SamplingRow, row_seed, sample
from shared.engine.sampling_params import SamplingParams


def _time_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1000, 3)


def noise_exponential(rows: int, vocab: int) -> torch.Tensor:
    noise, generator = torch.empty(rows, vocab), torch.Generator()
    for i in range(rows):
        generator.manual_seed(row_seed(i, 10))
        noise[i].exponential_(generator=generator)
    return noise


def noise_uniform_log(rows: int, vocab: int) -> torch.Tensor:
    noise, generator = torch.empty(rows, vocab), torch.Generator()
    for i in range(rows):
        generator.manual_seed(row_seed(i, 10))
        noise[i].uniform_(generator=generator)
    return noise.neg_().log1p_().neg_()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {"vocab": args.vocab, "threads": args.threads, "batches": []}
    for batch in (int(b) for b in args.batches.split(",")):
        logits = torch.randn(batch, args.vocab)
        sampled = [SamplingRow(SamplingParams(temperature=0.8, seed=i), i, [1], [1] * 10) for i in range(batch)]
        greedy = [SamplingRow(SamplingParams(temperature=0.0), i, [1], [1] * 10) for i in range(batch)]
        figures = {
            "batch": batch,
            "noise_exponential_ms": _time_ms(lambda: noise_exponential(batch, args.vocab), args.repeats),
            "noise_uniform_log_ms": _time_ms(lambda: noise_uniform_log(batch, args.vocab), args.repeats),
            "sample_temperature_0_8_ms": _time_ms(lambda: sample(logits, sampled), args.repeats),
            "sample_greedy_ms": _time_ms(lambda: sample(logits, greedy), args.repeats),
        }
        results["batches"].append(figures)
        print(json.dumps(figures))
    if args.output:
        args.output.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
