"""The gateway's OpenAI surface without a server or NATS: request validation,
max_tokens resolution, response and stream shapes (checked against the
official openai package's types), and the gateway app's error answers (to
plain HTTP and the official client). Responses and streams as the client
reads them are tested against a running deployment (tests/services/test_openai_client.py)."""

import json
import math

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from contracts import LogprobEntry
from services.gateway.app import create_app
from services.gateway.settings import GatewayServiceSettings
from services.gateway.errors import (
    RequestError,
    error_body,
    from_failure,
)
from services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    check_prompt_chars,
    check_token_ids,
    parse_request,
    resolve_max_tokens,
    to_sampling_params,
)
from services.gateway.responses import (
    SSE_DONE,
    chat_choice,
    chat_chunk,
    chat_completion_response,
    chat_logprobs,
    chat_role_chunk,
    completion_choice,
    completion_chunk,
    completion_logprobs,
    completion_response,
    sse,
    sse_error,
    usage_chunk,
)
from shared.engine.sampling_params import SamplingParams

USER = [{"role": "user", "content": "Hi"}]


def completion(**fields):
    return {"model": "m", "prompt": "Hello", **fields}


def chat(**fields):
    return {"model": "m", "messages": USER, **fields}


def rejected(model_cls, body) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_request(model_cls, body)
    assert info.value.status == 400
    assert info.value.type == "invalid_request_error"
    return info.value


# --- request validation -----------------------------------------------------

COMMON_BAD = [
    ("temperature", -0.1), ("temperature", 2.01), ("temperature", "0.5"), ("temperature", float("nan")),
    ("temperature", float("inf")), ("temperature", True),
    ("top_p", 0), ("top_p", 1.5), ("top_p", -1),
    ("top_k", -2), ("top_k", 1.5), ("top_k", "5"),
    ("min_p", -0.1), ("min_p", 1.1),
    ("presence_penalty", 2.5), ("presence_penalty", -2.5),
    ("frequency_penalty", 3), ("frequency_penalty", -2.01),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", float("inf")),
    ("seed", 2**63), ("seed", -(2**63) - 1), ("seed", "7"), ("seed", 1.0),
    ("stop", ["a", "b", "c", "d", "e"]), ("stop", ""), ("stop", ["ok", ""]), ("stop", [1]), ("stop", 3),
    ("stop", {"a": 1}),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["1"]), ("stop_token_ids", 5),
    ("ignore_eos", "yes"), ("ignore_eos", 1),
    ("skip_special_tokens", "no"),
    ("n", 17), ("n", 0), ("n", "1"),
    ("stream", "true"), ("stream", 1),
    ("stream_options", {"include_usage": True}),  # without stream
    ("logit_bias", {"x": 1}), ("logit_bias", {"5": 101}), ("logit_bias", {"5": "1"}), ("logit_bias", {"-5": 1}),
    ("logit_bias", {str(i): 1 for i in range(1025)}), ("logit_bias", [1]),
    ("min_tokens", -1), ("min_tokens", 1.5), ("min_tokens", "2"),
    ("include_stop_str_in_output", "yes"), ("spaces_between_special_tokens", 1),
    ("user", 5),
    # Fields this API does not know are refused, never run as if unsent: a misspelling, or vLLM-only options.
    ("max_token", 5), ("guided_decoding_backend", "xgrammar"), ("metadata", {"x": "y"}),
    ("prompt_logprobs", 21), ("prompt_logprobs", -1), ("prompt_logprobs", "1"), ("prompt_logprobs", True),
    # Structured output asked for wrongly: no constraint, two, a schema that is not one, an empty choice.
    ("structured_outputs", {}), ("structured_outputs", {"json": {"type": "object"}, "regex": "a+"}),
    ("structured_outputs", {"regex": ""}), ("structured_outputs", {"choice": ["a", ""]}),
    ("structured_outputs", {"json": "{not json"}), ("structured_outputs", {"json": [1]}),
    ("guided_json", 5), ("guided_json", "{"), ("guided_choice", []), ("guided_regex", ""), ("guided_grammar", 3),
    ("response_format", {"type": "xml"}), ("response_format", {"type": "json_schema"}),
    ("response_format", {"type": "json_schema", "json_schema": {"schema": {}}}),
    ("response_format", {"type": "json_object", "strict": True}),
    ("model", 5), ("model", None),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 1.5), ("max_tokens", True), ("max_tokens", "10"),
]


@pytest.mark.parametrize("param,value", COMMON_BAD)
def test_bad_sampling_values_name_their_field(param, value):
    for make, cls in ((completion, CompletionRequest), (chat, ChatCompletionRequest)):
        error = rejected(cls, make(**{param: value}))
        # nested culprits are named OpenAI's way: stop_token_ids[0], messages[1].role
        assert error.param.split("[")[0] == param, (cls.__name__, error)
        assert error.message


@pytest.mark.parametrize("param,value", [
    ("logprobs", 21), ("logprobs", -1), ("logprobs", True), ("logprobs", 2.0),
    ("echo", "no"),
    ("suffix", "tail"),
    ("best_of", 0), ("best_of", 17), ("best_of", "2"),
])
def test_bad_completion_only_values(param, value):
    assert rejected(CompletionRequest, completion(**{param: value})).param == param


def test_prompt_logprobs_are_not_streamed():
    for make, cls in ((completion, CompletionRequest), (chat, ChatCompletionRequest)):
        assert to_sampling_params(parse_request(cls, make(prompt_logprobs=3))).prompt_logprobs == 3
        refused = rejected(cls, make(prompt_logprobs=1, stream=True))
        assert (refused.param, refused.code) == ("prompt_logprobs", "unsupported_value")


def test_prompt_logprobs_that_could_not_fit_the_bus_are_a_400():
    from services.gateway.app import check_prompt_logprobs_size
    from services.gateway.errors import RequestError

    check_prompt_logprobs_size(1000, 5, 1 << 20, "prompt_logprobs")  # about 128 kB
    with pytest.raises(RequestError) as refused:
        check_prompt_logprobs_size(4000, 20, 1 << 20, "echo")  # 4,000 tokens x 20 alternatives encode to 1.3 MB
    assert refused.value.param == "echo" and "1048576" in refused.value.message


def test_best_of_is_at_least_n_and_more_than_n_is_not_streamed():
    assert parse_request(CompletionRequest, completion(best_of=4, n=2)).candidates == 4
    assert parse_request(CompletionRequest, completion(best_of=2, n=2, stream=True)).candidates == 2
    assert rejected(CompletionRequest, completion(best_of=2, n=3)).param == "best_of"
    refused = rejected(CompletionRequest, completion(best_of=3, stream=True))
    assert (refused.param, refused.code) == ("best_of", "unsupported_value")


@pytest.mark.parametrize("fields,param", [
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_completion_tokens": "5"}, "max_completion_tokens"),
    ({"logprobs": 1}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs=true, as OpenAI says
    ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "colour": "red"}}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "any"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"messages": []}, "messages"),
    ({"messages": "Hi"}, "messages"),
    ({"messages": None}, "messages"),
    ({"messages": ["Hi"]}, "messages[0]"),
    ({"messages": [{"content": "Hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}, "messages[1].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "system", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": ["Hi"]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "a", "name": 3}]}, "messages[0].name"),
])
def test_bad_chat_values(fields, param):
    assert rejected(ChatCompletionRequest, chat(**fields)).param == param


def test_missing_fields_are_400s_naming_them():
    error = rejected(CompletionRequest, {"prompt": "x"})
    assert (error.param, error.code) == ("model", "missing_required_parameter")
    assert error.message == "Missing required parameter: 'model'."
    assert rejected(CompletionRequest, {"model": "m"}).param == "prompt"
    assert rejected(ChatCompletionRequest, {"model": "m"}).param == "messages"
    body_error = rejected(CompletionRequest, ["not", "an", "object"])
    assert body_error.param is None


def test_n_is_bounded_and_says_so():
    assert parse_request(ChatCompletionRequest, chat(n=3)).n == 3
    error = rejected(ChatCompletionRequest, chat(n=17))
    assert error.param == "n" and "between 1 and 16" in error.message


def test_image_content_is_refused_by_type():
    parts = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    error = rejected(ChatCompletionRequest, chat(messages=[{"role": "user", "content": parts}]))
    assert error.param == "messages[0].content"
    assert "image_url" in error.message and "part 1" in error.message


def test_stream_options_need_stream():
    error = rejected(CompletionRequest, completion(stream=False, stream_options={"include_usage": True}))
    assert error.param == "stream_options"
    bad_flag = rejected(CompletionRequest, completion(stream=True, stream_options={"include_usage": "yes"}))
    assert bad_flag.param == "stream_options.include_usage"
    req = parse_request(CompletionRequest, completion(stream=True, stream_options={"include_usage": True}))
    assert req.include_usage
    assert not parse_request(CompletionRequest, completion(stream=True)).include_usage
    assert not parse_request(CompletionRequest, completion(stream=False, stream_options=None)).include_usage


def test_accepted_edges_and_defaults():
    req = parse_request(CompletionRequest, completion(
        temperature=0, top_p=1, min_p=1, presence_penalty=-2, frequency_penalty=2, n=1, best_of=1, echo=False,
        suffix="", logit_bias={}, logprobs=20, user="someone", seed=-(2**63), stop="\n",
        stream_options=None, min_tokens=0, include_stop_str_in_output=True, spaces_between_special_tokens=False))
    assert req.temperature == 0.0 and isinstance(req.temperature, float)
    assert req.stop == ["\n"]
    assert req.ignored_fields == ["user"]  # accepted and ignored, as OpenAI and vLLM do
    assert parse_request(CompletionRequest, completion(logprobs=0)).logprobs == 0
    assert parse_request(CompletionRequest, completion(stop=None)).stop == []
    assert parse_request(CompletionRequest, completion(stop=["a", "b", "c", "d"])).stop == ["a", "b", "c", "d"]
    tool = {"type": "function", "function": {"name": "f"}}
    tools_off = parse_request(ChatCompletionRequest, chat(tools=[tool], tool_choice="none",
                                                         response_format={"type": "text"}))
    assert tools_off.tools and tools_off.tool_mode is None and tools_off.constraint is None  # shown, not called
    for fields in ({}, {"tool_choice": "auto"}):  # tools offered: the model may call them
        auto = parse_request(ChatCompletionRequest, chat(tools=[tool], **fields))
        assert auto.tool_mode == "auto" and (auto.constraint.kind, auto.constraint.param) == ("grammar", "tool_choice")
    # Another format asked for, tool_choice not: that format, the tools only shown.
    shown = parse_request(ChatCompletionRequest, chat(tools=[tool], response_format={"type": "json_object"}))
    assert shown.tool_mode is None and shown.constraint.kind == "json_object"


@pytest.mark.parametrize("prompt,expected", [
    ("Hello", "Hello"),
    ("", ""),
    ([1, 2, 3], [1, 2, 3]),
    ([[4, 5]], [4, 5]),
    (["one"], "one"),
])
def test_prompt_forms(prompt, expected):
    assert parse_request(CompletionRequest, completion(prompt=prompt)).prompt == expected


@pytest.mark.parametrize("prompt", [
    5, None, {"text": "x"}, [], [[]], [-1], [1, 2.0], [1, True], [1, "a"], ["a", "b"], [[1], [2]],
    [["a"]], [[1, "a"]], [[-3]],
])
def test_bad_prompts_name_prompt(prompt):
    assert rejected(CompletionRequest, completion(prompt=prompt)).param == "prompt"


def test_batched_prompts_are_refused_clearly():
    error = rejected(CompletionRequest, completion(prompt=["a", "b"]))
    assert "one prompt per request" in error.message and error.code == "unsupported_value"


def test_token_ids_against_the_vocabulary():
    check_token_ids([0, 5, 9], vocab_size=10, param="prompt")
    for param in ("prompt", "stop_token_ids"):
        with pytest.raises(RequestError) as info:
            check_token_ids([0, 10], vocab_size=10, param=param)
        assert info.value.param == param and "10" in info.value.message


def test_stop_sequences_and_stop_token_ids_are_bounded():
    parse_request(CompletionRequest, completion(stop=["x" * MAX_STOP_CHARS], stop_token_ids=[1] * MAX_STOP_TOKEN_IDS))
    error = rejected(CompletionRequest, completion(stop=["ok", "x" * (MAX_STOP_CHARS + 1)]))
    assert error.param == "stop" and str(MAX_STOP_CHARS) in error.message
    error = rejected(CompletionRequest, completion(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)))
    assert error.param == "stop_token_ids"


def test_chat_content_parts_and_template_messages():
    req = parse_request(ChatCompletionRequest, chat(messages=[
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "developer", "content": "dev"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}], "name": "bot"},
    ]))
    assert req.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "line one\nline two"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function"}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "developer", "content": "dev"},
        {"role": "assistant", "content": "no", "name": "bot"},
    ]


def test_max_completion_tokens_wins_over_max_tokens():
    req = parse_request(ChatCompletionRequest, chat(max_tokens=10, max_completion_tokens=20))
    assert to_sampling_params(req).max_tokens == 20 and req.max_tokens_param == "max_completion_tokens"
    req = parse_request(ChatCompletionRequest, chat(max_tokens=10))
    assert to_sampling_params(req).max_tokens == 10 and req.max_tokens_param == "max_tokens"
    assert to_sampling_params(parse_request(ChatCompletionRequest, chat())).max_tokens is None
    assert to_sampling_params(parse_request(CompletionRequest, completion())).max_tokens is None


def test_the_request_builds_its_sampling_params():
    req = parse_request(CompletionRequest, completion(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.1,
        frequency_penalty=0.2, repetition_penalty=1.1, seed=3, stop=["x", "y"], stop_token_ids=[2],
        ignore_eos=True, logprobs=3, skip_special_tokens=False))
    params = to_sampling_params(req)
    assert params == SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.1, frequency_penalty=0.2,
        repetition_penalty=1.1, seed=3, stop=["x", "y"], stop_token_ids=[2], ignore_eos=True, logprobs=3,
        skip_special_tokens=False)
    params.validate()
    defaults = to_sampling_params(parse_request(CompletionRequest, completion(top_k=-1)))
    assert defaults == SamplingParams(max_tokens=None)  # the type's own defaults; max_tokens is filled in later


@pytest.mark.parametrize("fields,expected", [
    ({}, None), ({"logprobs": False}, None), ({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 5}, 5),
    ({"logprobs": True, "top_logprobs": 20}, 20),
])
def test_chat_logprobs_map_to_sampling(fields, expected):
    assert to_sampling_params(parse_request(ChatCompletionRequest, chat(**fields))).logprobs == expected


# --- max_tokens against the context -----------------------------------------

def test_max_tokens_defaults_to_the_rest_of_the_context():
    assert resolve_max_tokens(None, prompt_len=100, max_model_len=4096) == 3996
    assert resolve_max_tokens(3996, prompt_len=100, max_model_len=4096) == 3996
    assert resolve_max_tokens(1, prompt_len=4095, max_model_len=4096) == 1


def test_too_many_tokens_names_both_numbers():
    with pytest.raises(RequestError) as info:
        resolve_max_tokens(1000, prompt_len=4000, max_model_len=4096, prompt_param="messages")
    error = info.value
    assert (error.status, error.param, error.code) == (400, "max_tokens", "context_length_exceeded")
    assert error.message.startswith("This model's maximum context length is 4096 tokens. However, you requested "
                                    "5000 tokens (4000 in the messages, 1000 in the completion).")
    with pytest.raises(RequestError) as info:
        resolve_max_tokens(1000, 4000, 4096, prompt_param="messages", max_tokens_param="max_completion_tokens")
    assert info.value.param == "max_completion_tokens"


@pytest.mark.parametrize("requested", [None, 10])
@pytest.mark.parametrize("prompt_param", ["prompt", "messages"])
def test_a_prompt_too_long_by_itself_blames_the_prompt(requested, prompt_param):
    for prompt_len in (4096, 5000):
        with pytest.raises(RequestError) as info:
            resolve_max_tokens(requested, prompt_len, 4096, prompt_param=prompt_param)
        assert info.value.param == prompt_param
        assert "4096" in info.value.message and str(prompt_len) in info.value.message
        assert info.value.code == "context_length_exceeded"


def test_text_no_context_could_hold_is_refused_before_tokenizing(default_model):
    from services.gateway.model_info import ModelInfo

    model = ModelInfo.load(default_model, "m")
    text = "".join(chr(32 + (i * 7919) % 20000) for i in range(20000))  # all sorts of characters
    # The bound never refuses text that could fit: no tokenization packs more characters per token than it says.
    assert len(model.encode_prompt(text)) * model.max_chars_per_token >= len(text)
    check_prompt_chars(2 * 100 * model.max_chars_per_token, 100, model.max_chars_per_token, "prompt")  # at the limit
    for param in ("prompt", "messages"):
        with pytest.raises(RequestError) as info:
            check_prompt_chars(2 * 100 * model.max_chars_per_token + 1, 100, model.max_chars_per_token, param)
        assert (info.value.status, info.value.param, info.value.code) == (400, param, "context_length_exceeded")


def test_an_empty_prompt_is_refused():
    with pytest.raises(RequestError) as info:
        resolve_max_tokens(None, 0, 4096)
    assert info.value.param == "prompt"


# --- response shapes --------------------------------------------------------

VOCAB = {0: "Hello", 1: " world", 2: b"\xe2\x82", 3: "!", 4: "é"}
ENTRIES = [
    LogprobEntry(token_id=0, logprob=-0.1, top=[(0, -0.1), (1, -2.5)]),
    LogprobEntry(token_id=2, logprob=-1.0, top=[(3, -0.5), (4, -0.9)]),  # sampled token not in the top 2
    LogprobEntry(token_id=4, logprob=float("-inf"), top=[(4, float("-inf")), (1, -3.0)]),
]


def token_text(token_id: int) -> str | bytes:
    return VOCAB[token_id]


def test_completion_response_validates_as_openai_completion():
    logprobs = completion_logprobs(ENTRIES, token_text)
    body = completion_response(request_id="cmpl-1", created=1700000000, model="m",
                               choices=[completion_choice(0, "Hello\ufffdé", "length", logprobs)],
                               prompt_tokens=5, completion_tokens=3, cached_tokens=2)
    parsed = Completion.model_validate(json.loads(json.dumps(body, allow_nan=False)))
    assert parsed.object == "text_completion" and parsed.choices[0].text == "Hello\ufffdé"
    assert parsed.usage.total_tokens == 8 and parsed.usage.prompt_tokens_details.cached_tokens == 2
    lp = parsed.choices[0].logprobs
    assert lp.tokens == ["Hello", "\ufffd", "é"]
    assert lp.token_logprobs == [-0.1, -1.0, -9999.0]
    assert lp.text_offset == [0, 5, 6]
    assert lp.top_logprobs[0] == {"Hello": -0.1, " world": -2.5}
    assert lp.top_logprobs[1] == {"!": -0.5, "é": -0.9, "\ufffd": -1.0}  # up to N+1: the sampled one too
    assert completion_logprobs(ENTRIES[:1], token_text, text_offset_start=7)["text_offset"] == [7]
    zero = completion_logprobs([LogprobEntry(token_id=3, logprob=-0.2)], token_text)
    assert zero["top_logprobs"] == [{"!": -0.2}]


def test_chat_completion_response_validates_as_openai_chat_completion():
    body = chat_completion_response(request_id="chatcmpl-1", created=1700000000, model="m",
                                    choices=[chat_choice(0, "Hi there", "stop", chat_logprobs(ENTRIES, token_text))],
                                    prompt_tokens=9, completion_tokens=3, system_fingerprint="fp_1")
    parsed = ChatCompletion.model_validate(json.loads(sse(body)[len("data: "):]))
    assert parsed.choices[0].message.role == "assistant" and parsed.choices[0].message.content == "Hi there"
    assert parsed.system_fingerprint == "fp_1" and parsed.usage.completion_tokens == 3
    content = parsed.choices[0].logprobs.content
    assert [t.token for t in content] == ["Hello", "\ufffd", "é"]
    assert content[1].bytes == [0xE2, 0x82]  # the raw bytes, not those of U+FFFD
    assert content[2].bytes == list("é".encode()) and content[2].logprob == -9999.0
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("Hello", -0.1), (" world", -2.5)]
    assert len(content[1].top_logprobs) == 2
    plain = chat_completion_response(request_id="chatcmpl-2", created=1, model="m",
                                     choices=[chat_choice(0, "", "length")], prompt_tokens=1, completion_tokens=0)
    assert ChatCompletion.model_validate(plain).choices[0].logprobs is None


def test_stream_chunks_validate_as_openai_types():
    ids = dict(request_id="chatcmpl-1", created=1700000000, model="m")
    first = chat_role_chunk(**ids, include_usage=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""} and first["usage"] is None
    middle = chat_chunk(**ids, content="Hel", logprobs=chat_logprobs(ENTRIES[:1], token_text))
    last = chat_chunk(**ids, content="lo", finish_reason="stop")
    usage = usage_chunk(chat=True, **ids, prompt_tokens=4, completion_tokens=2)
    for chunk in (first, middle, last, usage):
        parsed = ChatCompletionChunk.model_validate(chunk)
        assert parsed.object == "chat.completion.chunk"
    assert ChatCompletionChunk.model_validate(last).choices[0].finish_reason == "stop"
    assert ChatCompletionChunk.model_validate(usage).choices == [] and usage["usage"]["total_tokens"] == 6

    ids = dict(request_id="cmpl-1", created=1700000000, model="m")
    final = completion_chunk(**ids, text=" world", finish_reason="length",
                             logprobs=completion_logprobs(ENTRIES[:1], token_text, text_offset_start=5))
    assert Completion.model_validate(final).choices[0].logprobs.text_offset == [5]
    assert Completion.model_validate(usage_chunk(chat=False, **ids, prompt_tokens=1, completion_tokens=2)).choices == []
    # Intermediate completion chunks carry finish_reason null, as OpenAI streams them (the openai
    # type requires a value, so check the rest of the shape with one filled in).
    partial = completion_chunk(**ids, text="Hel")
    assert partial["choices"][0]["finish_reason"] is None and "usage" not in partial
    Completion.model_validate({**partial, "choices": [{**partial["choices"][0], "finish_reason": "stop"}]})


def test_sse_framing():
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'
    assert SSE_DONE == "data: [DONE]\n\n"
    with pytest.raises(ValueError):
        sse({"x": math.nan})
    event = json.loads(sse_error(RequestError("boom", status=503))[len("data: "):])
    assert event == error_body("boom", "service_unavailable")
    assert json.loads(sse_error("lost the worker", code="worker_failed")[6:])["error"]["code"] == "worker_failed"


# --- through HTTP: the gateway's own app (not started: nothing here reaches the bus) -------------

@pytest.fixture(scope="module")
def http(default_model) -> TestClient:
    settings = GatewayServiceSettings(nats="nats://127.0.0.1:9", namespace="t", instance_id="gateway-t",
                                      model=default_model, served_model_name="m")
    return TestClient(create_app(settings), raise_server_exceptions=False)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_malformed_json_is_a_400(http):
    response = http.post("/v1/completions", content=b'{"model": "m", "prompt": ',
                         headers={"content-type": "application/json"})
    error = error_of(response, 400)
    assert "could not parse the request body as json" in error["message"].lower()
    assert error["param"] is None and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("content", [b"[1, 2]", b'"text"', b"null"])
def test_a_body_that_is_not_an_object_is_a_400(http, content):
    response = http.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert error_of(response, 400)["param"] is None


def test_validation_errors_are_400_with_the_field(http):
    error = error_of(http.post("/v1/completions", json={"prompt": "x"}), 400)
    assert error["param"] == "model" and error["code"] == "missing_required_parameter"
    assert error_of(http.post("/v1/completions", json=completion(temperature="hot")), 400)["param"] == "temperature"
    assert error_of(http.post("/v1/completions", json=completion(temperature=3)), 400)["param"] == "temperature"
    assert error_of(http.post("/v1/completions", json=completion(n=40)), 400)["param"] == "n"
    assert error_of(http.post("/v1/completions", json=completion(prompt=[["a"], ["b"]])), 400)["param"] == "prompt"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    error = error_of(http.post("/v1/chat/completions", json=chat(messages=image)), 400)
    assert error["param"] == "messages[0].content"
    assert error_of(http.post("/v1/chat/completions", content=b""), 400)["param"] is None


def test_routing_errors_are_openai_shaped(http):
    error = error_of(http.post("/v1/nothing-here", json={}), 404)
    assert error["type"] == "invalid_request_error" and error["code"] == "unknown_url"
    assert "/v1/nothing-here" in error["message"]
    error_of(http.get("/v1/completions"), 405)
    error = error_of(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404)
    assert (error["param"], error["code"]) == ("model", "model_not_found") and "gpt-9" in error["message"]


def test_service_and_server_errors(http):
    busy = from_failure("overloaded", "all workers are busy", retry_after_s=2.5).response()
    assert busy.status_code == 503 and json.loads(busy.body)["error"]["type"] == "service_unavailable"
    assert busy.headers["retry-after"] == "3"
    # A valid request reaches the bus, which this gateway never connected to: an internal error, not leaked.
    response = http.post("/v1/completions", json=completion(max_tokens=2))
    error = error_of(response, 500)
    assert error["type"] == "server_error"
    assert "request_bus" not in response.text and "Traceback" not in response.text


def test_bus_failures_map_to_http():
    invalid = from_failure("invalid_request", "bad stop token", param="stop_token_ids")
    assert (invalid.status, invalid.param, invalid.headers) == (400, "stop_token_ids", {})
    no_worker = from_failure("no_worker", "nobody home")
    assert no_worker.status == 503 and no_worker.headers == {"Retry-After": "1"}
    failed = from_failure("worker_failed", "died", retry_after_s=5)
    assert (failed.status, failed.type, failed.headers) == (500, "server_error", {})
    assert from_failure("timeout", "slow").status == 504
    assert from_failure("something new", "?").status == 500


@pytest.fixture(scope="module")
def client(http) -> openai.OpenAI:
    return openai.OpenAI(api_key="test", base_url="http://testserver/v1", http_client=http, max_retries=0)


def test_openai_client_sees_our_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=USER, temperature=5)
    assert info.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="Hi")
    assert info.value.code == "model_not_found" and info.value.param == "model"


def test_an_unknown_field_is_refused_by_name_wherever_it_is():
    error = rejected(CompletionRequest, completion(max_token=5))
    assert (error.param, error.code) == ("max_token", "unknown_parameter")
    assert error.message == "Unrecognized request argument supplied: max_token"
    nested = rejected(CompletionRequest, completion(stream=True, stream_options={"include_usage": True, "x": 1}))
    assert nested.param == "stream_options.x"


def test_a_chat_message_keeps_working_with_the_keys_clients_send_back():
    # The openai client's own assistant message, as `messages.append(reply.choices[0].message)` sends it.
    reply = {"role": "assistant", "content": "4", "refusal": None, "annotations": [], "audio": None,
             "function_call": None, "tool_calls": None}
    req = parse_request(ChatCompletionRequest, chat(messages=[{"role": "user", "content": "2+2?"}, reply]))
    assert req.template_messages()[1] == {"role": "assistant", "content": "4"}


def test_the_vllm_extensions_reach_the_sampling_parameters():
    req = parse_request(CompletionRequest, completion(
        min_tokens=3, include_stop_str_in_output=True, spaces_between_special_tokens=False,
        logit_bias={"7": -100, "12": 5.5}))
    sampling = to_sampling_params(req)
    assert (sampling.min_tokens, sampling.include_stop_str_in_output,
            sampling.spaces_between_special_tokens) == (3, True, False)
    assert sampling.logit_bias == {7: -100.0, 12: 5.5}


def test_echo_is_honoured_and_with_logprobs_only_whole():
    assert parse_request(CompletionRequest, completion(echo=True)).echo
    assert parse_request(CompletionRequest, completion(echo=True, logprobs=1)).echo_logprobs
    error = rejected(CompletionRequest, completion(echo=True, logprobs=1, stream=True))
    assert error.param == "echo" and "whole responses" in error.message


@pytest.mark.parametrize("kwargs", [{"tokenize": False}, {"messages": []}, {"chat_template": "{{ 1 }}"}])
def test_chat_template_kwargs_cannot_change_how_the_template_is_called(kwargs):
    assert rejected(ChatCompletionRequest, chat(chat_template_kwargs=kwargs)).param == "chat_template_kwargs"
    assert parse_request(ChatCompletionRequest, chat(chat_template_kwargs={"enable_thinking": False}))


def test_each_choice_has_its_own_seed_within_64_bits():
    from services.gateway.app import choice_seed

    assert [choice_seed(41, i) for i in range(3)] == [41, 42, 43]
    assert choice_seed(None, 2) is None  # unseeded: each draws its own at random
    assert choice_seed(2**63 - 1, 1) == -(2**63)  # wraps, staying a signed 64-bit integer
