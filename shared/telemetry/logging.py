"""Structured logging for every service: one JSON object per line on stderr.

`configure_logging` is called once at the top of a service's main. Every line
then carries `service` and `instance`, plus whatever is bound in the current
context with `structlog.contextvars.bind_contextvars(request_id=..., trace_id=...)`
(asyncio tasks inherit the context they were created in), and the trace and span
ids of the current OpenTelemetry span. Lines from libraries
that use the standard `logging` module (nats-py, asyncio) go through the same
renderer, so the stream stays one format. On a terminal the output is the pretty
console format instead of JSON.
"""

import logging
import sys

import structlog
from opentelemetry import trace


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at the time (test runners swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def configure_logging(service: str, instance_id: str, level: str = "info") -> None:
    level_no = logging.getLevelNamesMapping().get(level.upper())
    if level_no is None:
        raise ValueError(f"unknown log level {level!r}")

    def add_identity(logger, method_name, event_dict):
        event_dict.setdefault("service", service)
        event_dict.setdefault("instance", instance_id)
        return event_dict

    shared_processors = [
        structlog.contextvars.merge_contextvars,
        _add_trace_context,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        add_identity,
    ]
    if sys.stderr.isatty():
        renderer_chain = [structlog.dev.ConsoleRenderer()]
    else:
        renderer_chain = [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]

    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared_processors,
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    handler = _StderrHandler()
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared_processors,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderer_chain],
        )
    )
    root = logging.getLogger()
    root.handlers = [h for h in root.handlers if not isinstance(h, _StderrHandler)]
    root.addHandler(handler)
    root.setLevel(level_no)


def _add_trace_context(logger, method_name, event_dict):
    """The current span's trace and span ids, when a span is current (see shared/telemetry/tracing.py)."""
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event_dict.setdefault("trace_id", format(context.trace_id, "032x"))
        event_dict.setdefault("span_id", format(context.span_id, "016x"))
    return event_dict


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A logger whose lines carry `logger=name`; usable before `configure_logging` runs."""
    return structlog.stdlib.get_logger(name)
