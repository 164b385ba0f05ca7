"""The OpenAI request bodies the gateway accepts: /v1/completions and /v1/chat/completions.

Fields and defaults follow the OpenAI API reference; extensions that vLLM also
accepts (top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos,
min_tokens, include_stop_str_in_output, skip_special_tokens,
spaces_between_special_tokens, chat_template_kwargs, structured_outputs,
guided_* and cache_salt) sit beside them. Values are
checked strictly (no "0.5" strings for numbers, no 0/1 for booleans, no NaN or
infinity) and every bad value becomes a `RequestError` 400 naming its field:
pydantic's type errors through `from_validation_errors`, range and support
checks raised directly by the validators below.

Every parameter is honoured or refused. Features splitserve does not have
(suffix) are refused
with a 400 naming them, and so is any field this API does not know: a
misspelled or unsupported parameter is never run with default behaviour.
`user` is accepted and ignored, as OpenAI and vLLM do (`IGNORED_FIELDS`).
A chat message's unknown keys are ignored: clients send back the assistant
messages they were given, with fields such as `refusal` and `annotations`.
"""

from typing import Any, Literal, TypeVar

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from services.gateway.errors import RequestError, from_validation_errors
from services.gateway.structured_request import GUIDED_FIELDS, Constraint, StructuredOutputsParams, constraint_of
from services.gateway.tool_calls import calls_grammar, check_tools, tool_mode
from shared.engine import LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams

IGNORED_FIELDS = ("user",)  # accepted and ignored (logged once, at debug level)
# Keys of chat_template_kwargs that would change how the template is called rather than what it renders.
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                      "return_dict", "return_tensors", "padding", "truncation", "max_length",
                                      "tokenizer_kwargs", "return_assistant_tokens_mask"})
MAX_CHOICES = 16  # n: completions of one request
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 1024  # per stop sequence: each is matched against the tail of the text every step
MAX_STOP_TOKEN_IDS = 1024
MAX_REPETITION_PENALTY = 2.0  # past it every token seen is all but ruled out: no use, only a footgun
MAX_TOKEN_ID_DIGITS = 10  # a token id as a logit_bias key (vocabularies are < 2**31 tokens); the vocabulary decides
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

RequestT = TypeVar("RequestT", bound=BaseModel)


class _Strict(BaseModel):
    """Strict types; a field this API does not know is refused, naming it (the request's own, or one inside a
    part, as stream_options.x)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = None


def _check_template_kwargs(kwargs: dict | None) -> None:
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs or {}))
    if reserved:
        raise _invalid("chat_template_kwargs", f"chat_template_kwargs may not set {reserved[0]!r}")


def _unsupported(param: str, message: str) -> RequestError:
    return RequestError(message, param, code="unsupported_parameter")


def _invalid(param: str, message: str) -> RequestError:
    return RequestError(message, param, code="invalid_value")


class _SamplingRequest(_Strict):
    """Fields both endpoints share."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension: <= 0 (or -1) is off
    min_p: float | None = None  # extension
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (transformers semantics)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)  # also a single str, or null
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False  # extension
    min_tokens: int = 0  # extension: EOS, stop_token_ids and stop strings wait for this many tokens
    include_stop_str_in_output: bool = False  # extension
    skip_special_tokens: bool = True  # extension
    spaces_between_special_tokens: bool = True  # extension (honoured by slow tokenizers; fast ones add none)
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    logit_bias: dict[str, Any] | None = None  # token id (a string, as JSON keys are) -> bias in [-100, 100]
    prompt_logprobs: int | None = None  # extension: the prompt tokens' logprobs, with this many alternatives
    # extension (vLLM's): prefix reuse only among requests with the same salt (mixed with the API key's own)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    # Structured output (services/gateway/structured_request.py): at most one of these.
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None  # extension
    guided_json: Any = None  # extension (vLLM's older names)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    _constraint: Constraint | None = PrivateAttr(default=None)

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> list[str]:
        if value is None:
            return []
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _invalid("stop", "stop must be a string or a list of strings")
        if len(stops) > MAX_STOP_SEQUENCES:
            raise _invalid("stop", f"stop takes at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise _invalid("stop", "stop sequences must not be empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise _invalid("stop", f"a stop sequence may hold at most {MAX_STOP_CHARS} characters")
        return stops

    def _check_sampling(self) -> None:
        def out_of_range(param: str, value: float | None, low: float, high: float, low_open: bool = False):
            if value is None:
                return
            if value < low or value > high or (low_open and value == low):
                bracket = "(" if low_open else "["
                raise _invalid(param, f"{param} must be in {bracket}{low:g}, {high:g}], got {value:g}")

        out_of_range("temperature", self.temperature, 0.0, 2.0)
        out_of_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        out_of_range("min_p", self.min_p, 0.0, 1.0)
        out_of_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        out_of_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        out_of_range("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, low_open=True)
        if self.top_k is not None and self.top_k < -1:
            raise _invalid("top_k", f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k}")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            raise _invalid("seed", f"seed must fit in a signed 64-bit integer, got {self.seed}")
        if self.stop_token_ids and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise _invalid("stop_token_ids", f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, "
                                             f"got {len(self.stop_token_ids)}")
        if self.stop_token_ids and any(t < 0 for t in self.stop_token_ids):
            raise _invalid("stop_token_ids", "stop_token_ids must be non-negative token ids")
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            raise _invalid("n", f"n must be between 1 and {MAX_CHOICES}, got {self.n}")
        if self.stream_options is not None and not self.stream:
            raise _invalid("stream_options", "stream_options is only allowed when stream is true")
        if self.min_tokens < 0:
            raise _invalid("min_tokens", f"min_tokens must be at least 0, got {self.min_tokens}")
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
                raise _invalid("prompt_logprobs", f"prompt_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got "
                                                  f"{self.prompt_logprobs}")
            if self.stream:  # as vLLM: they come whole, with the response
                raise RequestError("prompt_logprobs are not available when streaming", "prompt_logprobs",
                                   code="unsupported_value")
        self._check_logit_bias()
        self._constraint = constraint_of(self.response_format, self.structured_outputs,
                                         {name: getattr(self, name) for name in GUIDED_FIELDS})

    @property
    def constraint(self) -> Constraint | None:
        """The structured output asked for (None: free text)."""
        return self._constraint

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise _invalid("logit_bias", f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
        for key, value in bias.items():
            if not key.isascii() or not key.isdigit() or len(key) > MAX_TOKEN_ID_DIGITS:
                shown = key if len(key) <= 24 else f"{key[:12]}...({len(key)} characters)"
                raise _invalid("logit_bias", f"logit_bias keys must be token ids, got {shown!r}")
            if type(value) not in (int, float) or not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
                raise _invalid("logit_bias", f"logit_bias values must be numbers in [-100, 100], got {value!r} for "
                                             f"token {key}")

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        return {int(key): float(value) for key, value in (self.logit_bias or {}).items()}

    def _check_max_tokens(self, param: str, value: int | None) -> None:
        if value is not None and value < 1:
            raise _invalid(param, f"{param} must be at least 1, got {value}")

    @property
    def candidates(self) -> int:
        """Completions generated (the endpoint's best_of may ask for more than it returns)."""
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def ignored_fields(self) -> list[str]:
        """The fields given that are accepted and ignored."""
        return [name for name in IGNORED_FIELDS if getattr(self, name, None) is not None]


def _token_ids(value: list) -> list[int]:
    if not value:
        raise _invalid("prompt", "prompt must not be empty")
    if not all(type(v) is int and v >= 0 for v in value):
        raise _invalid("prompt", "prompt must be a string or a list of non-negative token ids")
    return value


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions (the legacy text completion API)."""

    prompt: Any  # str | list[int]; normalised by the validator
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> str | list[int]:
        # OpenAI takes a string, token ids, or a batch of either; here one prompt per request.
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise _invalid("prompt", "prompt must be a string or a list of token ids")
        if len(value) == 1 and isinstance(value[0], str):
            return value[0]
        if len(value) == 1 and isinstance(value[0], list):
            return _token_ids(value[0])
        if value and all(isinstance(v, (str, list)) for v in value):
            raise RequestError(f"Batched prompts are not supported: send one prompt per request (got {len(value)}).",
                               "prompt", code="unsupported_value")
        return _token_ids(value)

    @model_validator(mode="after")
    def _check(self) -> "CompletionRequest":
        self._check_max_tokens("max_tokens", self.max_tokens)
        self._check_sampling()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise _invalid("logprobs", f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.logprobs}")
        if self.echo and self.logprobs is not None and self.stream:
            raise RequestError("echo=true with logprobs is given with whole responses (the prompt's logprobs are "
                               "not streamed)", "echo", code="unsupported_value")
        if self.suffix:
            raise _unsupported("suffix", "suffix is not supported")
        if self.best_of is not None:
            if not 1 <= self.best_of <= MAX_CHOICES:
                raise _invalid("best_of", f"best_of must be between 1 and {MAX_CHOICES}, got {self.best_of}")
            if self.best_of < (self.n or 1):
                raise _invalid("best_of", f"best_of ({self.best_of}) must be at least n ({self.n})")
            if self.best_of > (self.n or 1) and self.stream:
                raise RequestError("best_of > n cannot be streamed: the best are known once all have ended",
                                   "best_of", code="unsupported_value")
        return self

    @property
    def echo_logprobs(self) -> bool:
        """Whether the logprobs begin with the echoed prompt's (OpenAI's echo=true with logprobs)."""
        return bool(self.echo) and self.logprobs is not None

    @property
    def candidates(self) -> int:
        """Completions generated: best_of, of which the n most likely are returned."""
        return max(self.best_of or 1, self.n or 1)

    @property
    def sampling_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens"


class ChatMessage(_Strict):
    """One message; keys it does not know are ignored (see the module's docstring)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    # str | list of text parts, joined into one str; None only for assistant messages (e.g. tool calls)
    content: Any = Field(default=None, validate_default=True)
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _join_parts(cls, value: Any, info: ValidationInfo) -> str | None:
        if value is None:
            if info.data.get("role", "assistant") != "assistant":
                raise PydanticCustomError("missing", "content is required")
            return None
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise PydanticCustomError("invalid_type", "expected a string or a list of content parts")
        texts = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            key = {"text": "text", "refusal": "refusal"}.get(kind) if isinstance(kind, str) else None
            if key is None:
                raise PydanticCustomError(
                    "unsupported_value", "content part {index} has type '{kind}'; only text parts are supported",
                    {"index": i, "kind": kind})
            if not isinstance(part.get(key), str):
                raise PydanticCustomError("invalid_type", "content part {index} needs a string '{key}'",
                                          {"index": i, "key": key})
            texts.append(part[key])
        return "\n".join(texts)

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it (content always a string)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        for key in ("name", "tool_call_id", "tool_calls"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI, still accepted
    max_completion_tokens: int | None = None  # wins over max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # more than one call at once (default: yes)
    functions: list[Any] | None = None
    function_call: Any = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension: extra variables for the chat template
    _tool_mode: tuple[str, str | None] | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check(self) -> "ChatCompletionRequest":
        if not self.messages:
            raise _invalid("messages", "messages must contain at least one message")
        self._check_max_tokens("max_tokens", self.max_tokens)
        self._check_max_tokens("max_completion_tokens", self.max_completion_tokens)
        self._check_sampling()
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise _invalid("top_logprobs",
                               f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.top_logprobs}")
            if not self.logprobs:
                raise _invalid("top_logprobs", "top_logprobs requires logprobs to be true")
        functions = check_tools(self.tools)
        self._tool_mode = tool_mode(self.tool_choice, functions)
        if self._tool_mode is not None and self._constraint is not None:
            if self.tool_choice is not None:
                raise _invalid("tool_choice", f"{self._constraint.param} and tool_choice both constrain the "
                                              "output; give one")
            self._tool_mode = None  # "auto" only by default: the output's own format wins, the tools are shown
        if self._tool_mode is not None:
            mode, named = self._tool_mode
            grammar = calls_grammar(functions, mode, named, self.parallel_tool_calls is not False)
            self._constraint = Constraint("grammar", grammar, "tool_choice")
        if self.functions:
            raise _unsupported("functions", "function calling is not supported")
        if self.function_call not in (None, "none"):
            raise _unsupported("function_call", "function calling is not supported")
        _check_template_kwargs(self.chat_template_kwargs)
        return self

    @property
    def sampling_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        """The field the completion limit came from, for error messages."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def tool_mode(self) -> str | None:
        """"auto", "required" or "named" when the output may be tool calls (services/gateway/tool_calls.py),
        else None."""
        return self._tool_mode[0] if self._tool_mode else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]


class TokenizeRequest(_Strict):
    """POST /tokenize, as vLLM takes it: a prompt, or chat messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # Default: true for a prompt (as a completion encodes it), false for messages (the template has its own).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise _invalid("prompt", "give either prompt or messages")
        if self.messages is not None and not self.messages:
            raise _invalid("messages", "messages must contain at least one message")
        if self.prompt is not None and (self.tools or self.chat_template_kwargs):
            raise _invalid("tools" if self.tools else "chat_template_kwargs", "only with messages")
        check_tools(self.tools)
        _check_template_kwargs(self.chat_template_kwargs)
        return self


class DetokenizeRequest(_Strict):
    """POST /detokenize, as vLLM takes it."""

    model: str | None = None
    tokens: list[int]


def parse_request(model_cls: type[RequestT], body: Any) -> RequestT:
    """Validate a decoded JSON body; any problem is a RequestError 400 naming the field."""
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None


def to_sampling_params(req: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    """The request's sampling parameters, not yet validated (the caller fills in max_tokens and the rest first).

    max_tokens is None when the client gave none; `resolve_max_tokens` fills it in.
    """
    return SamplingParams(
        max_tokens=req.requested_max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(req.top_k or 0, 0),
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        seed=req.seed,
        stop=list(req.stop),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=req.sampling_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        min_tokens=req.min_tokens,
        logit_bias=req.logit_bias_ids,
        structured_kind=req.constraint.kind if req.constraint else "",
        structured_spec=req.constraint.spec if req.constraint else "",
        prompt_logprobs=req.prompt_logprobs,
    )


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, *,
                       prompt_param: str = "prompt", max_tokens_param: str = "max_tokens") -> int:
    """The completion budget: what was asked for, or the rest of the context when nothing was.

    `prompt_param` is "messages" for chat, so errors point at the right field.
    """
    where = "messages" if prompt_param == "messages" else "prompt"
    if prompt_len < 1:
        raise _invalid(prompt_param, f"The {where} is empty after tokenization.")
    head = f"This model's maximum context length is {max_model_len} tokens. However, "
    if requested is not None and prompt_len + requested > max_model_len:
        too_long = prompt_len >= max_model_len
        advice = f"the {where}" if too_long else f"the {where} or completion"
        raise RequestError(
            head + f"you requested {prompt_len + requested} tokens ({prompt_len} in the {where}, {requested} in the "
            f"completion). Please reduce the length of {advice}.",
            prompt_param if too_long else max_tokens_param, code="context_length_exceeded")
    if prompt_len >= max_model_len:
        raise RequestError(
            head + f"your {where} resulted in {prompt_len} tokens, which leaves no room for the completion. "
            f"Please reduce the length of the {where}.",
            prompt_param, code="context_length_exceeded")
    return requested if requested is not None else max_model_len - prompt_len


def check_prompt_chars(num_chars: int, max_model_len: int, max_chars_per_token: int, param: str) -> None:
    """Refuse, before tokenizing it, text longer than any `max_model_len` tokens could spell (with a margin of
    two for normalizers that drop characters): the tokenizer's time and memory are not spent on it."""
    limit = 2 * max_model_len * max_chars_per_token
    if num_chars > limit:
        where = "messages" if param == "messages" else "prompt"
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your {where} has "
            f"{num_chars} characters, far more than that many tokens can hold. Please reduce the length of the "
            f"{where}.", param, code="context_length_exceeded")


def check_prompt_tokens(prompt_len: int, max_model_len: int, param: str) -> None:
    """Refuse a tokenized prompt longer than the context (/tokenize's bound: no request could send it)."""
    if prompt_len > max_model_len:
        where = "messages" if param == "messages" else "prompt"
        raise RequestError(f"This model's maximum context length is {max_model_len} tokens. However, your {where} "
                           f"resulted in {prompt_len} tokens. Please reduce the length of the {where}.", param,
                           code="context_length_exceeded")


def text_chars(value: Any) -> int:
    """The characters of a JSON value's text (its strings and keys; a scalar counts as one): what a chat template
    may render of it, counted without tokenizing. Iterative: as deep as the JSON parser allowed."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(len(key) for key in item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif item is not None:
            total += 1
    return total


def check_chat_chars(messages: list[dict], tools: list | None, template_kwargs: dict | None, max_model_len: int,
                     max_chars_per_token: int) -> None:
    """`check_prompt_chars` for a chat, before its template renders it: the messages (their names and tool calls
    too), then with them the tools offered and the template's variables."""
    chars = text_chars(messages)
    check_prompt_chars(chars, max_model_len, max_chars_per_token, "messages")
    chars += text_chars(tools) + text_chars(template_kwargs)
    check_prompt_chars(chars, max_model_len, max_chars_per_token, "tools" if tools else "chat_template_kwargs")


def check_vocabulary_fields(req: "CompletionRequest | ChatCompletionRequest", vocab_size: int) -> None:
    """The fields bounded by the model's vocabulary: stop_token_ids and logit_bias keys within it, top_k at most
    its size."""
    check_token_ids(req.stop_token_ids or [], vocab_size, "stop_token_ids")
    check_token_ids(list(req.logit_bias_ids), vocab_size, "logit_bias")
    if req.top_k is not None and req.top_k > vocab_size:
        raise _invalid("top_k", f"top_k must be at most the vocabulary's size, {vocab_size}, got {req.top_k}")


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    """Reject token ids (a prompt, stop_token_ids) outside the model's vocabulary."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise _invalid(param, f"token id {bad} in {param} is outside the vocabulary [0, {vocab_size})")
