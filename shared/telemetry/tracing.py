"""OpenTelemetry tracing for every service: one trace per request, across every NATS hop.

`configure_tracing(role, instance)` is called once at a service's start. Its
spans carry `service.name` = `splitserve-{role}` and are exported over OTLP
when the standard variables ask for it: `OTEL_EXPORTER_OTLP_ENDPOINT` (or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), with `OTEL_EXPORTER_OTLP_PROTOCOL` (or
`..._TRACES_PROTOCOL`) `http/protobuf` (the default) or `grpc`; headers,
timeouts and the sampler (`OTEL_TRACES_SAMPLER`) are read by the SDK itself.
With no endpoint, spans still get ids (logs and the client's `x-trace-id`
name them) but go nowhere: a few microseconds per span. `OTEL_SDK_DISABLED=true`
turns tracing off entirely.

The context crosses NATS as a W3C `traceparent` header on the message
(`inject` when sending, `extract` when receiving).
"""

import logging
import os

from opentelemetry import propagate, trace
from opentelemetry.context import Context

TRACER_NAME = "splitserve"
PROTOCOLS = ("http/protobuf", "grpc")

_provider = None


def configure_tracing(role: str, instance_id: str) -> None:
    """Install this process's tracer provider (once; later calls do nothing)."""
    global _provider
    if _provider is not None or os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    try:
        exporter = otlp_exporter_from_env()
    except ValueError as exc:  # a protocol this SDK cannot speak: trace locally rather than not start
        logging.getLogger(__name__).warning("traces will not be exported: %s", exc)
        exporter = None
    resource = Resource.create({"service.name": f"splitserve-{role}", "service.instance.id": instance_id,
                                "splitserve.role": role})
    _provider = TracerProvider(resource=resource)
    if exporter is not None:
        _provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(_provider)


def otlp_exporter_from_env():
    """The OTLP span exporter the environment asks for, or None when no endpoint is set."""
    if not (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
        return None
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf").strip()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ValueError(f"OTLP protocol {protocol!r} is not supported (choose from {', '.join(PROTOCOLS)})")
    return OTLPSpanExporter()  # endpoint, headers, timeout, compression: from the same environment


def shutdown_tracing(timeout_s: float = 5.0) -> None:
    """Export what is still buffered (a service calls this as it stops)."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))
        _provider.shutdown()


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def inject(headers: dict[str, str] | None = None, span: trace.Span | None = None) -> dict[str, str]:
    """`headers` plus the trace context of `span` (default: the current one), for a NATS message."""
    carrier = dict(headers or {})
    propagate.inject(carrier, context=trace.set_span_in_context(span) if span is not None else None)
    return carrier


def extract(headers: dict[str, str] | None) -> Context:
    """The trace context a received NATS message carries (an empty one when it carries none)."""
    return propagate.extract(headers or {})


def trace_id_of(span: trace.Span) -> str:
    """The span's trace id as 32 hex digits ("" when tracing is off)."""
    context = span.get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else ""

