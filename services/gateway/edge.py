"""The gateway's edge: who may call the API, how large a request body may be, and what its strings may hold.

- API keys: `Authorization: Bearer KEY`, compared in constant time with every configured key
  (`services.gateway.tenants`, which finds the key's tenant); a missing or wrong key is a 401 in OpenAI's error
  shape. Keys are never logged or echoed.
- Bodies: at most `max_request_bytes`; a larger declared length is refused before anything is read, and a
  body without one (chunked) stops being read at the limit. Either way a 413. A body not all in within
  `request_body_timeout` is a 408, and the connection closes: a client trickling its body holds it no longer.
- Strings: JSON can spell a lone UTF-16 surrogate (`"\\ud800"`), which is not a character: no tokenizer or
  encoder takes it, and echoing it back fails. Such a request is a 400 naming the field.
"""

import asyncio

from fastapi import Request

from services.gateway.errors import RequestError



def presented_key(header: str | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` header (None: no bearer key)."""
    scheme, _, presented = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return presented.strip() or None


def unauthorized() -> RequestError:
    return RequestError("Incorrect or missing API key. Send it as `Authorization: Bearer KEY`.", status=401,
                        code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _too_large(limit: int) -> RequestError:
    return RequestError(f"The request body is larger than this server takes ({limit} bytes).", status=413,
                        code="request_too_large")


def _too_slow(timeout_s: float) -> RequestError:
    return RequestError(f"The request body did not arrive within {timeout_s:g} s.", status=408,
                        code="request_timeout", headers={"Connection": "close"})


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The request's body, or a 413 once it is known to exceed `limit` bytes, or a 408 if it is not all in
    `timeout_s` seconds after this began reading it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise _too_slow(timeout_s) from None
    return b"".join(chunks)


def _is_text(value: str) -> bool:
    if value.isascii():  # most strings: no copy made
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def lone_surrogate_at(document) -> str | None:
    """The path (`messages[0].content`) of the first string, key or value, holding a lone surrogate; None if
    every string is text. Iterative: as deep as the JSON parser allowed."""
    stack = [(document, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _is_text(value):
                return path or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                child = f"{path}.{key}" if path else str(key)
                if not _is_text(key):
                    return path or "body"
                stack.append((item, child))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))
    return None


def check_text(document) -> None:
    """A 400 naming the field when a string of the request is not valid Unicode."""
    where = lone_surrogate_at(document)
    if where is not None:
        param = None if where == "body" else where
        raise RequestError(f"Invalid value for '{where}': the string holds a lone surrogate (an escape such as "
                           "\\ud800 without its pair), which is not valid Unicode.", param, code="invalid_value")
