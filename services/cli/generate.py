"""`splitserve generate`: run the engine offline on one prompt."""

import argparse
import json
import sys

from contracts import LogprobEntry
from contracts.codec import to_builtins
import msgspec

from shared.engine import EngineError, SamplingParams

# The options' defaults are the engine's (a light import: msgspec only), but for two the command chooses: a
# try-out from the shell answers the same every time (greedy) and runs long enough to read.
DEFAULTS = msgspec.structs.replace(SamplingParams(), max_tokens=64, temperature=0.0)


def add_parser(subcommands) -> None:
    from shared.engine import DEFAULT_MODEL

    parser = subcommands.add_parser(
        "generate",
        help="generate text offline with the engine (no services)",
        description="Generate from one prompt with the engine. Without --model, the default model "
                    f"({DEFAULT_MODEL}, fetched into the cache on first use) is used.",
    )
    parser.add_argument("--model", metavar="NAME|DIR|FILE.gguf",
                        help="a known model's name, a Hugging Face model directory or a .gguf file "
                             f"(default: {DEFAULT_MODEL})")
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    parser.add_argument("--max-tokens", type=int, default=DEFAULTS.max_tokens, help="default: %(default)s")
    parser.add_argument("--temperature", type=float, default=DEFAULTS.temperature,
                        help="0 is greedy (default: %(default)s, greedy)")
    parser.add_argument("--top-p", type=float, default=DEFAULTS.top_p, help="default: %(default)s")
    parser.add_argument("--top-k", type=int, default=DEFAULTS.top_k, help="default: %(default)s (off)")
    parser.add_argument("--min-p", type=float, default=DEFAULTS.min_p, help="default: %(default)s (off)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--logprobs", type=int, help="return the top-N logprobs of each token (with --json)")
    from typing import get_args

    from services.common.service_settings import Dtype, EngineSettings, ModelSettings
    from services.common.settings import default_of

    parser.add_argument("--dtype", default=default_of(ModelSettings, "dtype"), choices=list(get_args(Dtype)))
    parser.add_argument("--device", default=default_of(EngineSettings, "device"), help="cpu, cuda or cuda:N")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # Heavy imports stay here so `splitserve --help` is instant.
    from shared.engine import EngineConfig, LLMEngine, resolve_model

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.seed,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
            logprobs=args.logprobs,
        )
        params.validate()  # before the model loads: a bad value fails at once
        model_dir = str(resolve_model(args.model).model_dir)
        engine = LLMEngine(EngineConfig(model=model_dir, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len))
        prompt_ids = encode_prompt(engine.tokenizer, args.prompt, args.chat)
        engine.add_request("generate", prompt_ids, params)
        token_ids: list[int] = []
        logprobs = []
        text = ""
        finish_reason = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                token_ids += out.new_token_ids
                logprobs += out.new_logprobs
                text += out.new_text
                finish_reason = out.finish_reason
                if not args.json:
                    sys.stdout.write(out.new_text)
                    sys.stdout.flush()
    except (EngineError, ValueError) as exc:
        print(f"splitserve generate: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        result = {
            "model": model_dir,
            "prompt_token_ids": prompt_ids,
            "token_ids": token_ids,
            "text": text,
            "finish_reason": finish_reason,
        }
        if args.logprobs is not None:
            result["logprobs"] = [to_builtins(LogprobEntry.of(lp)) for lp in logprobs]
        print(json.dumps(result))
    else:
        print()
    return 0


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        return list(tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        ))
    return tokenizer(prompt).input_ids
