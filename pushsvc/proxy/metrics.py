"""Prometheus metrics of the proxy, named once here, in a registry of their own per app."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from pushsvc.proxy.legs import REQUEST_ID_REFUSALS

# TTFT through P/D spans milliseconds (tiny models) to minutes (long prompts, busy P).
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

# The proxy's phases of one exchange, as (from moment, to moment); None: the request's arrival.
# ``after_prefill`` is what the proxy sees of the transfer, D's wait and D's first step.
PHASES: dict[str, tuple[str | None, str]] = {
    "prefill": (None, "prefill_answered"),
    "decode_first_chunk": (None, "decode_first_chunk"),
    "after_prefill": ("prefill_answered", "decode_first_chunk"),
}
_PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class ProxyMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "pushsvc_proxy_requests", "Client requests by endpoint and status (499: client left)",
            ["endpoint", "status"], registry=r,
        )
        self.backend_errors = Counter(
            "pushsvc_proxy_backend_errors",
            "Failed backend calls by leg (prefill, decode, daemon, models) and kind "
            "(connect, timeout, status, disconnect, protocol)",
            ["leg", "kind"], registry=r,
        )
        # Every series exists from the start, so rate() and absent-series alerts work at once.
        for leg in ("prefill", "decode", "daemon", "models"):
            for kind in ("connect", "timeout", "status", "disconnect", "protocol"):
                self.backend_errors.labels(leg, kind)
        self.prefill_retries = Counter(
            "pushsvc_proxy_prefill_retries",
            "Exchanges sent to another P because the first refused the connection (nothing had been sent)",
            registry=r,
        )
        self.stale_connections = Counter(
            "pushsvc_proxy_stale_connections",
            "Backend calls sent again on a new connection: the pooled one had been closed by the backend "
            "(no answer had come)",
            ["leg"], registry=r,
        )
        for leg in ("prefill", "decode"):
            self.stale_connections.labels(leg)
        self.prefix_affinity = Counter(
            "pushsvc_proxy_prefix_affinity",
            "Prefill picks by prefix affinity: hit (sent to the P that took the prompt's start), "
            "overloaded (that P was too busy), miss (no P known for it), short (no whole chunk of prompt)",
            ["result"], registry=r,
        )
        for result in ("hit", "overloaded", "miss", "short"):
            self.prefix_affinity.labels(result)
        self.request_id_refused = Counter(
            "pushsvc_proxy_request_id_refused",
            "Client requests answered 400 for their X-Request-Id before any backend saw them, by reason "
            "(too_long, not_printable_ascii)",
            ["reason"], registry=r,
        )
        for reason in REQUEST_ID_REFUSALS:
            self.request_id_refused.labels(reason)
        self.ttft_seconds = Histogram(
            "pushsvc_proxy_ttft_seconds", "Streamed requests: arrival to first decode chunk sent",
            ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.request_seconds = Histogram(
            "pushsvc_proxy_request_seconds", "Generation requests: arrival to last byte sent",
            ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.phase_seconds = Histogram(
            "pushsvc_proxy_phase_seconds",
            "Phases of an exchange: prefill (arrival to P's answer), decode_first_chunk (arrival to D's "
            "first bytes), after_prefill (P's answer to D's first bytes: transfer, D's wait, D's first step)",
            ["phase"], buckets=_PHASE_BUCKETS, registry=r,
        )
        for phase in PHASES:
            self.phase_seconds.labels(phase)
        self.outstanding = Gauge(
            "pushsvc_proxy_outstanding", "Requests in flight per backend", ["role", "backend"], registry=r,
        )
        self.healthy = Gauge(
            "pushsvc_proxy_backend_healthy", "1 if the backend is considered healthy", ["role", "backend"],
            registry=r,
        )
        self.draining = Gauge(
            "pushsvc_proxy_backend_draining", "1 if the operator drained the backend (it takes no new request)",
            ["role", "backend"], registry=r,
        )
        self.admin_actions = Counter(
            "pushsvc_proxy_admin_actions_total",
            "Calls of POST /admin/drain and /admin/resume, by result (ok, bad_request, unauthorized)",
            ["action", "result"], registry=r,
        )
        self.no_backend = Counter(
            "pushsvc_proxy_no_backend_total", "Requests answered 503 because every backend of a role is drained",
            ["role"], registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
