"""Where a decode step's time goes (matmul, attention, KV write, layer ops, Python), and a burst's prefill's.

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

`--burst N` profiles a burst instead: N prompts of --prompt-len tokens arriving
together, every prefill step until all are prefilled, split the same way; its
floor is compute: the prefill's FLOPs (2 x parameters x tokens, plus attention's
2 x 2 x layers x hidden x the causal pairs) at this machine's matmul peak,
measured in the same run (a large GEMM in the dtype, same threads).
Works on any commit of the engine (compiled kernels are labelled when present),
so the same command profiles before and after a change.

    python -m loadtest.profile_step --model smollm2-135m-instruct --batch 1,16 --threads 2
    python -m loadtest.profile_step --model smollm2-135m-instruct --burst 64 --prompt-len 512 --dtype bfloat16
"""

import argparse
import json
import random
import time

import services  # noqa: F401  (before torch: the process settings the workers run with, e.g. large pages)
import torch

MATMUL_OPS = ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise", "mkl::_mkl_linear", "native small linear")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
                 "aten::index_select", "native decode attention", "native prefill attention")
KV_WRITE_OPS = ("aten::index_copy_",)
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


def matmul_peak_gflops(dtype: str, size: int = 2048, repeats: int = 5) -> float:
    """The best FLOP/s of a large square GEMM in `dtype` on this process's threads: the prefill's ceiling."""
    a = torch.randn(size, size).to(getattr(torch, dtype))
    b = torch.randn(size, size).to(getattr(torch, dtype))
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def _engine(model: str, dtype: str, sequences: int, prompt_len: int, max_tokens: int):
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, max_num_seqs=max(sequences, 1),
                                    kv_cache_bytes=max(512 << 20, sequences * (prompt_len + max_tokens) * 64 << 10)))
    rng = random.Random(0)
    for i in range(sequences):
        prompt = [rng.randrange(3, engine.vocab_size) for _ in range(prompt_len)]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return engine


def _prefilled(engine, sequences: int, prompt_len: int) -> bool:
    return all(engine.get_sequence(f"r{i}").num_computed_tokens >= prompt_len for i in range(sequences))


def breakdown_us(prof) -> dict[str, float]:
    """The profile's self CPU time (us) per kind of work."""
    totals = {"matmul": 0.0, "attention": 0.0, "kv write": 0.0, "layer ops": 0.0}
    for event in prof.key_averages():
        self_us = event.self_cpu_time_total
        if event.key in MATMUL_OPS:
            totals["matmul"] += self_us
        elif event.key in ATTENTION_OPS:
            totals["attention"] += self_us
        elif event.key in KV_WRITE_OPS:
            totals["kv write"] += self_us
        elif event.key.startswith("aten::") or event.key == "native layer ops":
            totals["layer ops"] += self_us
    return totals


def prefill_flops(config, sequences: int, prompt_len: int) -> float:
    """A burst's prefill FLOPs: every prompt token through every layer's projections and MLP (2 per multiply-add;
    the embedding is a lookup, the LM head runs on each prompt's last token only), and attention's scores and
    weighted sum over each prompt's causal pairs."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv_width = config.num_key_value_heads * head_dim
    per_token = 2 * layers * (2 * hidden * hidden + 2 * hidden * kv_width + 3 * hidden * config.intermediate_size)
    pairs = prompt_len * (prompt_len + 1) / 2
    attention = 2 * 2 * layers * config.num_attention_heads * head_dim * pairs
    return sequences * (per_token * prompt_len + attention + 2 * hidden * config.vocab_size)


def profile_burst(model: str, dtype: str, sequences: int, prompt_len: int) -> dict:
    """Every prefill step of `sequences` prompts arriving together, profiled, then the same burst unprofiled."""
    engine = _engine(model, dtype, sequences, prompt_len, max_tokens=2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start, steps = time.perf_counter(), 0
        while not _prefilled(engine, sequences, prompt_len):
            engine.step()
            steps += 1
        profiled_s = time.perf_counter() - start
    again = _engine(model, dtype, sequences, prompt_len, max_tokens=2)
    start = time.perf_counter()
    while not _prefilled(again, sequences, prompt_len):
        again.step()
    wall_s = time.perf_counter() - start
    parts_ms = {k: v / 1000 for k, v in breakdown_us(prof).items()}
    parts_ms["python"] = max(profiled_s * 1000 - sum(parts_ms.values()), 0.0)
    return {"burst": sequences, "prompt_len": prompt_len, "dtype": dtype, "steps": steps, "wall_ms": wall_s * 1000,
            "profiled_ms": profiled_s * 1000, "breakdown_ms": parts_ms,
            "flops": prefill_flops(engine.model_config, sequences, prompt_len)}


def profile(model: str, dtype: str, batch: int, steps: int, prompt_len: int) -> dict:
    engine = _engine(model, dtype, batch, prompt_len, max_tokens=steps + 64)
    while not _prefilled(engine, batch, prompt_len):
        engine.step()
    for _ in range(3):
        engine.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
    per_step = {k: v / 1000 / steps for k, v in breakdown_us(prof).items()}
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


def report_burst(model: str, args) -> int:
    peak = matmul_peak_gflops(args.dtype)
    run = profile_burst(model, args.dtype, args.burst, args.prompt_len)
    floor_ms = run["flops"] / peak / 1e6
    parts = ", ".join(f"{k} {v:.0f}" for k, v in run["breakdown_ms"].items())
    print(f"burst of {args.burst} x {args.prompt_len} tokens, {args.dtype}: {run['wall_ms']:.0f} ms in {run['steps']} "
          f"steps (profiled {run['profiled_ms']:.0f} ms: {parts}); {run['flops'] / 1e9:.0f} GFLOP, compute floor "
          f"{floor_ms:.0f} ms at the measured matmul peak {peak:.0f} GFLOP/s "
          f"({floor_ms / run['wall_ms']:.0%} of it reached)", flush=True)
    if args.output:
        with open(args.output, "w") as fh:
            json.dump({"model": args.model, "threads": args.threads, "matmul_peak_gflops": peak,
                       "compute_floor_ms": floor_ms, **run}, fh, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model directory or a known model's name")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", default="1,16", help="comma-separated numbers of sequences decoding together")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--burst", type=int, help="profile the prefill of this many prompts arriving together "
                        "instead of decode steps")
    parser.add_argument("--output", help="write the results as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        from shared.engine.model_registry import resolve_model
        model = str(resolve_model(args.model).model_dir)
    except ImportError:
        model = args.model
    label_native_kernels()
    if args.burst:
        return report_burst(model, args)
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
