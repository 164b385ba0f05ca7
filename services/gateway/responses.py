"""OpenAI response bodies and stream chunks, as plain dicts ready for JSON.

Logprobs arrive as the wire carries them (TokenChunk.logprobs): per token a
`LogprobEntry` (token_id, logprob, top: [(token_id, logprob), ...], top-N best first).
Token strings come from the caller's `token_text(token_id)`, which returns the
token's text (str) or its raw bytes (bytes, for tokens that are only part of a
UTF-8 character); `bytes` in chat logprobs are the token's UTF-8 bytes.
"""

import json
import math
from collections.abc import Callable, Sequence
from typing import Any

from contracts import LogprobEntry
from services.gateway.errors import RequestError, error_body

TokenText = Callable[[int], str | bytes]

SSE_DONE = "data: [DONE]\n\n"
MIN_LOGPROB = -9999.0  # what -inf is reported as: JSON has no infinity


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


class _Tokens:
    """token id -> (text, utf-8 bytes), each looked up once per response."""

    def __init__(self, token_text: TokenText):
        self._token_text = token_text
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._cache:
            text = self._token_text(token_id)
            if isinstance(text, bytes):
                raw, text = text, text.decode("utf-8", errors="replace")
            else:
                raw = text.encode("utf-8")
            self._cache[token_id] = (text, list(raw))
        return self._cache[token_id]


def completion_logprobs(entries: Sequence[LogprobEntry], token_text: TokenText, text_offset_start: int = 0) -> dict:
    """The legacy completions logprobs object.

    top_logprobs holds the top N and always the sampled token (so up to N+1
    entries, as OpenAI documents). text_offset counts characters from
    `text_offset_start` (in a stream: the length of the text already sent).
    """
    lookup = _Tokens(token_text)
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    offset = text_offset_start
    for entry in entries:
        text, _ = lookup(entry.token_id)
        tokens.append(text)
        token_logprobs.append(_finite(entry.logprob))
        top = {lookup(token_id)[0]: _finite(logprob) for token_id, logprob in entry.top}
        top.setdefault(text, _finite(entry.logprob))
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def echoed_logprobs(prompt_token_ids: Sequence[int], prompt_entries: Sequence[LogprobEntry], token_text: TokenText,
                    completion: dict | None) -> dict:
    """The legacy logprobs object of an echoed completion: the prompt's tokens first (the first one's logprob
    null: nothing precedes it), then the completion's (`completion`, counted from the end of the prompt)."""
    lookup = _Tokens(token_text)
    first = lookup(prompt_token_ids[0])[0] if prompt_token_ids else ""
    rest = completion_logprobs(prompt_entries, token_text, len(first))
    echoed = {"tokens": [first, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
              "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}
    for key in echoed:
        echoed[key] += (completion or {}).get(key, [])
    return echoed


def chat_logprobs(entries: Sequence[LogprobEntry], token_text: TokenText) -> dict:
    """The chat logprobs object: `{"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}`."""
    lookup = _Tokens(token_text)

    def item(token_id: int, logprob: float) -> dict:
        text, raw = lookup(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": raw}

    content = []
    for entry in entries:
        token = item(entry.token_id, entry.logprob)
        token["top_logprobs"] = [item(token_id, logprob) for token_id, logprob in entry.top]
        content.append(token)
    return {"content": content, "refusal": None}


def _envelope(object_type: str, request_id: str, created: int, model: str, choices: list,
              system_fingerprint: str | None) -> dict:
    return {"id": request_id, "object": object_type, "created": created, "model": model, "choices": choices,
            "system_fingerprint": system_fingerprint}


# Whole responses (stream=false): one choice per completion asked for (`n`).

def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None,
                      prompt_logprobs: list | None = None) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    return choice


def prompt_logprobs(entries: list, token_text) -> list:
    """vLLM's `prompt_logprobs`: None for the prompt's first token, then per token {token id: {logprob, rank,
    decoded_token}} for the token itself and the top alternatives (ranked 1..)."""
    shown: list = [None]
    for entry in entries:
        position = {str(token_id): {"logprob": value, "rank": rank, "decoded_token": token_text(token_id)}
                    for rank, (token_id, value) in enumerate(entry.top, 1)}
        position[str(entry.token_id)] = {"logprob": entry.logprob, "rank": entry.rank,
                                         "decoded_token": token_text(entry.token_id)}
        shown.append(position)
    return shown


def chat_choice(index: int, content: str | None, finish_reason: str | None, logprobs: dict | None = None,
                tool_calls: list[dict] | None = None) -> dict:
    """A whole chat choice; with `tool_calls`, its content is null and the calls are the answer."""
    message = {"role": "assistant", "content": content, "refusal": None, "annotations": []}
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_response(*, request_id: str, created: int, model: str, choices: list[dict], prompt_tokens: int,
                        completion_tokens: int, cached_tokens: int = 0, system_fingerprint: str | None = None) -> dict:
    body = _envelope("text_completion", request_id, created, model, choices, system_fingerprint)
    body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
    return body


def chat_completion_response(*, request_id: str, created: int, model: str, choices: list[dict], prompt_tokens: int,
                             completion_tokens: int, cached_tokens: int = 0,
                             system_fingerprint: str | None = None) -> dict:
    body = _envelope("chat.completion", request_id, created, model, choices, system_fingerprint)
    body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
    return body


# Stream chunks (stream=true). With stream_options.include_usage every chunk
# carries "usage": null and the stream ends with `usage_chunk` (no choices).

def completion_chunk(*, request_id: str, created: int, model: str, text: str, finish_reason: str | None = None,
                     logprobs: dict | None = None, include_usage: bool = False,
                     system_fingerprint: str | None = None, index: int = 0) -> dict:
    choice = completion_choice(index, text, finish_reason, logprobs)
    chunk = _envelope("text_completion", request_id, created, model, [choice], system_fingerprint)
    if include_usage:
        chunk["usage"] = None
    return chunk


def chat_chunk(*, request_id: str, created: int, model: str, content: str | None = None, role: str | None = None,
               finish_reason: str | None = None, logprobs: dict | None = None, include_usage: bool = False,
               system_fingerprint: str | None = None, index: int = 0, tool_calls: list[dict] | None = None) -> dict:
    """One chat delta. A stream starts with `role="assistant", content=""`, then
    carries content deltas (or tool call deltas); the last one has the finish_reason."""
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if tool_calls:
        delta["tool_calls"] = tool_calls
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    chunk = _envelope("chat.completion.chunk", request_id, created, model, [choice], system_fingerprint)
    if include_usage:
        chunk["usage"] = None
    return chunk


def chat_role_chunk(*, request_id: str, created: int, model: str, include_usage: bool = False,
                    system_fingerprint: str | None = None, index: int = 0) -> dict:
    return chat_chunk(request_id=request_id, created=created, model=model, content="", role="assistant",
                      include_usage=include_usage, system_fingerprint=system_fingerprint, index=index)


def usage_chunk(*, chat: bool, request_id: str, created: int, model: str, prompt_tokens: int,
                completion_tokens: int, cached_tokens: int = 0, system_fingerprint: str | None = None) -> dict:
    object_type = "chat.completion.chunk" if chat else "text_completion"
    chunk = _envelope(object_type, request_id, created, model, [], system_fingerprint)
    chunk["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
    return chunk


# Server-sent events.

def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'), allow_nan=False)}\n\n"


def sse_error(error: RequestError | str, *, type: str = "server_error", param: str | None = None,
              code: str | None = None) -> str:
    """An error after the stream has started (the status line is already 200).

    The openai client raises APIError on a data event holding "error". Send
    SSE_DONE after it.
    """
    if isinstance(error, RequestError):
        return sse(error.body())
    return sse(error_body(error, type, param, code))
