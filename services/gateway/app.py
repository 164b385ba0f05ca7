"""The OpenAI-compatible HTTP API: validate, submit over NATS to the model asked for, stream back as SSE."""

import asyncio
import inspect
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, contextmanager

import msgspec
import structlog
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from services.common.startup_heap import freeze_startup_heap
from services.common.tenant_keys import DEFAULT_TENANT, Tenant
from services.gateway import responses
from services.gateway.cache_salt import cache_salt
from services.gateway.edge import check_text, read_body, unauthorized
from services.gateway.choices import Choices, submit_all
from services.gateway.errors import RequestError, from_failure, from_invalid_request, install_error_handlers
from services.gateway.gateway import Gateway
from services.gateway.guard import Guard
from services.gateway.model_backend import BusAccess, ModelBackend
from services.gateway.model_info import ModelInfo
from services.gateway.request_telemetry import RequestTelemetry
from services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_chat_chars,
    check_prompt_chars,
    check_prompt_tokens,
    check_token_ids,
    check_vocabulary_fields,
    parse_request,
    resolve_max_tokens,
    to_sampling_params,
)
from services.gateway.settings import GatewayServiceSettings
from services.gateway.streams import StreamError
from services.gateway.structured_request import check_constraint
from services.gateway.tool_calls import ToolCallOutput
from shared.engine import InvalidRequestError, SamplingParams
from shared.telemetry.logging import get_logger
from shared.telemetry.tracing import shutdown_tracing
from shared.version import VERSION

log = get_logger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as OpenAI's legacy completions API


def create_app(settings: GatewayServiceSettings, bus: BusAccess | None = None, run_dir: str | None = None) -> FastAPI:
    """The gateway's HTTP API over `settings` (see `Gateway` for `bus` and `run_dir`): every served model's."""
    gateway = Gateway(settings, bus, run_dir)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.start()
        freeze_startup_heap()
        yield
        await gateway.stop()
        shutdown_tracing()

    app = FastAPI(title="splitserve", lifespan=lifespan, **_http_telemetry())
    app.state.gateway = gateway
    install_error_handlers(app)
    _guard(app, gateway)
    _state_routes(app, gateway)
    _token_routes(app, gateway)
    _generation_routes(app, gateway)
    return app


def _guard(app: FastAPI, gateway: Gateway) -> None:
    """The API key check (which finds the request's tenant), and the request id every answer carries."""
    settings, tenants = gateway.settings, gateway.tenants
    # The API's description (what it takes, which extensions) is the API's too.
    docs = {app.docs_url, app.redoc_url, app.openapi_url, app.swagger_ui_oauth2_redirect_url} - {None}

    def guarded(path: str) -> bool:
        return (path.startswith("/v1/") or path in ("/tokenize", "/detokenize") or path in docs
                or (path == "/metrics" and settings.protect_metrics))

    app.add_middleware(Guard, tenants=tenants, guarded=guarded)


def _state_routes(app: FastAPI, gateway: Gateway) -> None:
    """What the deployment and the model look like: probes, the model card, the version, metrics."""

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = gateway.liveness()
        return JSONResponse(body, status_code=status)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        status, body = gateway.readiness()
        return JSONResponse(body, status_code=status, headers={"Retry-After": "1"} if status == 503 else None)

    @app.get("/v1/models")
    async def models() -> dict:
        cards = [{"id": name, "object": "model", "created": backend.created_s, "owned_by": "splitserve",
                  "max_model_len": backend.max_model_len} for name, backend in list(gateway.backends.items())]
        return {"object": "list", "data": cards}

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await gateway.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


def _token_routes(app: FastAPI, gateway: Gateway) -> None:
    """vLLM's /tokenize and /detokenize, with the model the request names (the first model served without one)."""
    settings = gateway.settings

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        req = parse_request(TokenizeRequest, await read_json(request, settings))
        backend = gateway.backend_for(req.model)
        model, max_model_len = backend.model, backend.max_model_len
        if req.prompt is not None:
            check_prompt_chars(len(req.prompt), max_model_len, model.max_chars_per_token, "prompt")
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await run_in_threadpool(model.encode_prompt, req.prompt, add_special)
        else:
            messages = [m.template_dict() for m in req.messages]
            check_chat_chars(messages, req.tools, req.chat_template_kwargs, max_model_len, model.max_chars_per_token)
            # Tools offered may be called (as a chat request without tool_choice has it): the same prompt.
            ids = await run_in_threadpool(model.encode_chat, messages, req.tools, req.chat_template_kwargs,
                                          req.add_generation_prompt, bool(req.tools))
            if req.add_special_tokens and model.tokenizer.bos_token_id is not None:
                ids = [model.tokenizer.bos_token_id, *ids]
        check_prompt_tokens(len(ids), max_model_len, "prompt" if req.prompt is not None else "messages")
        strs = model.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req = parse_request(DetokenizeRequest, await read_json(request, settings))
        backend = gateway.backend_for(req.model)
        if len(req.tokens) > backend.max_model_len:
            raise RequestError(f"tokens holds {len(req.tokens)} ids, more than the model's context of "
                               f"{backend.max_model_len}", "tokens", code="invalid_value")
        check_token_ids(req.tokens, backend.model.vocab_size, "tokens")
        return {"prompt": await run_in_threadpool(backend.model.tokenizer.decode, req.tokens)}


def _generation_routes(app: FastAPI, gateway: Gateway) -> None:
    """The OpenAI API's completions and chat completions, each to the model it names."""
    settings = gateway.settings

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_request(CompletionRequest, await read_json(request, settings))
        backend = gateway.backend_for(req.model)
        if isinstance(req.prompt, str):
            check_prompt_chars(len(req.prompt), backend.max_model_len, backend.model.max_chars_per_token, "prompt")
        prompt_ids = await run_in_threadpool(backend.model.encode_prompt, req.prompt)
        return await generate(gateway, backend, request, req, prompt_ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_request(ChatCompletionRequest, await read_json(request, settings))
        backend = gateway.backend_for(req.model)
        messages = req.template_messages()
        check_chat_chars(messages, req.tools, req.chat_template_kwargs, backend.max_model_len,
                         backend.model.max_chars_per_token)
        prompt_ids = await run_in_threadpool(backend.model.encode_chat, messages, req.tools,
                                             req.chat_template_kwargs, True, req.tool_mode is not None)
        return await generate(gateway, backend, request, req, prompt_ids, chat=True)


_UNTRACED_PATHS = ("/health", "/ready", "/metrics")


def _http_telemetry() -> dict:
    """FastAPI's own HTTP spans (where this FastAPI makes them): the API's requests, not health checks and scrapes,
    exported by our tracer provider (shared/telemetry/tracing.py), without per-dependency spans."""
    if "telemetry" not in inspect.signature(FastAPI).parameters:
        return {}
    return {"telemetry": {"exclude": lambda scope: scope.get("path") in _UNTRACED_PATHS, "operation_spans": False,
                          "auto_configure": False}}


async def read_json(request: Request, settings: GatewayServiceSettings):
    raw = await read_body(request, settings.max_request_bytes, settings.request_body_timeout)
    try:
        document = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise RequestError("Could not parse the request body as JSON.", code="invalid_json") from None
    check_text(document)
    return document


def check_admission(waiting: int, max_waiting: int, draining: bool = False) -> None:
    """StreamError("shutting_down") while the gateway drains; StreamError("queue_full") when `max_waiting`
    requests (0: no bound) already wait for their first token: told before anything is queued, so that the
    admitted ones keep their latency."""
    if draining:
        raise StreamError("shutting_down", "the gateway is shutting down; send the request again", retry_after_s=1.0)
    if max_waiting and waiting >= max_waiting:
        raise StreamError("queue_full", f"{waiting} requests are already waiting for their first token; try again "
                                        "shortly", retry_after_s=1.0)


_IGNORED_NOTED: set[str] = set()


def _note_ignored(fields: list[str]) -> None:
    """Fields accepted and ignored (`user`): said once per process, at debug level."""
    for name in fields:
        if name not in _IGNORED_NOTED:
            _IGNORED_NOTED.add(name)
            log.debug("request field accepted and ignored", field=name)


def stamp_tenant(gateway: Gateway, request: Request, req, sampling: SamplingParams) -> None:
    """The request's tenant on its parameters: the workers share their batches between tenants by its name and
    priority, and its prefixes are reused only under its cache salt: its tenant's, mixed with the one it asked for
    (one salt for all without keys, or when the operator shares prefixes across tenants)."""
    tenant = request_tenant(request)
    shared = gateway.settings.share_prefix_cache or not gateway.tenants.guarded
    sampling.cache_salt = cache_salt(None if shared else tenant.name, req.cache_salt)
    sampling.tenant, sampling.priority = tenant.name, tenant.priority


def request_tenant(request: Request) -> Tenant:
    return getattr(request.state, "tenant", DEFAULT_TENANT)


async def _in_turn(gateway: Gateway, request: Request, telemetry: RequestTelemetry, prompt_tokens: int, cost: int,
                   model: str, submit):
    """Past its tenant's limits (else their 429), then its turn in the fair queue: `submit()` the request."""
    telemetry.ticket = gateway.admission.enter(request_tenant(request), prompt_tokens, cost, model)
    await gateway.admission.wait_turn(telemetry.ticket)
    return await submit()


async def generate(gateway: Gateway, backend: ModelBackend, request: Request, req, prompt_ids: list[int],
                   chat: bool):
    endpoint = "chat" if chat else "completions"
    check_vocabulary_fields(req, backend.model.vocab_size)
    _note_ignored(req.ignored_fields)
    sampling = to_sampling_params(req)  # this request's own: filled in here, then validated
    stamp_tenant(gateway, request, req, sampling)
    requested = sampling.max_tokens
    if requested is None and not chat:
        requested = COMPLETIONS_DEFAULT_MAX_TOKENS
    sampling.max_tokens = resolve_max_tokens(
        requested, len(prompt_ids), backend.max_model_len,
        prompt_param="messages" if chat else "prompt", max_tokens_param=req.max_tokens_param,
    )
    echo_logprobs = not chat and req.echo_logprobs
    if echo_logprobs and sampling.prompt_logprobs is None:
        sampling.prompt_logprobs = req.logprobs  # the echoed prompt's logprobs head the completion's
    if sampling.prompt_logprobs is not None:
        check_prompt_logprobs_size(len(prompt_ids), sampling.prompt_logprobs, backend.nc.max_payload,
                                   "echo" if req.prompt_logprobs is None else "prompt_logprobs")
    returned, n = req.n or 1, req.candidates  # best_of: n candidates, the `returned` most likely returned
    if n > returned and sampling.logprobs is None:
        sampling.logprobs = 0  # each token's logprob ranks the candidates (not returned unless asked for)
    bound = gateway.settings.max_waiting_requests
    if bound and n > bound:
        raise RequestError(f"{n} choices would never be admitted: this gateway takes at most {bound} requests "
                           "waiting for their first token", "best_of" if n > returned else "n", code="invalid_value")
    try:
        sampling.validate()
    except InvalidRequestError as exc:
        raise from_invalid_request(exc) from None
    # (the prompt's logprobs are the same for every choice: the first computes them, the others share its KV)
    params = [sampling] + [msgspec.structs.replace(sampling, seed=choice_seed(sampling.seed, i), prompt_logprobs=None)
                           for i in range(1, n)]
    if req.constraint is not None:  # compiled here first: a bad schema or grammar is this request's 400
        await check_constraint(req.constraint)

    request_id = request.state.request_id
    response_id = ("chatcmpl-" if chat else "cmpl-") + request_id
    telemetry = RequestTelemetry(backend.series, endpoint, request_id, len(prompt_ids), sampling.max_tokens,
                                 bool(req.stream))
    request.state.trace_id = telemetry.trace_id
    bus_ids = [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]

    def submit(i: int):
        if i == 0:  # (once its first choice is on, a request's others go on while its model is unserved)
            backend.check_open()
        return backend.request_bus.submit(bus_ids[i], req.model, prompt_ids, params[i],
                                          headers=telemetry.headers({}))

    with structlog.contextvars.bound_contextvars(request_id=request_id, trace_id=telemetry.trace_id):
        with _failures_counted(telemetry):
            check_admission(backend.streams.num_waiting() + n - 1, gateway.settings.max_waiting_requests,
                            gateway.draining)
            turn = _in_turn(gateway, request, telemetry, len(prompt_ids), len(prompt_ids) + sampling.max_tokens * n,
                            backend.name, lambda: submit(0))
            stream = await _unless_disconnected(request, turn, discard=backend.request_bus.release)
            if stream is None:  # the client left while the request waited for a worker (submit cancelled it)
                telemetry.finish("cancelled")
                return Response(status_code=499)
        telemetry.assigned(stream.worker_instance or "")
        choices = Choices(backend.request_bus, stream, n,
                          lambda: submit_all(submit, range(1, n), backend.request_bus.release))
        try:
            echo = "" if chat or not req.echo else (
                req.prompt if isinstance(req.prompt, str) else backend.model.tokenizer.decode(prompt_ids))
            renderer = _Renderer(backend.model, response_id, req.model, chat, req.include_usage, echo, n,
                                 req.tool_mode if chat else None, returned, req.sampling_logprobs is not None)
            telemetry.usage_of = lambda: renderer.usage  # what a request that ends early counts
            if echo_logprobs:
                renderer.echo_prompt(prompt_ids, with_prompt_logprobs=req.prompt_logprobs is not None)
            if req.stream:
                events = _sse_events(gateway, choices, renderer, telemetry)
                return _EventStream(events, gateway, choices, telemetry, media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache", "x-request-id": request_id})
        except BaseException:
            telemetry.finish("internal")
            gateway.spawn(choices.release())
            raise
        return await _collect_until_done(gateway, request, choices, renderer, telemetry)


# A prompt token's logprob entry on the wire: about 48 bytes, and 16 per alternative (measured: 4,000 tokens with 20
# alternatives encode to 1.31 MB; this estimate says 1.47).
_PROMPT_LOGPROB_BYTES, _ALTERNATIVE_BYTES = 48, 16


def check_prompt_logprobs_size(prompt_tokens: int, alternatives: int, max_payload: int, param: str) -> None:
    """A 400 when the prompt's logprobs would not fit the one message that carries them (NATS's max_payload,
    with room for the rest of it)."""
    estimate = prompt_tokens * (_PROMPT_LOGPROB_BYTES + _ALTERNATIVE_BYTES * alternatives)
    if estimate > 0.8 * max_payload:
        raise RequestError(f"the logprobs of a {prompt_tokens}-token prompt with {alternatives} alternatives each "
                           f"(about {estimate} bytes) do not fit a message of this deployment's bus ({max_payload} "
                           "bytes); ask for fewer alternatives or a shorter prompt", param, code="invalid_value")


def best_choices(collected: list[tuple[str, list]], count: int) -> list[int]:
    """The indices of the `count` choices of highest cumulative logprob, best first (all of them, in order, when
    count is all): best_of's pick, as vLLM makes it. Ties go to the earlier choice."""
    if count >= len(collected):
        return list(range(len(collected)))
    total = [sum(entry.logprob for entry in entries) for _, entries in collected]
    return sorted(range(len(collected)), key=lambda i: (-total[i], i))[:count]


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice `index`'s seed: the request's for the first, the next ones after it for the others (wrapping within
    a signed 64-bit integer), so that seeded choices differ from each other and repeat from run to run."""
    if seed is None or index == 0:
        return seed
    return (seed + index + 2**63) % 2**64 - 2**63


@contextmanager
def _failures_counted(telemetry: RequestTelemetry):
    """End the request's telemetry by how the block failed: a stream error (turned into its HTTP error), the
    client or the server going away ("cancelled"), anything else ("internal")."""
    try:
        yield
    except StreamError as exc:
        telemetry.finish(exc.code, message=str(exc))
        raise from_failure(exc.code, str(exc), exc.param, exc.retry_after_s) from None
    except RequestError as exc:  # a limit's 429
        telemetry.finish(exc.code or "rejected", message=exc.message)
        raise
    except asyncio.CancelledError:
        telemetry.finish("cancelled")
        raise
    except BaseException:
        telemetry.finish("internal")
        raise


class _EventStream(StreamingResponse):
    """SSE whose request is released on the bus however the response ends.

    Starlette cancels the sending task on a client disconnect, which may leave
    the event generator suspended (or never started); closing it here runs its
    cleanup, and releasing the stream cancels the request everywhere.
    """

    def __init__(self, events, gateway: "Gateway", choices: Choices, telemetry: RequestTelemetry, **kwargs):
        super().__init__(events, **kwargs)
        self._events, self._gateway, self._choices, self._telemetry = events, gateway, choices, telemetry

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
            self._telemetry.finish("cancelled")  # (a no-op if the stream ended on its own)
            self._gateway.spawn(self._choices.release())


async def _unless_disconnected(request: Request, coro, discard=None):
    """Await `coro`, or cancel it and return None if the client disconnects first (or this is cancelled). What
    it returns all the same (it finished as the cancel came) goes to `discard`, e.g. to let a request go."""
    task = asyncio.create_task(coro)
    watch = asyncio.create_task(_client_gone(request))
    handed_over = False
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            handed_over = True
            return task.result()
    finally:
        watch.cancel()
        if not handed_over:
            task.cancel()
            await asyncio.wait({task})
            if discard is not None and not task.cancelled() and task.exception() is None:
                await discard(task.result())
    return None


async def _client_gone(request: Request) -> None:
    """Returns once the client has closed the connection (its body already read). Waits on the ASGI receive
    channel (`Request.is_disconnected` only polls it, under a cancelled scope)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)  # nothing else is due once the body is read; never spin on it


class _Renderer:
    """Turns token chunks into OpenAI responses (whole or as SSE chunks), for each of the request's `n` choices."""

    def __init__(self, model_info: ModelInfo, response_id: str, model: str, chat: bool, include_usage: bool,
                 echo: str = "", n: int = 1, tool_mode: str | None = None, returned: int | None = None,
                 with_logprobs: bool = True):
        self.token_text = model_info.token_text  # (the model's own: logprobs' token strings)
        self.chat, self.include_usage, self.n = chat, include_usage, n
        # best_of: of the n choices, the `returned` most likely (highest cumulative logprob) make the response
        self.returned = n if returned is None else returned
        self.with_logprobs = with_logprobs
        # "auto", "required" or "named": each choice's text is (or may be) its tool calls
        self.tool_mode = tool_mode
        self._tool_outputs = [ToolCallOutput(tool_mode) for _ in range(n)] if tool_mode else []
        self.common = {"request_id": response_id, "created": int(time.time()), "model": model}
        self.echo = echo  # the prompt's text, ahead of each completion's (a completion's echo=true)
        self._echo_owed = [bool(echo)] * n
        self._text_sent = [0] * n
        self._usages = [(0, 0, 0)] * n
        self._finish_reasons: list[str | None] = [None] * n
        self.prompt_logprobs: list | None = None  # the prompt's, when asked for (they come with the first chunk)
        self._echoed_ids: list[int] | None = None  # echo with logprobs: the prompt, whose logprobs lead
        self._show_prompt_logprobs = True

    @property
    def usage(self) -> tuple[int, int, int]:
        """(prompt, completion, cached) tokens of the request: the prompt once, every choice's completion."""
        return (max(u[0] for u in self._usages), sum(u[1] for u in self._usages), max(u[2] for u in self._usages))

    @property
    def finish_reason(self) -> str | None:
        return self._finish_reasons[0]

    @property
    def first_completion_tokens(self) -> int:
        """The first choice's completion tokens: the request's latencies are its."""
        return self._usages[0][1]

    def logprobs(self, index: int, chunk) -> dict | None:
        if not chunk.logprobs:
            return None
        token_text = self.token_text
        if self.chat:
            return responses.chat_logprobs(chunk.logprobs, token_text)
        return responses.completion_logprobs(chunk.logprobs, token_text, self._text_sent[index])

    def note(self, index: int, chunk) -> None:
        self._usages[index] = (chunk.prompt_tokens, chunk.completion_tokens, chunk.cached_tokens)
        self._finish_reasons[index] = chunk.finish_reason
        if chunk.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = chunk.prompt_logprobs

    def echo_prompt(self, prompt_token_ids: list[int], with_prompt_logprobs: bool) -> None:
        """The completions' logprobs begin with the echoed prompt's; `with_prompt_logprobs`: the client asked for
        prompt_logprobs too (else they only serve the echo)."""
        self._echoed_ids, self._show_prompt_logprobs = list(prompt_token_ids), with_prompt_logprobs

    def _completion_logprobs(self, entries: list) -> dict | None:
        token_text = self.token_text
        if self._echoed_ids is not None:
            return responses.echoed_logprobs(self._echoed_ids, self.prompt_logprobs or [], token_text,
                                             responses.completion_logprobs(entries, token_text, len(self.echo)))
        return responses.completion_logprobs(entries, token_text) if entries and self.with_logprobs else None

    def role_chunks(self) -> list[dict]:
        return [responses.chat_role_chunk(**self.common, include_usage=self.include_usage, index=i)
                for i in range(self.n)]

    def chunk(self, index: int, chunk) -> dict | None:
        """The SSE chunk for a token chunk; None when it has nothing to say yet (a tool call's name still
        incomplete)."""
        logprobs = self.logprobs(index, chunk)
        self._text_sent[index] += len(chunk.text)
        if self.tool_mode:
            output = self._tool_outputs[index]
            content, deltas = output.feed(chunk.text)
            if content is None and not deltas and not chunk.finished and not logprobs:
                return None
            return responses.chat_chunk(**self.common, content=content, tool_calls=deltas,
                                        finish_reason=output.finish_reason(chunk.finish_reason), logprobs=logprobs,
                                        include_usage=self.include_usage, index=index)
        if self.chat:
            return responses.chat_chunk(**self.common, content=chunk.text, finish_reason=chunk.finish_reason,
                                        logprobs=logprobs, include_usage=self.include_usage, index=index)
        text = (self.echo if self._echo_owed[index] else "") + chunk.text  # the echo goes with the first chunk
        self._echo_owed[index] = False
        return responses.completion_chunk(**self.common, text=text, finish_reason=chunk.finish_reason,
                                          logprobs=logprobs, include_usage=self.include_usage, index=index)

    def _whole_choice(self, index: int, text: str, logprobs: dict | None) -> dict:
        reason = self._finish_reasons[index]
        if not self.tool_mode:
            return responses.chat_choice(index, text, reason, logprobs)
        output = ToolCallOutput(self.tool_mode)
        output.feed(text)
        return responses.chat_choice(index, None if output.is_calls else text, output.finish_reason(reason),
                                     logprobs, output.calls)

    def usage_chunk(self) -> dict:
        prompt, completion, cached = self.usage
        return responses.usage_chunk(chat=self.chat, **self.common, prompt_tokens=prompt,
                                     completion_tokens=completion, cached_tokens=cached)

    def whole(self, collected: list[tuple[str, list]]) -> dict:
        """The response to the choices' (text, logprob entries)."""
        prompt, completion, cached = self.usage
        token_text = self.token_text
        usage = dict(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)
        prompt_logprobs = (None if self.prompt_logprobs is None or not self._show_prompt_logprobs
                           else responses.prompt_logprobs(self.prompt_logprobs, token_text))
        if self.chat:
            choices = [self._whole_choice(i, text, responses.chat_logprobs(entries, token_text) if entries else None)
                       for i, (text, entries) in enumerate(collected)]
            body = responses.chat_completion_response(**self.common, choices=choices, **usage)
            if prompt_logprobs is not None:  # (where vLLM puts a chat's)
                body["prompt_logprobs"] = prompt_logprobs
            return body
        kept = best_choices(collected, self.returned)
        choices = [responses.completion_choice(j, self.echo + collected[i][0], self._finish_reasons[i],
                                               self._completion_logprobs(collected[i][1]), prompt_logprobs)
                   for j, i in enumerate(kept)]
        return responses.completion_response(**self.common, choices=choices, **usage)


async def _sse_events(gateway: Gateway, choices: Choices, renderer: _Renderer,
                      telemetry: RequestTelemetry) -> AsyncIterator[str]:
    try:
        if renderer.chat:
            for role_chunk in renderer.role_chunks():
                yield responses.sse(role_chunk)
        async for index, chunk in choices.merged():
            if index == 0:  # the request's latencies are its first choice's
                telemetry.token()
            renderer.note(index, chunk)
            # A token still inside a character, or a tool call's name not yet whole: nothing to say.
            if chunk.text or chunk.finished or chunk.logprobs:
                event = renderer.chunk(index, chunk)
                if event is not None:
                    yield responses.sse(event)
        if renderer.include_usage:
            yield responses.sse(renderer.usage_chunk())
        telemetry.finish("ok", renderer.usage, renderer.finish_reason, timed_tokens=renderer.first_completion_tokens)
        yield responses.SSE_DONE
    except StreamError as exc:
        telemetry.finish(exc.code, message=str(exc))
        yield responses.sse_error(from_failure(exc.code, str(exc), exc.param, exc.retry_after_s))
        yield responses.SSE_DONE
    except Exception:
        log.exception("stream failed", request_id=choices.streams[0].request_id)
        telemetry.finish("internal")
        yield responses.sse_error(from_failure("internal", "the gateway failed while streaming"))
        yield responses.SSE_DONE


async def _collect_until_done(gateway: Gateway, request: Request, choices: Choices, renderer: _Renderer,
                              telemetry: RequestTelemetry):
    async def collect() -> list[tuple[str, list]]:
        texts: list[list[str]] = [[] for _ in range(renderer.n)]
        entries: list[list] = [[] for _ in range(renderer.n)]
        async for index, chunk in choices.merged():
            if index == 0:
                telemetry.token()
            renderer.note(index, chunk)
            texts[index].append(chunk.text)
            entries[index].extend(chunk.logprobs or [])
        return [("".join(text), logprob_entries) for text, logprob_entries in zip(texts, entries)]

    try:
        with _failures_counted(telemetry):
            collected = await _unless_disconnected(request, collect())
            if collected is None:
                telemetry.finish("cancelled")
                return Response(status_code=499)
            body = renderer.whole(collected)
    finally:
        await choices.release()
    telemetry.finish("ok", renderer.usage, renderer.finish_reason, timed_tokens=renderer.first_completion_tokens)
    return JSONResponse(body)
