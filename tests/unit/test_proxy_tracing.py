"""OpenTelemetry spans of the proxy's exchanges (proxy/tracing.py): one span per exchange,
a child of the client's trace, its moments as events; both legs carry its traceparent so
vLLM's own spans join the trace. Real OpenTelemetry SDK, spans kept in memory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from proxy_standins import COMPLETION, cluster

from pushsvc.proxy.tracing import SPAN_NAME, ExchangeTracer, otlp_provider

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


def _tracer() -> tuple[ExchangeTracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return ExchangeTracer(provider), exporter


def _parts(traceparent: str) -> tuple[str, str]:
    _version, trace_id, span_id, _flags = traceparent.split("-")
    return trace_id, span_id


@pytest.mark.asyncio
async def test_an_exchange_is_one_span_in_the_clients_trace_and_both_legs_carry_it() -> None:
    tracer, exporter = _tracer()
    async with cluster(tracer=tracer) as c:
        status, _, _ = await c.post("/v1/completions", COMPLETION,
                                    headers={"traceparent": TRACEPARENT, "X-Request-Id": "traced-1"})
        assert status == 200
    (span,) = exporter.get_finished_spans()
    ctx = span.get_span_context()
    assert span.name == SPAN_NAME and f"{ctx.trace_id:032x}" == CLIENT_TRACE
    assert f"{span.parent.span_id:016x}" == CLIENT_SPAN
    attrs = dict(span.attributes)
    assert attrs["pushsvc.request_id"] == "traced-1" and attrs["http.response.status_code"] == 200
    assert attrs["pushsvc.prefill"] == c.p.url and attrs["pushsvc.decode"] == c.d.url
    assert attrs["pushsvc.transfer_id"] == c.d.received[0].body["kv_transfer_params"]["transfer_id"]
    events = [e.name for e in span.events]
    assert "prefill_answered" in events and "decode_answered" in events and events[-1] == "done"
    assert span.start_time <= span.events[0].timestamp and span.events[-1].timestamp == span.end_time
    for leg in (c.p.received[0], c.d.received[0]):
        assert _parts(leg.headers["traceparent"]) == (CLIENT_TRACE, f"{ctx.span_id:016x}")


@pytest.mark.asyncio
async def test_without_a_client_trace_the_exchange_starts_one_and_a_failed_exchange_is_an_error() -> None:
    tracer, exporter = _tracer()
    async with cluster(tracer=tracer) as c:
        c.d.status, c.d.error_message = 503, "decode is out of blocks"
        status, _, _ = await c.post("/v1/completions", COMPLETION)
        assert status == 503
    (span,) = exporter.get_finished_spans()
    assert span.parent is None and span.status.status_code is StatusCode.ERROR
    assert _parts(c.d.received[0].headers["traceparent"])[0] == f"{span.get_span_context().trace_id:032x}"


@pytest.mark.asyncio
async def test_with_no_tracer_provider_set_the_clients_traceparent_still_reaches_vllm() -> None:
    async with cluster(tracer=ExchangeTracer()) as c:  # OpenTelemetry's global provider: a no-op here
        # Header names are case-insensitive: a client may well send "Traceparent".
        assert (await c.post("/v1/completions", COMPLETION, headers={"Traceparent": TRACEPARENT}))[0] == 200
    for leg in (c.p.received[0], c.d.received[0]):
        assert leg.headers["traceparent"] == TRACEPARENT


def test_an_unknown_otlp_protocol_is_refused_by_name(monkeypatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "carrier-pigeon")
    with pytest.raises(RuntimeError, match="carrier-pigeon"):
        otlp_provider("http://127.0.0.1:4317")


def test_the_proxy_command_refuses_to_start_when_its_exporter_cannot_be_set_up() -> None:
    env = {**os.environ, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "carrier-pigeon"}
    done = subprocess.run([sys.executable, "-m", "pushsvc", "proxy", "--prefill", "http://127.0.0.1:8100",
                           "--decode", "http://127.0.0.1:8200", "--port", "0",
                           "--otlp-traces-endpoint", "http://127.0.0.1:4317"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 1 and "cannot start proxy" in done.stderr and "carrier-pigeon" in done.stderr


def test_the_clients_trace_is_found_whatever_the_case_of_the_header_name() -> None:
    from multidict import CIMultiDict, CIMultiDictProxy

    tracer, exporter = _tracer()
    span = tracer.start(CIMultiDictProxy(CIMultiDict({"TraceParent": TRACEPARENT})), 1.0e9, {})
    tracer.end(span, 1.0e9, {"done": 0.001}, 200, {})
    (done,) = exporter.get_finished_spans()
    assert f"{done.get_span_context().trace_id:032x}" == CLIENT_TRACE
