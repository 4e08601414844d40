"""OpenTelemetry spans of the proxy's exchanges, where ``opentelemetry-api`` is installed.

One span per exchange (``pushsvc.proxy.exchange``, kind SERVER), a child of the client's
trace when the request carries a ``traceparent``. Its attributes name the request id, the
exchange's match key, the endpoint and both backends; its events are the exchange's
moments (``prefill_answered``, ``decode_first_chunk``, ... as in the ``request_timeline``
log event); its status is the HTTP status. Both legs carry the span's ``traceparent``, so
vLLM's own request spans (vLLM run with ``--otlp-traces-endpoint``) land in the same trace
under it, and the daemons' timelines join it by the request id.

Exported only where a tracer provider is set: ``--otlp-traces-endpoint`` makes the proxy
set up the OpenTelemetry SDK with an OTLP exporter (``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``
``grpc``, the default, or ``http/protobuf``, as vLLM reads it); without it the global
provider is used, a no-op unless the process was started under OpenTelemetry's own
instrumentation. Without ``opentelemetry-api`` nothing here does anything.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from typing import Any

try:
    from opentelemetry import propagate, trace
    from opentelemetry.trace import SpanKind, Status, StatusCode
except ImportError:  # pragma: no cover - the API ships with vLLM; the proxy runs without it too
    trace = None  # type: ignore[assignment]

SPAN_NAME = "pushsvc.proxy.exchange"


class ExchangeTracer:
    def __init__(self, provider: Any = None) -> None:
        self._tracer = None if trace is None else (provider or trace.get_tracer_provider()).get_tracer(
            "pushsvc.proxy")

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def start(self, incoming: Mapping[str, str], wall_s: float, attributes: dict[str, str]) -> Any:
        """The exchange's span, started at ``wall_s`` (seconds since the epoch)."""
        if self._tracer is None:
            return None
        # ``incoming`` as given: aiohttp's headers match names case-insensitively, a dict would not.
        return self._tracer.start_span(SPAN_NAME, context=propagate.extract(incoming), kind=SpanKind.SERVER,
                                       start_time=_ns(wall_s), attributes=attributes)

    def inject(self, span: Any, headers: MutableMapping[str, str]) -> None:
        """Put ``span``'s trace context (``traceparent``) into a leg's headers."""
        if span is not None:
            propagate.inject(headers, context=trace.set_span_in_context(span))

    def end(self, span: Any, wall_s: float, moments: Mapping[str, float], status: int,
            attributes: dict[str, str]) -> None:
        """Close ``span``: one event per moment (seconds after ``wall_s``), the status."""
        if span is None:
            return
        for name, at in sorted(moments.items(), key=lambda kv: kv[1]):
            span.add_event(name, timestamp=_ns(wall_s + at))
        span.set_attributes({**attributes, "http.response.status_code": status})
        if status >= 500 or status == 499:
            span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
        span.end(end_time=_ns(wall_s + moments.get("done", 0.0)))


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def otlp_provider(endpoint: str) -> Any:
    """An SDK tracer provider exporting to ``endpoint`` over OTLP (batched, in the
    background). Raises ``RuntimeError`` naming what is missing."""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise RuntimeError(f"--otlp-traces-endpoint needs opentelemetry-sdk: {exc}") from None
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            raise RuntimeError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL {protocol!r}: grpc or http/protobuf")
    except ImportError as exc:
        raise RuntimeError(f"--otlp-traces-endpoint needs the OTLP exporter for {protocol}: {exc}") from None
    provider = TracerProvider(resource=Resource.create({"service.name": "pushsvc-proxy"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider
