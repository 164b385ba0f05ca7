"""Tracing setup: the OTLP exporter the standard environment asks for (http/protobuf and grpc, each to a real
receiver), and the trace context across a message's headers."""

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from shared.telemetry.tracing import extract, inject, otlp_exporter_from_env, trace_id_of
from shared.transfer.types import TransferResult
from support.otlp_receiver import OtlpGrpcReceiver, OtlpHttpReceiver


@pytest.fixture(autouse=True)
def no_otlp_environment(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL",
                 "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("protocol, receiver_cls", [("http/protobuf", OtlpHttpReceiver), ("grpc", OtlpGrpcReceiver)])
@pytest.mark.timeout(60)
def test_spans_reach_an_otlp_receiver_over_either_protocol(monkeypatch, protocol, receiver_cls):
    receiver = receiver_cls()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        provider = TracerProvider(resource=Resource.create({"service.name": "splitserve-test"}))
        provider.add_span_processor(SimpleSpanProcessor(otlp_exporter_from_env()))
        tracer = provider.get_tracer("test")
        with tracer.start_as_current_span("parent") as parent:
            with tracer.start_as_current_span("child", attributes={"splitserve.blocks": 3}):
                pass
        provider.shutdown()
        spans = {s.name: s for s in receiver.of_trace(trace_id_of(parent))}
        assert set(spans) == {"parent", "child"} and spans["child"].service == "splitserve-test"
        assert spans["child"].parent_span_id == spans["parent"].span_id and spans["parent"].parent_span_id == ""
        assert spans["child"].attributes == {"splitserve.blocks": 3}
    finally:
        receiver.stop()


def test_no_endpoint_no_exporter_and_an_unknown_protocol_is_refused(monkeypatch):
    assert otlp_exporter_from_env() is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:1/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json"):
        otlp_exporter_from_env()


def test_the_trace_context_crosses_message_headers():
    provider = TracerProvider()
    tracer = provider.get_tracer("test")
    span = tracer.start_span("sender")
    headers = inject({"Nats-Msg-Id": "r1"}, span)
    assert headers["Nats-Msg-Id"] == "r1" and headers["traceparent"].split("-")[1] == trace_id_of(span)
    received = tracer.start_span("receiver", context=extract(headers))
    assert received.parent.span_id == span.get_span_context().span_id
    assert trace_id_of(received) == trace_id_of(span)
    assert not trace.get_current_span().get_span_context().is_valid  # nothing leaked into the caller's context
    assert inject({}) == {}  # no current span: nothing to carry
    orphan = tracer.start_span("orphan", context=extract(None))
    assert orphan.parent is None  # no headers: a new trace


def test_transfer_attributes_name_backend_bytes_and_bandwidth():
    attributes = TransferResult(True, None, "shm", 2_000_000_000, 2.0).span_attributes()
    assert attributes["splitserve.kv_transfer.gbytes_per_s"] == 1.0
    assert attributes["splitserve.kv_transfer.backend"] == "shm" and "splitserve.kv_transfer.error" not in attributes
    failed = TransferResult(False, "deadline", "tcp", 0, 0.0, "timeout").span_attributes()
    assert failed["splitserve.kv_transfer.error"] == "deadline" and not failed["splitserve.kv_transfer.ok"]
