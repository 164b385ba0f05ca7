"""Structured output's cost: the grammar libraries side by side, and what constraining costs a decode step.

`--part backends` times llguidance and xgrammar (each that imports) on the default model's tokenizer: building
their view of the vocabulary, compiling each constraint, and filling one token's mask while following a valid
output. xgrammar is not one of splitserve's dependencies (it brings triton, 1 GB): the `grammar-compare` extra
installs it, best in a scratch venv (a library that does not import is reported as such):

    python3.11 -m venv /tmp/grammar-venv && /tmp/grammar-venv/bin/pip install -e '.[grammar-compare]'
    /tmp/grammar-venv/bin/python loadtest/bench_grammar.py --part backends --tokenizer ~/.cache/splitserve/models/smollm2-135m-instruct

`--part engine` (splitserve's venv) times the engine's decode steps, a batch of free requests against the same
batch constrained, the masks filled beside the forward pass. Each part merges its figures into `--output`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

PERSON = {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {"type": "object", "required": ["city", "zip"], "additionalProperties": False,
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
    },
}
# Each constraint with an output that follows it, walked token by token.
CASES = {
    "json_schema": (PERSON, json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines"],
                                        "address": {"city": "London", "zip": "12345"}}, separators=(",", ":"))),
    "json_object": ({"type": "object"}, json.dumps({"title": "A cat", "facts": [1, 2, 3], "nested": {"ok": True}},
                                                   separators=(",", ":"))),
    "regex": (r"\(\d{3}\) \d{3}-\d{4}", "(555) 123-4567"),
}
DEFAULT_OUTPUT = Path(__file__).parent / "results" / "grammar_backends.json"


def _summary(seconds: list[float]) -> dict:
    us = sorted(s * 1e6 for s in seconds)
    return {"n": len(us), "p50_us": round(statistics.median(us), 1), "p99_us": round(us[int(0.99 * (len(us) - 1))], 1),
            "mean_us": round(statistics.mean(us), 1)}


def bench_llguidance(tokenizer, vocab: int, eos: int, repeats: int) -> dict:
    import llguidance
    import llguidance.hf

    started = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
    result = {"version": llguidance.__version__ if hasattr(llguidance, "__version__") else _dist("llguidance"),
              "tokenizer_ms": round((time.perf_counter() - started) * 1000, 1), "cases": {}}
    executor = llguidance.LLExecutor()
    import torch

    for name, (spec, text) in CASES.items():
        ids = tokenizer.encode(text, add_special_tokens=False) + [eos]
        compiles, fills, followed = [], [], True
        for _ in range(repeats):
            started = time.perf_counter()
            grammar = (llguidance.LLMatcher.grammar_from_regex(spec) if name == "regex" else
                       llguidance.LLMatcher.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False}))
            matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
            compiles.append(time.perf_counter() - started)
            mask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
            for token in ids:
                started = time.perf_counter()
                executor.unsafe_compute_mask_ptr([(matcher, 0)], mask.data_ptr(), mask.shape[1] * 4, 1)
                fills.append(time.perf_counter() - started)
                followed &= bool((int(mask[0, token // 32]) >> (token % 32)) & 1)
                matcher.consume_token(token)
            followed &= not matcher.is_error()
        result["cases"][name] = {"tokens": len(ids), "compile": _summary(compiles), "mask_fill": _summary(fills),
                                 "valid_output_allowed": followed}
    return result


def bench_xgrammar(tokenizer, vocab: int, eos: int, repeats: int) -> dict:
    import xgrammar

    started = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    result = {"version": _dist("xgrammar"), "tokenizer_ms": round((time.perf_counter() - started) * 1000, 1),
              "cases": {}}
    for name, (spec, text) in CASES.items():
        ids = tokenizer.encode(text, add_special_tokens=False) + [eos]
        compiles, fills, followed = [], [], True
        for _ in range(repeats):
            started = time.perf_counter()
            compiled = (compiler.compile_regex(spec) if name == "regex" else
                        compiler.compile_json_schema(json.dumps(spec), any_whitespace=False,
                                                        separators=(",", ":")))
            matcher = xgrammar.GrammarMatcher(compiled)
            compiles.append(time.perf_counter() - started)
            mask = xgrammar.allocate_token_bitmask(1, vocab)
            for token in ids:
                started = time.perf_counter()
                matcher.fill_next_token_bitmask(mask, 0)
                fills.append(time.perf_counter() - started)
                followed &= bool((int(mask[0, token // 32]) >> (token % 32)) & 1)
                followed &= matcher.accept_token(token)
        result["cases"][name] = {"tokens": len(ids), "compile": _summary(compiles), "mask_fill": _summary(fills),
                                 "valid_output_allowed": followed}
    return result


def _dist(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def run_backends(args) -> dict:
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = AutoConfig.from_pretrained(args.tokenizer).vocab_size
    eos = tokenizer.eos_token_id
    found = {}
    for name, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        try:
            found[name] = bench(tokenizer, vocab, eos, args.repeats)
        except ImportError as exc:
            found[name] = {"error": f"not installed here: {exc}"}
    return {"tokenizer": str(args.tokenizer), "vocab_size": vocab, "libraries": found}


def run_engine(args) -> dict:
    import torch

    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.engine.model_registry import DEFAULT_MODEL, resolve_model
    from shared.engine.sampling_params import SamplingParams

    model = str(resolve_model(args.model or DEFAULT_MODEL).model_dir)
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", device="cpu", num_kv_blocks=512))
    prompt = engine.tokenizer.encode("Write a long list of words about the sea:")
    # JSON that cannot end before max_tokens (an array of at least 200 strings), so both batches decode as long.
    schema = {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 200}
    free = SamplingParams(max_tokens=args.tokens, temperature=0.8, seed=1, ignore_eos=True)
    bound = SamplingParams(max_tokens=args.tokens, temperature=0.8, seed=1, ignore_eos=True,
                           structured_kind="json", structured_spec=json.dumps(schema))
    figures = {"model": model, "batch": args.batch, "tokens": args.tokens, "threads": torch.get_num_threads()}
    for label, params in (("free", free), ("constrained", bound), ("free_again", free)):
        for i in range(args.batch):
            engine.add_request(f"{label}-{i}", prompt, params)
        steps = []
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            outputs = engine.step()
            if outputs and all(len(o.new_token_ids) == 1 for o in outputs) and len(outputs) == args.batch:
                steps.append(time.perf_counter() - started)
        steps = steps[1:]  # the first includes the prompts
        figures[label] = {"decode_steps": len(steps), "step_ms_p50": round(statistics.median(steps) * 1000, 2),
                          "step_ms_mean": round(statistics.mean(steps) * 1000, 2)}
    figures["constrained_over_free_p50"] = round(figures["constrained"]["step_ms_p50"] /
                                                 min(figures["free"]["step_ms_p50"],
                                                     figures["free_again"]["step_ms_p50"]), 3)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["backends", "engine"], required=True)
    parser.add_argument("--tokenizer", help="backends: a model directory with the tokenizer (the default model's)")
    parser.add_argument("--model", help="engine: the model (default: the default model)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    if args.part == "backends" and not args.tokenizer:
        parser.error("--part backends needs --tokenizer")
    figures = run_backends(args) if args.part == "backends" else run_engine(args)
    results = json.loads(args.output.read_text()) if args.output.exists() else {}
    results[args.part] = figures
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
