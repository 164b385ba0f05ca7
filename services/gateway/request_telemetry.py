"""One request's telemetry at the gateway: its root span and its Prometheus series, ended exactly once.

The span (`gateway.request`, under the HTTP server span) covers the request
until its last token: the scheduler, workers and kv-store hang their spans
under it through the `traceparent` header the gateway puts on the submitted
message. Its trace id goes back to the client as the `x-trace-id` header.
"""

import time

from opentelemetry.trace import SpanKind, Status, StatusCode

from services.gateway.metrics import ModelSeries
from shared.telemetry.tracing import inject, trace_id_of, tracer


class RequestTelemetry:
    def __init__(self, metrics: ModelSeries, endpoint: str, request_id: str, prompt_tokens: int,
                 max_tokens: int | None, stream: bool):
        self.metrics = metrics
        self.endpoint = endpoint
        self.arrived = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.done = False
        self.ticket = None  # its admission ticket (`services.gateway.admission`), once it has one
        self.usage_of = None  # () -> the usage so far, for an end that does not say it
        # Under the HTTP server span when there is one (FastAPI makes it), else the trace's root.
        self.span = tracer().start_span("gateway.request", kind=SpanKind.INTERNAL, attributes={
            "splitserve.endpoint": endpoint, "splitserve.request_id": request_id,
            "splitserve.prompt_tokens": prompt_tokens, "splitserve.max_tokens": max_tokens or 0,
            "splitserve.stream": stream})

    @property
    def trace_id(self) -> str:
        return trace_id_of(self.span)

    def headers(self, headers: dict[str, str]) -> dict[str, str]:
        """NATS headers that carry this request's trace context."""
        return inject(headers, self.span)

    def assigned(self, worker: str) -> None:
        self.span.add_event("assigned", {"splitserve.worker": worker})
        self.span.set_attribute("splitserve.queue_wait_s", time.monotonic() - self.arrived)

    def token(self) -> None:
        """A chunk with tokens arrived: TTFT for the first, inter-token latency after."""
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
            self.metrics.ttft.observe(now - self.arrived)
            if self.ticket is not None:
                self.ticket.first_token()
            self.span.add_event("first_token")
            self.span.set_attribute("splitserve.ttft_s", now - self.arrived)
        elif self.last_token_at is not None:
            self.metrics.itl.observe(now - self.last_token_at)
        self.last_token_at = now

    def finish(self, status: str, usage: tuple[int, int, int] | None = None, finish_reason: str | None = None,
               message: str = "", timed_tokens: int | None = None) -> None:
        """Count the request under `status` ("ok", "cancelled", an error code) and end its span; once."""
        if self.done:
            return
        self.done = True
        self.metrics.request_ended(self.endpoint, status)
        if self.ticket is not None:
            self.ticket.finish(status, usage if usage is not None or self.usage_of is None else self.usage_of())
        if status == "ok":
            self.metrics.observe_finished(self.arrived, self.first_token_at, usage, finish_reason, timed_tokens)
        if usage is not None:
            prompt, completion, cached = usage
            self.span.set_attributes({"splitserve.completion_tokens": completion, "splitserve.cached_tokens": cached})
        if finish_reason:
            self.span.set_attribute("splitserve.finish_reason", finish_reason)
        self.span.set_attribute("splitserve.status", status)
        if status not in ("ok", "cancelled"):
            self.span.set_status(Status(StatusCode.ERROR, message or status))
        self.span.end()

