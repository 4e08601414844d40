"""The proxy's one typed configuration object, built by the CLI (``pushsvc proxy``).

``load_proxy_config`` converts the flag values once with msgspec, normalizes the backend
URLs and validates; an invalid value raises ``ConfigError`` naming the field, which the CLI
turns into exit status 2. Nothing below reads flags or the environment.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import msgspec
from yarl import URL

from pushsvc.config import LOG_FORMATS, LOG_LEVELS, read_secret_file, translate_validation_error
from pushsvc.errors import ConfigError

MiB = 1 << 20


class ProxyConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Every knob of the P/D proxy. URLs are base URLs without a trailing slash."""

    # vLLM OpenAI servers: prefill (P) and decode (D) instances.
    prefill: list[str]
    # The pushsvc daemon next to each P instance, the i-th belonging to the i-th ``prefill``:
    # D is sent to the daemon its ``/v1/info`` describes. Empty: each P's answers say where
    # its daemon is (the first exchange with a P then sends D's leg after P's answer).
    prefill_daemon: list[str]
    decode: list[str]
    # The bearer token the ``prefill_daemon``s' ``/v1/info`` asks for: their
    # ``health_token_file``, which every daemon whose health server listens beyond
    # loopback has. Empty: none is sent.
    prefill_daemon_token_file: str = ""
    port: int
    host: str = "127.0.0.1"
    # Total time of a non-streamed backend call; for streams, the longest silence between chunks.
    timeout_s: float = 300.0
    # TCP connect only: waiting for a free pooled connection does not count, so a busy
    # proxy does not report healthy backends as unreachable.
    connect_timeout_s: float = 10.0
    # Tensor-parallel size of the P instances, passed to D as ``remote_tp_size``, unless
    # P's answer says it (P's connector does).
    remote_tp_size: int = 1
    # Bound on open backend connections (aiohttp TCPConnector limit).
    max_connections: int = 1024
    # Active probe of every backend (``/health``) and P daemon (``/v1/info``); 0 turns it off.
    health_interval_s: float = 5.0
    # On shutdown, in-flight requests get this long before their backend legs are closed.
    drain_timeout_s: float = 10.0
    max_body_bytes: int = 32 * MiB
    # Prefix affinity (proxy/affinity.py): a prompt goes to the P that last took one starting
    # the same way while that P has at most this many requests more in flight than the least
    # busy one; -1 turns it off (least outstanding alone).
    prefix_affinity_slack: int = 2
    # Bearer token of the admin endpoints (``POST /admin/drain``, ``/admin/resume``;
    # proxy/admin.py). Without one they answer loopback clients only.
    admin_token_file: str = ""
    # OTLP endpoint for the exchanges' OpenTelemetry spans (proxy/tracing.py); empty: the
    # global tracer provider (a no-op unless the process was started instrumented).
    otlp_traces_endpoint: str = ""
    log_format: str = "auto"
    log_level: str = "info"

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid field. URLs must already be normalized."""
        for name in ("prefill", "decode"):
            urls = getattr(self, name)
            if not urls:
                raise ConfigError(name, "needs at least one backend URL")
            if len(set(urls)) != len(urls):
                raise ConfigError(name, "lists the same backend twice")
        if self.prefill_daemon and len(self.prefill_daemon) != len(self.prefill):
            raise ConfigError(
                "prefill_daemon",
                f"needs one daemon URL per prefill backend ({len(self.prefill)}), or none to learn each P's "
                f"daemon from P's answers; got {len(self.prefill_daemon)}",
            )
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", f"must be in 0..65535, got {self.port}")
        if not self.host:
            raise ConfigError("host", "must not be empty")
        for name in ("timeout_s", "connect_timeout_s", "drain_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(name, f"must be a positive number of seconds, got {value}")
        if not (math.isfinite(self.health_interval_s) and self.health_interval_s >= 0):
            raise ConfigError("health_interval_s", f"must be >= 0 seconds (0: off), got {self.health_interval_s}")
        for name in ("remote_tp_size", "max_connections", "max_body_bytes"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(name, f"must be positive, got {value}")
        if self.prefix_affinity_slack < -1:
            raise ConfigError("prefix_affinity_slack", f"must be -1 (off) or >= 0, got {self.prefix_affinity_slack}")
        if self.admin_token_file:
            read_secret_file(self.admin_token_file, "admin_token_file")
        if self.prefill_daemon_token_file:
            if not self.prefill_daemon:
                raise ConfigError("prefill_daemon_token_file", "is sent only to --prefill-daemon URLs, and none is given")
            read_secret_file(self.prefill_daemon_token_file, "prefill_daemon_token_file")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError("log_format", f"must be one of {sorted(LOG_FORMATS)}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError("log_level", f"must be one of {sorted(LOG_LEVELS)}")


def load_proxy_config(values: Mapping[str, object]) -> ProxyConfig:
    """Build, normalize and validate a ProxyConfig; ``None`` values take the field default."""
    given = {k: v for k, v in values.items() if v is not None}
    try:
        cfg = msgspec.convert(given, ProxyConfig)
    except msgspec.ValidationError as exc:
        raise translate_validation_error(exc) from None
    cfg = msgspec.structs.replace(
        cfg,
        prefill=[normalize_url("prefill", u) for u in cfg.prefill],
        prefill_daemon=[normalize_url("prefill_daemon", u) for u in cfg.prefill_daemon],
        decode=[normalize_url("decode", u) for u in cfg.decode],
    )
    cfg.validate()
    return cfg


def normalize_url(field: str, raw: str) -> str:
    """An absolute http(s) base URL without query, fragment or trailing slash."""
    try:
        url = URL(raw)
        port = url.port
    except (TypeError, ValueError) as exc:
        raise ConfigError(field, f"invalid URL {raw!r}: {exc}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ConfigError(field, f"must be an absolute http:// or https:// URL, got {raw!r}")
    if port is None or not 1 <= port <= 65535:
        raise ConfigError(field, f"port must be in 1..65535 in {raw!r}")
    if url.query_string or url.fragment or url.user or url.password:
        raise ConfigError(field, f"must not carry credentials, a query or a fragment: {raw!r}")
    return str(url).rstrip("/")
