"""Logging (structlog, JSON lines with service, instance and request ids), later tracing and metrics."""
