"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.

Everything the gateway rejects becomes a `RequestError`; `install_error_handlers`
turns it, FastAPI's own validation and routing errors, and anything unexpected
into that shape with the right HTTP status. Nothing else in the gateway builds
error bodies.
"""

import math
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from shared.engine import InvalidRequestError

INTERNAL_ERROR_MESSAGE = "The server had an error while processing your request."

# RequestFailed / StreamError code -> (HTTP status, OpenAI error type)
_FAILURE_STATUS = {
    "invalid_request": (400, "invalid_request_error"),
    "overloaded": (503, "service_unavailable"),
    "queue_full": (429, "rate_limit_exceeded"),
    "no_worker": (503, "service_unavailable"),
    "shutting_down": (503, "service_unavailable"),
    "timeout": (504, "server_error"),
    "worker_failed": (500, "server_error"),
    "cancelled": (500, "server_error"),
    "stream_broken": (500, "server_error"),
    "internal": (500, "server_error"),
}


def default_error_type(status: int) -> str:
    if status == 503:
        return "service_unavailable"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class RequestError(Exception):
    """A request the gateway answers with an error; `param` names the culprit field."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400, code: str | None = None,
                 type: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.type = type or default_error_type(status)
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)

    def __repr__(self) -> str:
        return f"RequestError({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"


def model_not_found(name: str) -> RequestError:
    return RequestError(f"The model `{name}` does not exist or you do not have access to it.", "model",
                        status=404, code="model_not_found")


def retry_after_header(retry_after_s: float | None) -> dict[str, str]:
    """Retry-After takes whole seconds; round up so a client never comes back early."""
    if retry_after_s is None:
        return {}
    return {"Retry-After": str(max(1, math.ceil(retry_after_s)))}


def from_failure(code: str, message: str, param: str | None = None,
                 retry_after_s: float | None = None) -> RequestError:
    """The HTTP error for a request that failed on the bus (RequestFailed / StreamError fields)."""
    status, error_type = _FAILURE_STATUS.get(code, (500, "server_error"))
    if status >= 500 and status != 503:
        retry_after_s = None  # only "try again later" errors promise a retry time
    elif status in (429, 503) and retry_after_s is None:
        retry_after_s = 1.0
    return RequestError(message, param if status == 400 else None, status=status, code=code, type=error_type,
                        headers=retry_after_header(retry_after_s))


def from_invalid_request(exc: InvalidRequestError) -> RequestError:
    """The engine's validation (SamplingParams) in the HTTP shape."""
    return RequestError(str(exc), exc.param, code="invalid_value")


def param_from_loc(loc: Sequence[Any]) -> str | None:
    """("body", "messages", 0, "content") -> "messages[0].content"."""
    parts = list(loc)
    if parts and parts[0] == "body":
        parts = parts[1:]
    param = ""
    for part in parts:
        if isinstance(part, int):
            param += f"[{part}]"
        else:
            param += f".{part}" if param else str(part)
    return param or None


def from_validation_errors(errors: Sequence[Mapping[str, Any]]) -> RequestError:
    """The first of pydantic's / FastAPI's validation errors as a 400."""
    if not errors:
        return RequestError("The request is invalid.")
    error = errors[0]
    kind = error.get("type", "")
    loc = tuple(error.get("loc", ()))
    if kind == "json_invalid":
        detail = (error.get("ctx") or {}).get("error")
        where = f" at character {loc[1]}" if len(loc) > 1 and isinstance(loc[1], int) else ""
        reason = f" ({detail}{where})" if detail else ""
        return RequestError(f"We could not parse the request body as JSON{reason}. The body must be a JSON object.",
                            code="invalid_json")
    param = param_from_loc(loc)
    if param is None:
        if kind == "missing":
            return RequestError("The request body is missing; expected a JSON object.", code="invalid_json")
        return RequestError("The request body must be a JSON object (with Content-Type: application/json).",
                            code="invalid_json")
    message = error.get("msg", "invalid value")
    if kind == "missing":
        return RequestError(f"Missing required parameter: '{param}'.", param, code="missing_required_parameter")
    if kind == "extra_forbidden":  # a field the API does not know: refused rather than run as if never sent
        return RequestError(f"Unrecognized request argument supplied: {param}", param, code="unknown_parameter")
    if kind.endswith("_type") or kind.endswith("_parsing"):
        return RequestError(f"Invalid type for '{param}': {message}.", param, code="invalid_type")
    return RequestError(f"Invalid value for '{param}': {message}.", param, code="invalid_value")


def _http_error(request: Request, exc: HTTPException) -> RequestError:
    if exc.status_code == 404 and exc.detail == "Not Found":
        message, code = f"Unknown request URL: {request.method} {request.url.path}.", "unknown_url"
    elif exc.status_code == 405 and exc.detail == "Method Not Allowed":
        message, code = f"Method {request.method} is not allowed for {request.url.path}.", "method_not_allowed"
    else:
        message, code = str(exc.detail), None
    return RequestError(message, status=exc.status_code, code=code, headers=exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Make every error `app` returns OpenAI-shaped; validation errors are 400s, never 422s."""

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(InvalidRequestError)
    async def _engine_invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return from_invalid_request(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_errors(exc.errors()).response()

    @app.exception_handler(HTTPException)
    async def _http_exception(request: Request, exc: HTTPException) -> JSONResponse:
        return _http_error(request, exc).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after sending this, so the server logs the traceback;
        # the client sees only a generic message.
        response = RequestError(INTERNAL_ERROR_MESSAGE, status=500, code="internal_error").response()
        # This handler runs outside the app's middleware, which would otherwise add the header.
        request_id = getattr(request.state, "request_id", None)
        if request_id:
            response.headers["x-request-id"] = request_id
        return response
