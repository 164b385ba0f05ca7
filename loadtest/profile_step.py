"""Where a decode step's time goes: matmul, attention (KV gather, write, kernel), layer ops, Python.

Runs the engine alone (no services) on `--model` with `--batch` sequences
decoding together, profiles `--steps` decode steps with torch.profiler, and
splits each step's wall time into:

- matmul: the linear layers' GEMMs (aten::mm/addmm, oneDNN's packed linear)
- attention: SDPA, the KV gather (index_select) and write (index_copy_), and the
  compiled decode kernel
- layer ops: the other tensor ops (norms, rotary, activation, residual adds),
  compiled or torch
- python: the rest (scheduling, sampling, dispatch, detokenizing)

It also measures this machine's memory bandwidth (a large copy, same threads)
and reports the floor a step cannot beat: the weights read once per step.
Works on any commit of the engine (compiled kernels are labelled when present),
so the same command profiles before and after a change.

    python -m loadtest.profile_step --model smollm2-135m-instruct --batch 1,16 --threads 2
"""

import argparse
import json
import random
import time

import services  # noqa: F401  (before torch: the process settings the workers run with, e.g. large pages)
import torch

MATMUL_OPS = ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise", "mkl::_mkl_linear", "native small linear")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
                 "aten::index_select", "aten::index_copy_", "native decode attention", "native prefill attention")
NATIVE_LABELS = {"paged_decode_attention": "native decode attention", "paged_prefill_attention": "native prefill attention",
                 "add_rms_norm": "native layer ops",
                 "rotary": "native layer ops", "silu_and_mul": "native layer ops", "small_linear": "native small linear"}


def label_native_kernels() -> None:
    """Wrap the compiled kernels' ctypes functions in profiler ranges (they are invisible to torch otherwise)."""
    try:
        from shared.engine import kernels
    except ImportError:
        return
    for name in ("paged_decode", "paged_prefill", "layer_ops", "small_linear"):
        library = kernels.native_library(name)
        if library is None:
            continue
        for function, label in NATIVE_LABELS.items():
            if hasattr(library, function):
                setattr(library, function, _labelled(getattr(library, function), label))


def _labelled(function, label):
    def call(*args):
        with torch.profiler.record_function(label):
            return function(*args)
    return call


def memory_bandwidth_gbs(threads: int, num_bytes: int = 1 << 29) -> float:
    src = torch.empty(num_bytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best / 1e9  # read + write


def profile(model: str, dtype: str, batch: int, steps: int, prompt_len: int) -> dict:
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, max_num_seqs=max(batch, 1), kv_cache_bytes=512 << 20))
    rng = random.Random(0)
    vocab = engine.vocab_size
    for i in range(batch):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True))
    while any(engine.get_sequence(f"r{i}").num_computed_tokens < prompt_len for i in range(batch)):
        engine.step()
    for _ in range(3):
        engine.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
    totals = {"matmul": 0.0, "attention": 0.0, "layer ops": 0.0}
    for event in prof.key_averages():
        self_us = event.self_cpu_time_total
        if event.key in MATMUL_OPS:
            totals["matmul"] += self_us
        elif event.key in ATTENTION_OPS:
            totals["attention"] += self_us
        elif event.key.startswith("aten::") or event.key == "native layer ops":
            totals["layer ops"] += self_us
    per_step = {k: v / 1000 / steps for k, v in totals.items()}
    # The profiler's own bookkeeping inflates the wall time; report the step time of an unprofiled run too.
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_ms = (time.perf_counter() - start) * 1000 / steps
    profiled_ms = wall * 1000 / steps
    per_step["python"] = max(profiled_ms - sum(per_step.values()), 0.0)
    sizes = [r.loaded.parameter_bytes for r in engine.executor.runners]
    weight_bytes = sum(size() if callable(size) else size for size in sizes)  # a method on older commits
    return {"batch": batch, "dtype": dtype, "step_ms": step_ms, "profiled_step_ms": profiled_ms,
            "breakdown_ms": per_step, "weight_bytes": weight_bytes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model directory or a known model's name")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", default="1,16", help="comma-separated numbers of sequences decoding together")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output", help="write the results as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        from shared.engine.model_registry import resolve_model
        model = str(resolve_model(args.model).model_dir)
    except ImportError:
        model = args.model
    label_native_kernels()
    bandwidth = memory_bandwidth_gbs(args.threads)
    results = {"model": args.model, "threads": args.threads, "memory_bandwidth_gbs": bandwidth, "runs": []}
    for batch in (int(b) for b in args.batch.split(",")):
        run = profile(model, args.dtype, batch, args.steps, args.prompt_len)
        run["weights_floor_ms"] = run["weight_bytes"] / bandwidth / 1e6
        results["runs"].append(run)
        parts = ", ".join(f"{k} {v:.1f}" for k, v in run["breakdown_ms"].items())
        print(f"batch {batch} {args.dtype}: step {run['step_ms']:.1f} ms (profiled {run['profiled_step_ms']:.1f}: "
              f"{parts}); weights {run['weight_bytes'] / 1e6:.0f} MB, read floor {run['weights_floor_ms']:.1f} ms "
              f"at {bandwidth:.1f} GB/s", flush=True)
    if args.output:
        with open(args.output, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
