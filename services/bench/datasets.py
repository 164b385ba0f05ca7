"""Workloads for `splitserve bench`: lists of conversations, each a list of requests sent one after another.

- `random`: single requests of --input-len prompt tokens and --output-len output
  tokens, each drawn uniformly within +-(--range-ratio) of them.
- `mixed`: mostly short chats (--input-len / --output-len) and a --long-fraction
  of long prompts (--long-input-len / --long-output-len).
- `prefix`: --prefix-groups documents of --prefix-len tokens, each read by
  --conversations-per-group conversations of --turns turns (a --input-len
  question each); a turn's prompt is the document and the conversation so far.
  The API returns text, not token ids, so earlier replies are stand-ins of
  --output-len tokens (the prefix structure the cache sees is the same).
- `shifting`: the trace of services/bench/trace.py, its own arrival times
  (--num-prompts and --request-rate do not apply): --phase-seconds of
  prefill-heavy requests (--long-input-len / --long-output-len), of
  decode-heavy ones (--decode-heavy-input-len / --decode-heavy-output-len),
  then a ramp 0.5 -> 3 -> 0.5 req/s of --input-len / --output-len ones; rates
  times --trace-rate-scale. Each request is labelled with its phase.
- `sharegpt:PATH`: the first human turn of each conversation of a ShareGPT-format
  JSON file, its output length that of the reply (too short or too long ones
  are skipped, as vllm does).

With a tokenizer (--tokenizer, or the served model's directory), prompts are
token ids (exact lengths); without one they are text of random words, about one
token each, and lengths are what the server reports.
"""

import json
import random
from dataclasses import dataclass
from pathlib import Path

from services.bench.trace import SHAPES, SHIFTING, trace_arrivals

DATASETS = ("random", "mixed", "prefix", "shifting", "sharegpt:PATH")
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vo", "si", "de", "pa", "go", "fi", "be", "tu", "za", "mo")


@dataclass
class BenchRequest:
    token_ids: list[int] | None  # the prompt as token ids (with a tokenizer), else None
    text: str  # the prompt as text (always: chat needs it)
    prompt_len: int  # tokens, as generated (the server's count is recorded too)
    output_len: int
    conversation: int = 0
    turn: int = 0
    arrival_s: float | None = None  # when the workload says it arrives (s from the start), else None: --request-rate
    phase: str = ""  # the trace's phase it belongs to, if any


class PromptMaker:
    """Random prompts of a given length: token ids from the tokenizer's ordinary vocabulary, or random words."""

    def __init__(self, rng: random.Random, tokenizer=None):
        self.rng = rng
        self.tokenizer = tokenizer
        if tokenizer is not None:
            special = set(getattr(tokenizer, "all_special_ids", []) or [])
            self.vocab = [i for i in range(min(len(tokenizer), 1 << 20)) if i not in special]

    def tokens(self, n: int) -> list[int] | None:
        if self.tokenizer is None:
            return None
        return [self.rng.choice(self.vocab) for _ in range(n)]

    def words(self, n: int) -> str:
        return " ".join(self.rng.choice(_SYLLABLES) + self.rng.choice(_SYLLABLES) for _ in range(n))

    def request(self, n: int, output_len: int, **where) -> BenchRequest:
        ids = self.tokens(n)
        text = self.tokenizer.decode(ids) if ids is not None else self.words(n)
        return BenchRequest(ids, text, n, output_len, **where)

    def extend(self, request: BenchRequest, n: int, output_len: int, **where) -> BenchRequest:
        """`request`'s prompt followed by `n` more tokens."""
        ids = self.tokens(n)
        if ids is not None:
            ids = request.token_ids + ids
            return BenchRequest(ids, self.tokenizer.decode(ids), len(ids), output_len, **where)
        return BenchRequest(None, request.text + " " + self.words(n), request.prompt_len + n, output_len, **where)


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(low, high)


def build_dataset(args, tokenizer=None) -> list[list[BenchRequest]]:
    """The conversations of `args.dataset` (argparse options of `splitserve bench`), from `args.seed`."""
    # Lengths and contents from separate generators: the same seed gives the same lengths with or without a
    # tokenizer (which draws a different number of values per prompt).
    rng = random.Random(args.seed)
    maker = PromptMaker(random.Random(args.seed + 1), tokenizer)
    name = args.dataset
    if name == "random":
        return [[maker.request(_length(rng, args.input_len, args.range_ratio),
                               _length(rng, args.output_len, args.range_ratio), conversation=i)]
                for i in range(args.num_prompts)]
    if name == "mixed":
        conversations = []
        for i in range(args.num_prompts):
            long = rng.random() < args.long_fraction
            n, out = (args.long_input_len, args.long_output_len) if long else (args.input_len, args.output_len)
            conversations.append([maker.request(_length(rng, n, args.range_ratio),
                                                _length(rng, out, args.range_ratio), conversation=i)])
        return conversations
    if name == "prefix":
        documents = [maker.request(args.prefix_len, 0) for _ in range(args.prefix_groups)]
        conversations = []
        for index in range(args.conversations_per_group):
            for document in documents:
                turns, transcript = [], document
                for turn in range(args.turns):
                    asked = maker.extend(transcript, args.input_len, args.output_len,
                                         conversation=len(conversations), turn=turn)
                    turns.append(asked)
                    transcript = maker.extend(asked, args.output_len, 0)  # the stand-in reply
                conversations.append(turns)
        return conversations[: args.num_prompts] if args.num_prompts else conversations
    if name == "shifting":
        return _shifting(args, rng, maker)
    if name.startswith("sharegpt:"):
        return _sharegpt(Path(name.removeprefix("sharegpt:")), args, rng, tokenizer)
    raise ValueError(f"unknown dataset {name!r} (choose from {', '.join(DATASETS)})")


def _shifting(args, rng: random.Random, maker: PromptMaker) -> list[list[BenchRequest]]:
    conversations = []
    for at, index in trace_arrivals(SHIFTING, args.phase_seconds, args.trace_rate_scale, args.seed):
        phase = SHIFTING[index]
        prompt, output = (getattr(args, option) for option in SHAPES[phase.shape])
        lengths = _length(rng, prompt, args.range_ratio), _length(rng, output, args.range_ratio)
        conversations.append([maker.request(*lengths, conversation=len(conversations), arrival_s=at, phase=phase.name)])
    return conversations


def _sharegpt(path: Path, args, rng: random.Random, tokenizer) -> list[list[BenchRequest]]:
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the ShareGPT file {path}: {exc}") from exc

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer is not None else max(1, len(text) // 4)

    entries = [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []
    rng.shuffle(entries)  # then take the first usable ones: no need to tokenize the whole file
    chosen = []
    for entry in entries:
        if args.num_prompts and len(chosen) == args.num_prompts:
            break
        turns = entry.get("conversations")
        if not isinstance(turns, list) or len(turns) < 2 or not all(isinstance(t, dict) for t in turns[:2]):
            continue
        prompt, reply = turns[0].get("value"), turns[1].get("value")
        if not isinstance(prompt, str) or not isinstance(reply, str):
            continue
        prompt_len = count(prompt)
        output_len = args.output_len if args.fixed_output_len else count(reply)
        if prompt_len < 4 or output_len < 4 or prompt_len > 1024 or prompt_len + output_len > 2048:
            continue  # as vllm's sample_sharegpt_requests
        chosen.append((prompt, prompt_len, output_len))
    if not chosen:
        raise ValueError(f"{path} has no usable conversations (ShareGPT format: [{{'conversations': [...]}}])")
    return [[BenchRequest(tokenizer.encode(text, add_special_tokens=False) if tokenizer is not None else None, text,
                          prompt_len, output_len, conversation=i)]
            for i, (text, prompt_len, output_len) in enumerate(chosen)]
