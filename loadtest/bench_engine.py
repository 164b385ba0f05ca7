"""Benchmark the splitserve engine against plain transformers `generate()`.

One run, one process, one machine: both sides load the same model in the same
dtype on the same device and run with the same torch thread count.

1. Decode latency at batch 1: one prompt, N greedy new tokens (EOS ignored).
   For each side, T(1) and T(N) are the medians over --repeats runs of the
   time to generate 1 and N tokens; ms/token = (T(N) - T(1)) / (N - 1), so
   prompt processing and per-call overhead cancel out. The engine side is
   driven with add_request + step(); the transformers side is
   `model.generate(do_sample=False, max_new_tokens=N, min_new_tokens=N,
   use_cache=True)` with EOS switched off (`eos_token_id=None`, which is
   exactly the engine's `ignore_eos`).
2. Throughput: --requests requests with prompt and output lengths drawn from
   --seed. The engine gets them all at once and steps until done (continuous
   batching). transformers runs static batches of --batch-size requests,
   left-padded with an attention mask; each batch generates the longest output
   length of the batch and each request's output is truncated to its own
   length. Output tokens/s = useful generated tokens (sum of the requested
   output lengths) / wall time.
3. Correctness: the batch-1 greedy tokens of both sides must be identical (a
   warning is printed otherwise); for throughput, how many requests got the
   same tokens on both sides is reported for information.

Without --model, a random-weight Llama is built locally with
`build_random_model` (and cached under $SPLITSERVE_CACHE_DIR, default
~/.cache/splitserve). The default tokenizer has a ~2k vocabulary and the
builder always sizes the embedding to it, so the 100m preset gets its
parameters from the decoder layers (16 layers of hidden 768).

    python -m loadtest.bench_engine --preset 100m --output bench.json
    python -m loadtest.bench_engine --preset tiny --requests 4   # quick check
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# Model shapes for build_random_model (parameter count printed at run time).
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # 16 x 6.29M decoder layers + 2 x 2048 x 768 embedding/head = 103,834,368 params.
    "100m": dict(
        model_type="llama",
        hidden_size=768,
        num_hidden_layers=16,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
        tie_word_embeddings=False,
    ),
    # 16 x 60.8M decoder layers + 2 x 2048 x 2048 embedding/head = 981M params: on a GPU, big enough that a
    # decode step reads its weights from HBM for longer than it launches kernels (the roofline check).
    "1b": dict(
        model_type="llama",
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        tie_word_embeddings=False,
    ),
}
MODEL_SEED = 0
# Bump when a preset shape or the build changes, so stale cached models are not reused.
MODEL_CACHE_VERSION = "v1"

# Workload defaults per preset; every one can be overridden by its flag.
WORKLOAD_PRESETS: dict[str, dict[str, Any]] = {
    "100m": dict(decode_prompt_len=128, decode_tokens=128, prompt_lens=(16, 512), output_lens=(16, 256), repeats=3),
    "1b": dict(decode_prompt_len=128, decode_tokens=128, prompt_lens=(16, 512), output_lens=(16, 256), repeats=3),
    "tiny": dict(decode_prompt_len=32, decode_tokens=16, prompt_lens=(8, 48), output_lens=(4, 16), repeats=3),
}

RESULT_KEYS = ("config", "machine", "model", "decode_batch1", "throughput", "correctness")


# ---------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_engine",
        description="Compare the splitserve engine with plain transformers generate() on one machine: "
        "batch-1 decode latency (ms/token), throughput on mixed requests (output tokens/s), "
        "and greedy token equality.",
    )
    parser.add_argument("--model", metavar="DIR", help="use this Hugging Face model directory instead of building a random one")
    parser.add_argument("--preset", choices=sorted(MODEL_PRESETS), default="100m",
                        help="random model shape to build (ignored for the model when --model is given) and the "
                        "workload defaults (default: 100m)")
    parser.add_argument("--device", default="cpu", help="torch device for both sides (default: cpu)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="weights and activations dtype for both sides (default: float32)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for both sides (default: torch's own choice)")
    parser.add_argument("--requests", type=int, default=32, help="number of throughput requests (default: 32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and lengths (default: 0)")
    parser.add_argument("--output", metavar="FILE.json", help="write the results as JSON here")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="transformers static batch size for the throughput test (default: 8)")
    parser.add_argument("--hf-order", choices=["given", "sorted"], default="given",
                        help="order of requests in transformers' static batches: as drawn, or sorted by "
                        "(output length, prompt length) descending to reduce padding waste (default: given)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="measured runs per measurement after the warm-up; the median is reported "
                        "(default: 3)")
    parser.add_argument("--decode-prompt-len", type=int, default=None, help="batch-1 prompt length (100m: 128)")
    parser.add_argument("--decode-tokens", type=int, default=None, help="batch-1 new tokens N, >= 2 (100m: 128)")
    parser.add_argument("--prompt-lens", type=int, nargs=2, metavar=("MIN", "MAX"), default=None,
                        help="throughput prompt lengths, uniform in [MIN, MAX] (100m: 16 512)")
    parser.add_argument("--output-lens", type=int, nargs=2, metavar=("MIN", "MAX"), default=None,
                        help="throughput output lengths, uniform in [MIN, MAX] (100m: 16 256)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="engine per-step token budget (default: EngineConfig's)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="engine max running sequences (default: EngineConfig's)")
    parser.add_argument("--kv-cache-gb", type=float, default=None,
                        help="engine KV cache size; default: sized so every throughput request fits at once")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="enable the engine's prefix cache (off by default: repeated runs reuse the same "
                        "prompts, which would turn the engine's prefills into cache hits)")
    return parser


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    workload = WORKLOAD_PRESETS[args.preset]
    for name, value in workload.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.prompt_lens = tuple(args.prompt_lens)
    args.output_lens = tuple(args.output_lens)
    problems = []
    if args.decode_tokens < 2:
        problems.append("--decode-tokens must be at least 2")
    if args.decode_prompt_len < 1:
        problems.append("--decode-prompt-len must be positive")
    for flag, (lo, hi) in (("--prompt-lens", args.prompt_lens), ("--output-lens", args.output_lens)):
        if not 1 <= lo <= hi:
            problems.append(f"{flag} needs 1 <= MIN <= MAX")
    for flag in ("requests", "batch_size", "repeats"):
        if getattr(args, flag) < 1:
            problems.append(f"--{flag.replace('_', '-')} must be positive")
    if args.threads is not None and args.threads < 1:
        problems.append("--threads must be positive")
    if problems:
        raise SystemExit("bench_engine: " + "; ".join(problems))
    return args


# ---------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------
def prepare_model(args: argparse.Namespace) -> str:
    """The model directory: --model, or the preset's random model (built once, cached)."""
    if args.model:
        return str(Path(args.model).resolve())
    from shared.engine.default_model import cache_root, file_lock, build_random_model

    models = cache_root() / "models"
    final = models / f"bench-{args.preset}-{MODEL_CACHE_VERSION}"
    if final.is_dir():
        return str(final)
    models.mkdir(parents=True, exist_ok=True)
    with file_lock(models / f".{final.name}.lock"):
        if not final.is_dir():
            print(f"building random {args.preset} model in {final} ...", flush=True)
            tmp = models / f".{final.name}.tmp-{os.getpid()}"
            try:
                build_random_model(tmp, seed=MODEL_SEED, **MODEL_PRESETS[args.preset])
                os.rename(tmp, final)
            except BaseException:
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
                raise
    return str(final)


def describe_model(model_dir: str, hf_model) -> dict[str, Any]:
    config = hf_model.config
    seen = {}
    for param in hf_model.parameters():
        seen[param.data_ptr()] = param.numel()
    return {
        "dir": model_dir,
        "model_type": config.model_type,
        "num_parameters": sum(seen.values()),
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", config.num_attention_heads),
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        "intermediate_size": getattr(config, "intermediate_size", None),
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "transformers_attn_implementation": getattr(config, "_attn_implementation", None),
    }


# ---------------------------------------------------------------------------------
# Machine
# ---------------------------------------------------------------------------------
def machine_info(device: str) -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity_count": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "device": device,
        "device_name": _cpu_model() if torch.device(device).type == "cpu" else None,
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if torch.device(device).type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(torch.device(device))
        info["cuda_version"] = torch.version.cuda
    return info


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


# ---------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------
def make_workload(args: argparse.Namespace, vocab_size: int, special_ids: set[int]) -> dict[str, Any]:
    rng = random.Random(args.seed)
    pool = [t for t in range(vocab_size) if t not in special_ids]

    def prompt(length: int) -> list[int]:
        return [rng.choice(pool) for _ in range(length)]

    decode_prompt = prompt(args.decode_prompt_len)
    prompt_lens = [rng.randint(*args.prompt_lens) for _ in range(args.requests)]
    output_lens = [rng.randint(*args.output_lens) for _ in range(args.requests)]
    prompts = [prompt(n) for n in prompt_lens]
    return {"decode_prompt": decode_prompt, "prompts": prompts, "prompt_lens": prompt_lens, "output_lens": output_lens}


# ---------------------------------------------------------------------------------
# Timing helpers
# ---------------------------------------------------------------------------------
class Clock:
    def __init__(self, device: str):
        import torch

        self._cuda = torch.device(device).type == "cuda"
        self._torch = torch

    def sync(self) -> None:
        if self._cuda:
            self._torch.cuda.synchronize()

    def now(self) -> float:
        self.sync()
        return time.perf_counter()


def _median(values: list[float]) -> float:
    return statistics.median(values)


# ---------------------------------------------------------------------------------
# Engine side
# ---------------------------------------------------------------------------------
class EngineSide:
    def __init__(self, engine, clock: Clock):
        self.engine = engine
        self.clock = clock
        self._ids = 0

    def _next_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}-{self._ids}"

    def generate_one(self, prompt: list[int], n: int) -> tuple[list[int], float, list[float]]:
        """(tokens, seconds from add_request to the last token, per-step seconds)."""
        from shared.engine.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        engine, clock = self.engine, self.clock
        tokens: list[int] = []
        steps: list[float] = []
        gc.collect()
        start = clock.now()
        engine.add_request(self._next_id("decode"), prompt, params)
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            for out in engine.step():
                tokens.extend(out.new_token_ids)
            steps.append(clock.now() - t0)
        total = clock.now() - start
        return tokens, total, steps

    def run_batch(self, prompts: list[list[int]], output_lens: list[int]) -> tuple[list[list[int]], float, dict[str, int]]:
        """Add all requests, step until done: (tokens per request, seconds, stats)."""
        from shared.engine.sampling_params import SamplingParams

        engine, clock = self.engine, self.clock
        ids = [self._next_id("tp") for _ in prompts]
        index = {rid: i for i, rid in enumerate(ids)}
        tokens: list[list[int]] = [[] for _ in prompts]
        preemptions_before = engine.num_preemptions
        num_steps = 0
        gc.collect()
        start = clock.now()
        for rid, prompt, n in zip(ids, prompts, output_lens):
            engine.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[index[out.request_id]].extend(out.new_token_ids)
            num_steps += 1
        wall = clock.now() - start
        stats = {"steps": num_steps, "preemptions": engine.num_preemptions - preemptions_before}
        return tokens, wall, stats


# ---------------------------------------------------------------------------------
# transformers side
# ---------------------------------------------------------------------------------
class HFSide:
    def __init__(self, model, pad_token_id: int, device: str, clock: Clock):
        self.model = model
        self.pad_token_id = pad_token_id
        self.device = device
        self.clock = clock

    def _generate(self, input_ids, attention_mask, n: int, **extra):
        import torch

        with torch.inference_mode():
            return self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                eos_token_id=None,  # never stop at EOS nor mask it: the engine's ignore_eos
                pad_token_id=self.pad_token_id,
                use_cache=True,
                **extra,
            )

    def _tensors(self, prompts: list[list[int]]):
        """Left-padded input ids and attention mask."""
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt):] = 1
        return ids.to(self.device), mask.to(self.device)

    def generate_one(self, prompt: list[int], n: int) -> tuple[list[int], float]:
        ids, mask = self._tensors([prompt])
        gc.collect()
        start = self.clock.now()
        out = self._generate(ids, mask, n)
        total = self.clock.now() - start
        return out[0, ids.shape[1]:].tolist(), total

    def logits_along(self, prompt: list[int], n: int):
        """Per-step float32 logits (n, vocab) of the greedy trajectory (untimed)."""
        import torch

        ids, mask = self._tensors([prompt])
        out = self._generate(ids, mask, n, output_logits=True, return_dict_in_generate=True)
        return torch.stack([step[0].float().cpu() for step in out.logits])

    def batches(self, output_lens: list[int], prompt_lens: list[int], batch_size: int, order: str) -> list[list[int]]:
        indices = list(range(len(output_lens)))
        if order == "sorted":
            indices.sort(key=lambda i: (output_lens[i], prompt_lens[i]), reverse=True)
        return [indices[i:i + batch_size] for i in range(0, len(indices), batch_size)]

    def run_batches(self, prompts: list[list[int]], output_lens: list[int], batches: list[list[int]]):
        """Static batches: (useful tokens per request, seconds, stats)."""
        inputs = [self._tensors([prompts[i] for i in batch]) for batch in batches]
        tokens: list[list[int]] = [[] for _ in prompts]
        generated = padded_prompt_tokens = 0
        gc.collect()
        start = self.clock.now()
        for batch, (ids, mask) in zip(batches, inputs):
            n = max(output_lens[i] for i in batch)
            out = self._generate(ids, mask, n)
            new = out[:, ids.shape[1]:].tolist()
            for row, i in enumerate(batch):
                tokens[i] = new[row][: output_lens[i]]
            generated += len(batch) * n
            padded_prompt_tokens += ids.numel()
        wall = self.clock.now() - start
        stats = {"generated_tokens_incl_discarded": generated, "prompt_tokens_incl_padding": padded_prompt_tokens}
        return tokens, wall, stats


# ---------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------
def _kv_blocks_needed(workload: dict[str, Any], args: argparse.Namespace, block_size: int) -> int:
    def blocks(n: int) -> int:
        return -(-n // block_size)

    throughput = sum(blocks(p + o) for p, o in zip(workload["prompt_lens"], workload["output_lens"]))
    decode = blocks(args.decode_prompt_len + args.decode_tokens)
    return max(throughput, decode) + len(workload["prompt_lens"]) + 1


def bench_decode(engine: EngineSide, hf: HFSide, prompt: list[int], n: int, repeats: int) -> dict[str, Any]:
    # Warm-up: one run of each kind on each side.
    engine.generate_one(prompt, n)
    engine.generate_one(prompt, 1)
    hf.generate_one(prompt, n)
    hf.generate_one(prompt, 1)

    runs: dict[str, dict[str, list[float]]] = {"engine": {"t1": [], "tn": []}, "transformers": {"t1": [], "tn": []}}
    engine_tokens: list[list[int]] = []
    hf_tokens: list[list[int]] = []
    engine_decode_steps: list[float] = []
    engine_first_steps: list[float] = []
    for _ in range(repeats):  # interleaved, so drift on a shared machine hits both sides alike
        tokens, tn, steps = engine.generate_one(prompt, n)
        engine_tokens.append(tokens)
        runs["engine"]["tn"].append(tn)
        engine_first_steps.append(steps[0])
        engine_decode_steps.extend(steps[1:])
        runs["engine"]["t1"].append(engine.generate_one(prompt, 1)[1])
        tokens, tn = hf.generate_one(prompt, n)
        hf_tokens.append(tokens)
        runs["transformers"]["tn"].append(tn)
        runs["transformers"]["t1"].append(hf.generate_one(prompt, 1)[1])

    result: dict[str, Any] = {"prompt_len": len(prompt), "new_tokens": n, "repeats": repeats}
    for side, times in runs.items():
        t1, tn = _median(times["t1"]), _median(times["tn"])
        result[side] = {
            "t1_s": t1,
            "tn_s": tn,
            "ms_per_token": (tn - t1) / (n - 1) * 1e3,
            "t1_runs_s": times["t1"],
            "tn_runs_s": times["tn"],
        }
    result["engine"]["step_median_decode_ms"] = _median(engine_decode_steps) * 1e3
    result["engine"]["step_median_first_ms"] = _median(engine_first_steps) * 1e3
    result["ratio_engine_over_transformers"] = result["engine"]["ms_per_token"] / result["transformers"]["ms_per_token"]
    result["_tokens"] = {"engine": engine_tokens, "transformers": hf_tokens}
    return result


def bench_throughput(engine: EngineSide, hf: HFSide, workload: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    prompts, output_lens, prompt_lens = workload["prompts"], workload["output_lens"], workload["prompt_lens"]
    batches = hf.batches(output_lens, prompt_lens, args.batch_size, args.hf_order)
    useful = sum(output_lens)

    # Warm-up on one batch's worth of requests (the first static batch) on each side.
    first = batches[0]
    engine.run_batch([prompts[i] for i in first], [output_lens[i] for i in first])
    hf.run_batches(prompts, output_lens, [first])

    engine_runs, hf_runs = [], []
    engine_stats = hf_stats = None
    engine_tokens = hf_tokens = None
    for _ in range(args.repeats):
        engine_tokens, wall, engine_stats = engine.run_batch(prompts, output_lens)
        engine_runs.append(wall)
        hf_tokens, wall, hf_stats = hf.run_batches(prompts, output_lens, batches)
        hf_runs.append(wall)

    engine_useful = sum(len(t) for t in engine_tokens)
    hf_useful = sum(len(t) for t in hf_tokens)
    engine_wall, hf_wall = _median(engine_runs), _median(hf_runs)
    result: dict[str, Any] = {
        "requests": len(prompts),
        "seed": args.seed,
        "prompt_len_range": list(args.prompt_lens),
        "output_len_range": list(args.output_lens),
        "prompt_lens": prompt_lens,
        "output_lens": output_lens,
        "prompt_tokens": sum(prompt_lens),
        "useful_output_tokens": useful,
        "repeats": args.repeats,
        "engine": {
            "wall_s": engine_wall,
            "wall_runs_s": engine_runs,
            "output_tokens": engine_useful,
            "tokens_per_s": engine_useful / engine_wall,
            **engine_stats,
        },
        "transformers": {
            "batch_size": args.batch_size,
            "order": args.hf_order,
            "num_batches": len(batches),
            "wall_s": hf_wall,
            "wall_runs_s": hf_runs,
            "output_tokens": hf_useful,
            "tokens_per_s": hf_useful / hf_wall,
            **hf_stats,
        },
    }
    result["ratio_engine_over_transformers"] = result["engine"]["tokens_per_s"] / result["transformers"]["tokens_per_s"]
    result["_tokens"] = {"engine": engine_tokens, "transformers": hf_tokens}
    return result


def check_correctness(decode: dict[str, Any], throughput: dict[str, Any], hf: HFSide, prompt: list[int]) -> dict[str, Any]:
    engine_runs, hf_runs = decode.pop("_tokens").values()
    engine_tokens, hf_tokens = engine_runs[0], hf_runs[0]
    mismatch = next((i for i, (a, b) in enumerate(zip(engine_tokens, hf_tokens)) if a != b), None)
    if mismatch is None and len(engine_tokens) != len(hf_tokens):
        mismatch = min(len(engine_tokens), len(hf_tokens))
    result: dict[str, Any] = {
        "batch1_tokens_identical": mismatch is None,
        "batch1_num_tokens": {"engine": len(engine_tokens), "transformers": len(hf_tokens)},
        "batch1_first_mismatch": mismatch,
        "batch1_engine_deterministic": all(t == engine_tokens for t in engine_runs),
        "batch1_transformers_deterministic": all(t == hf_tokens for t in hf_runs),
    }
    if mismatch is not None and mismatch < min(len(engine_tokens), len(hf_tokens)):
        import torch

        logits = hf.logits_along(prompt, mismatch + 1)[mismatch]
        top2 = torch.topk(logits, 2).values
        result["batch1_mismatch_detail"] = {
            "engine_token": engine_tokens[mismatch],
            "transformers_token": hf_tokens[mismatch],
            "transformers_top2_margin": float(top2[0] - top2[1]),
        }
    tp_engine, tp_hf = throughput.pop("_tokens").values()
    same = sum(a == b for a, b in zip(tp_engine, tp_hf))
    result["throughput_requests_identical"] = same
    result["throughput_requests"] = len(tp_engine)
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine

    args = resolve_args(args)
    previous_threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        model_dir = prepare_model(args)
        machine = machine_info(args.device)
        clock = Clock(args.device)
        dtype = getattr(torch, args.dtype)

        hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
        model = describe_model(model_dir, hf_model)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        vocab = min(model["vocab_size"], len(tokenizer))
        specials = set(tokenizer.all_special_ids)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else hf_model.generation_config.pad_token_id
        pad = 0 if pad is None else pad
        workload = make_workload(args, vocab, specials)

        config_kwargs: dict[str, Any] = dict(
            model=model_dir,
            dtype=args.dtype,
            device=args.device,
            enable_prefix_caching=args.prefix_caching,
        )
        if args.max_num_batched_tokens is not None:
            config_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
        if args.max_num_seqs is not None:
            config_kwargs["max_num_seqs"] = args.max_num_seqs
        block_size = EngineConfig(model=model_dir).block_size
        if args.kv_cache_gb is not None:
            config_kwargs["kv_cache_bytes"] = int(args.kv_cache_gb * (1 << 30))
        else:
            config_kwargs["num_kv_blocks"] = _kv_blocks_needed(workload, args, block_size)
        engine_config = EngineConfig(**config_kwargs)
        engine = LLMEngine(engine_config)

        print(
            f"model {model_dir}: {model['model_type']}, {model['num_parameters']:,} parameters "
            f"(hidden {model['hidden_size']}, {model['num_hidden_layers']} layers, {model['num_attention_heads']} heads, "
            f"{model['num_key_value_heads']} KV heads, intermediate {model['intermediate_size']}, vocab {model['vocab_size']})",
            flush=True,
        )
        print(
            f"{args.dtype} on {args.device} ({machine['device_name']}), {machine['torch_threads']} torch thread(s), "
            f"{machine['cpu_count']} CPUs; torch {machine['torch_version']}, transformers {machine['transformers_version']}",
            flush=True,
        )

        engine_side = EngineSide(engine, clock)
        hf_side = HFSide(hf_model, pad, args.device, clock)
        print(f"decode latency: prompt {args.decode_prompt_len}, {args.decode_tokens} new tokens, "
              f"warm-up + {args.repeats} runs per side ...", flush=True)
        decode = bench_decode(engine_side, hf_side, workload["decode_prompt"], args.decode_tokens, args.repeats)
        print(f"throughput: {args.requests} requests, warm-up + {args.repeats} runs per side ...", flush=True)
        throughput = bench_throughput(engine_side, hf_side, workload, args)
        correctness = check_correctness(decode, throughput, hf_side, workload["decode_prompt"])

        config = {
            "preset": args.preset,
            "model_arg": args.model,
            "device": args.device,
            "dtype": args.dtype,
            "threads": machine["torch_threads"],
            "seed": args.seed,
            "requests": args.requests,
            "batch_size": args.batch_size,
            "hf_order": args.hf_order,
            "repeats": args.repeats,
            "decode_prompt_len": args.decode_prompt_len,
            "decode_tokens": args.decode_tokens,
            "prompt_lens": list(args.prompt_lens),
            "output_lens": list(args.output_lens),
            "engine": {
                "block_size": engine_config.block_size,
                "num_kv_blocks": engine.block_manager.num_blocks,
                "max_num_seqs": engine_config.max_num_seqs,
                "max_num_batched_tokens": engine_config.max_num_batched_tokens,
                "enable_prefix_caching": engine_config.enable_prefix_caching,
                "enable_chunked_prefill": engine_config.enable_chunked_prefill,
                "detokenizes": engine.tokenizer is not None,
            },
            "transformers": {"eos": "disabled (eos_token_id=None), min_new_tokens=max_new_tokens", "use_cache": True},
            "warmup": "decode: one full run of each kind per side; throughput: the first static batch's requests per side",
        }
        return {
            "config": config,
            "machine": machine,
            "model": model,
            "decode_batch1": decode,
            "throughput": throughput,
            "correctness": correctness,
        }
    finally:
        torch.set_num_threads(previous_threads)


# ---------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------
def format_report(results: dict[str, Any]) -> str:
    model, machine, config = results["model"], results["machine"], results["config"]
    decode, tp, corr = results["decode_batch1"], results["throughput"], results["correctness"]
    e, h = decode["engine"], decode["transformers"]
    te, th = tp["engine"], tp["transformers"]
    lines = [
        "",
        f"splitserve engine vs transformers generate() -- {model['model_type']} {model['num_parameters']:,} params, "
        f"{config['dtype']}, {machine['device']} ({machine['device_name']}), {machine['torch_threads']} thread(s)",
        "",
        f"Decode latency, batch 1: prompt {decode['prompt_len']}, N={decode['new_tokens']} new tokens, "
        f"median of {decode['repeats']} runs",
        f"  {'':28s}{'engine':>14s}{'transformers':>16s}{'engine/transf.':>17s}",
        f"  {'T(1 token) [s]':28s}{e['t1_s']:14.4f}{h['t1_s']:16.4f}{e['t1_s'] / h['t1_s']:16.2f}x",
        f"  {'T(N tokens) [s]':28s}{e['tn_s']:14.4f}{h['tn_s']:16.4f}{e['tn_s'] / h['tn_s']:16.2f}x",
        f"  {'decode [ms/token]':28s}{e['ms_per_token']:14.3f}{h['ms_per_token']:16.3f}"
        f"{decode['ratio_engine_over_transformers']:16.2f}x   (lower is better)",
        f"  {'engine step, median [ms]':28s}{e['step_median_decode_ms']:14.3f}{'':16s}   (decode steps of the N runs)",
        "",
        f"Throughput: {tp['requests']} requests, prompt {tp['prompt_len_range'][0]}..{tp['prompt_len_range'][1]}, "
        f"output {tp['output_len_range'][0]}..{tp['output_len_range'][1]} (seed {tp['seed']}), median of {tp['repeats']} runs",
        f"  engine: continuous batching ({te['steps']} steps, {te['preemptions']} preemptions); "
        f"transformers: {th['num_batches']} static batch(es) of {th['batch_size']} ({th['order']} order), left-padded",
        f"  {'':28s}{'engine':>14s}{'transformers':>16s}{'engine/transf.':>17s}",
        f"  {'wall time [s]':28s}{te['wall_s']:14.3f}{th['wall_s']:16.3f}{te['wall_s'] / th['wall_s']:16.2f}x",
        f"  {'useful output tokens':28s}{te['output_tokens']:14d}{th['output_tokens']:16d}",
        f"  {'generated incl. discarded':28s}{te['output_tokens']:14d}{th['generated_tokens_incl_discarded']:16d}",
        f"  {'output tokens/s':28s}{te['tokens_per_s']:14.1f}{th['tokens_per_s']:16.1f}"
        f"{tp['ratio_engine_over_transformers']:16.2f}x   (higher is better)",
        "",
    ]
    if corr["batch1_tokens_identical"]:
        lines.append(f"Correctness: batch-1 greedy tokens identical ({corr['batch1_num_tokens']['engine']} tokens)")
    else:
        lines.append(f"WARNING: batch-1 greedy tokens differ, first at position {corr['batch1_first_mismatch']}"
                     + (f" {corr['batch1_mismatch_detail']}" if "batch1_mismatch_detail" in corr else ""))
    lines.append(f"Info: throughput requests with identical tokens on both sides: "
                 f"{corr['throughput_requests_identical']}/{corr['throughput_requests']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    results = run(args)
    print(format_report(results), flush=True)
    if not results["correctness"]["batch1_tokens_identical"]:
        print("WARNING: the engine and transformers disagree on the batch-1 greedy tokens", file=sys.stderr, flush=True)
    if args.output:
        path = Path(args.output)
        if path.parent != Path(""):
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")
        print(f"results written to {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
