"""Structured output: a request's tokens kept inside a grammar (JSON schema, regex, choice, Lark grammar).

The grammars are llguidance's (chosen over xgrammar by measurement: loadtest/results/grammar_backends.md).
A request names its constraint as a kind and a spec (`SamplingParams.structured_kind/_spec`); `grammar_of`
turns that into an llguidance grammar and `check_structured` refuses one that does not compile, is nested past
MAX_SPEC_DEPTH or is longer than MAX_SPEC_CHARS. On an engine, `StructuredOutputs` compiles a constraint on a thread
of its own (`compile`: once for the choices that share it), and keeps one matcher per constrained request, a copy of
the compiled one: before a step samples, it fills each such row's
mask of allowed tokens (in a thread of its own, while the step's forward pass runs), and after it each
sampled token advances that request's matcher. A matcher's state is a function of the request's output tokens
alone, so a request that arrives with some (sampled by a prefill worker, or moved from a failed worker) has its
matcher fed those first.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from shared.engine.errors import InvalidRequestError
from shared.engine.sampling_params import STRUCTURED_KINDS
# Compact JSON (no free whitespace between tokens): a small model offered whitespace may emit it until the length
# runs out, and the text parses the same.
_JSON_OPTIONS = {"whitespace_flexible": False}
MAX_SPEC_CHARS = 200_000  # a schema or grammar past this is refused before it is compiled
MAX_SPEC_DEPTH = 100  # brackets nested deeper than this are refused before compiling (the parsers recurse)
MAX_COMPILE_S = 5.0  # a constraint that takes longer to compile is refused
_COMPILED_KEPT = 8  # constraints whose compiled matchers an engine keeps for the next request that asks for one


def nesting_depth(text: str) -> int:
    """How deep the brackets ((, [ and {) of `text` nest, escaped ones aside: a bound, in one pass, on how deep a
    parser of it recurses."""
    depth = deepest = 0
    escaped = False
    for char in text:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in ")]}":
            depth = max(depth - 1, 0)
    return deepest


def grammar_of(kind: str, spec: str) -> str:
    """The llguidance grammar for a constraint; InvalidRequestError (param "structured_outputs") for a spec
    that is not one of its kind."""
    try:
        return _grammar_of(kind, spec)
    except RecursionError:  # (a parser in Python, nested past the interpreter's stack)
        raise InvalidRequestError(f"the {kind} constraint is nested too deeply", "structured_outputs") from None


def _grammar_of(kind: str, spec: str) -> str:
    import llguidance

    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if kind == "json":
        try:
            schema = json.loads(spec)
        except ValueError as exc:
            raise InvalidRequestError(f"the JSON schema is not JSON: {exc}", "structured_outputs") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("a JSON schema is an object (or true/false)", "structured_outputs")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except (ValueError, RuntimeError) as exc:
            raise InvalidRequestError(f"unsupported JSON schema: {exc}", "structured_outputs") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        try:
            choices = json.loads(spec)
        except ValueError:
            choices = None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequestError("a choice constraint is a non-empty list of non-empty strings",
                                      "structured_outputs")
        # Each choice a string literal of a Lark rule (JSON string escapes are Lark's).
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if kind == "grammar":  # Lark, or GBNF (llama.cpp's) turned into Lark
        from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

        try:
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec))
        except GbnfToLarkError as exc:
            raise InvalidRequestError(f"invalid grammar: {exc}", "structured_outputs") from None
    raise InvalidRequestError(f"unknown structured output kind {kind!r}; one of {', '.join(STRUCTURED_KINDS)}",
                              "structured_outputs")


def check_structured(kind: str, spec: str) -> None:
    """InvalidRequestError unless the constraint compiles (what a worker would fail the request with)."""
    import llguidance

    if len(spec) > MAX_SPEC_CHARS:
        raise InvalidRequestError(f"the structured output spec has {len(spec)} characters; at most "
                                  f"{MAX_SPEC_CHARS}", "structured_outputs")
    depth = nesting_depth(spec)
    if depth > MAX_SPEC_DEPTH:
        raise InvalidRequestError(f"the structured output spec nests {depth} brackets deep; at most "
                                  f"{MAX_SPEC_DEPTH}", "structured_outputs")
    error = llguidance.LLMatcher.validate_grammar(grammar_of(kind, spec))
    if error:
        raise InvalidRequestError(f"invalid {kind} constraint: {error}", "structured_outputs")


def unpack_mask(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(rows, words) int32 bitmasks (bit i of word w: token 32*w + i allowed) to (rows, vocab_size) bools;
    tokens past the masks' end are not allowed."""
    bits = torch.arange(32, dtype=torch.int32, device=packed.device)
    allowed = ((packed.unsqueeze(-1) >> bits) & 1).bool().reshape(packed.shape[0], -1)
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    return torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)


class StructuredOutputs:
    """The matchers of one engine's constrained requests."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Iterable[int]):
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer = None  # llguidance's view of the vocabulary (~0.5 s to build for 50k tokens)
        self._tokenizer_lock = threading.Lock()
        self._executor = None
        self._matchers: dict[str, object] = {}
        self._masker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._compiler = ThreadPoolExecutor(2, thread_name_prefix="grammar-compile")
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()  # the latest _COMPILED_KEPT
        self._compiled_lock = threading.Lock()
        if hf_tokenizer is not None:  # built beside the engine's start, not on its thread at the first request
            self._masker.submit(self._llg_tokenizer)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def _llg_tokenizer(self):
        with self._tokenizer_lock:
            if self._tokenizer is None:
                import llguidance.hf

                if self._hf_tokenizer is None:
                    raise InvalidRequestError("this worker has no tokenizer, so it cannot constrain output",
                                              "structured_outputs")
                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                                   eos_token=self._eos or None)
                except (ValueError, RuntimeError) as exc:  # e.g. a slow (Python) tokenizer: llguidance takes fast ones
                    raise InvalidRequestError(f"this model's tokenizer cannot constrain output: {exc}",
                                              "structured_outputs") from None
            return self._tokenizer

    def compile(self, kind: str, spec: str) -> Future:
        """The constraint's matcher, compiled on a thread of its own (any thread may ask): a Future whose result
        `add` takes, or whose exception is the InvalidRequestError `add` would raise. Choices of one request (and
        requests alike) share one compile."""
        key = (kind, spec)
        with self._compiled_lock:
            future = self._compiled.get(key)
            if future is None:
                future = self._compiled[key] = self._compiler.submit(self._compile, kind, spec)
                while len(self._compiled) > _COMPILED_KEPT:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(key)
            return future

    def _compile(self, kind: str, spec: str):
        import llguidance

        # (llguidance lets go of the GIL while it builds a matcher)
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar_of(kind, spec), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {kind} constraint: {matcher.get_error()}", "structured_outputs")
        return matcher

    def add(self, request_id: str, kind: str, spec: str, output_token_ids: Iterable[int] = (),
            compiled=None) -> None:
        """A matcher for the request, fed the output tokens it already has: a copy of `compiled` (what `compile`
        made of this constraint), else compiled here; InvalidRequestError if the constraint does not compile or
        those tokens break it."""
        matcher = compiled.deep_copy() if compiled is not None else self._compile(kind, spec)
        output_token_ids = list(output_token_ids)
        if output_token_ids and not matcher.consume_tokens(output_token_ids):
            raise InvalidRequestError(f"the output so far does not follow its constraint: {matcher.get_error()}",
                                      "structured_outputs")
        self._matchers[request_id] = matcher

    def advance(self, request_id: str, token_ids: Iterable[int]) -> bool:
        """Feed the request's matcher tokens it produced (no-op without one); True once the grammar is complete
        (nothing but EOS may follow). InvalidRequestError for a token the grammar does not allow."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        token_ids = list(token_ids)
        if not matcher.is_error() and matcher.is_stopped() and all(t in self._eos for t in token_ids):
            return True  # complete already: the EOS after it is no token of the grammar's
        if matcher.is_error() or (token_ids and not matcher.consume_tokens(token_ids)):
            # (the matcher stays broken: every later token of the request is refused too)
            raise InvalidRequestError(f"the output does not follow its constraint: {matcher.get_error()}",
                                      "structured_outputs")
        return matcher.is_stopped()

    def drop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def start_masks(self, request_ids: list[str | None]) -> Future | None:
        """Fill the masks of the next tokens of `request_ids` (None: an unconstrained row) in the background:
        a Future of (rows, words) int32 bitmasks, a row of all-ones for unconstrained rows. None when no row is
        constrained."""
        pairs = [(self._matchers[r], i) for i, r in enumerate(request_ids) if r is not None and r in self._matchers]
        if not pairs:
            return None
        return self._masker.submit(self._fill, pairs, len(request_ids))

    def _fill(self, pairs, rows: int) -> torch.Tensor:
        import llguidance

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        words = (self.vocab_size + 31) // 32
        masks = torch.full((rows, words), -1, dtype=torch.int32)
        # (llguidance.torch's fill_next_token_bitmask_par does this, but importing it loads torch's compiler: 1.8 s)
        self._executor.unsafe_compute_mask_ptr(pairs, masks.data_ptr(), words * 4, rows)
        return masks

    def close(self) -> None:
        self._masker.shutdown(wait=False, cancel_futures=True)
        self._compiler.shutdown(wait=False, cancel_futures=True)
