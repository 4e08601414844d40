"""Prometheus metrics, named once here. One registry per daemon, so several daemons in
one test process never collide."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.transfers = Counter(
            "pushsvc_transfers", "KV pushes by outcome (done, failed)", ["result"], registry=r
        )
        self.transfer_bytes = Counter("pushsvc_transfer_bytes", "Bytes written by completed pushes", registry=r)
        self.transfer_blocks = Counter("pushsvc_transfer_blocks", "Logical blocks written", registry=r)
        self.transfer_seconds = Histogram(
            "pushsvc_transfer_seconds", "WRITE post to completion", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.match_wait_seconds = Histogram(
            "pushsvc_match_wait_seconds", "P blocks staged to WRITE posted", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.recv_seconds = Histogram(
            "pushsvc_recv_seconds", "D registration to completion", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.handshake_seconds = Histogram(
            "pushsvc_handshake_seconds", "Side-channel handshake duration", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.handshakes = Counter("pushsvc_handshakes", "Side-channel handshakes by result", ["result"], registry=r)
        self.failures = Counter("pushsvc_failures", "Request failures by kind", ["kind"], registry=r)
        self.leases_expired = Counter("pushsvc_leases_expired", "P leases reclaimed without a WRITE", registry=r)
        self.watchdog_expired = Counter("pushsvc_watchdog_expired", "D registrations failed by the watchdog", registry=r)
        self.malformed = Counter(
            "pushsvc_malformed_inputs", "Rejected input by source and reason", ["source", "reason"], registry=r
        )
        self.reg_sent = Counter("pushsvc_reg_sent", "P: D's RegSent notices, by whether P held the blocks they "
                                "were for (awaited) or not yet (ahead)", ["outcome"], registry=r)
        self.duplicates = Counter("pushsvc_duplicates", "Idempotently ignored duplicates", ["kind"], registry=r)
        self.rejected_connections = Counter(
            "pushsvc_rejected_connections", "Connections refused", ["listener", "reason"], registry=r
        )
        self.worker_connections = Gauge("pushsvc_worker_connections", "Connected workers", registry=r)
        self.peers = Gauge("pushsvc_peers", "Peer daemons with a live session", registry=r)
        self.agents = Gauge("pushsvc_agents", "Local NIXL agents", registry=r)
        self.inflight_writes = Gauge("pushsvc_inflight_writes", "WRITE handles not yet settled", registry=r)
        self.worker_messages = Counter("pushsvc_worker_messages", "Worker messages by type", ["type"], registry=r)
        self.verified = Counter(
            "pushsvc_verify", "Verify mode: pushes checked on D, by result (identical, mismatch, missing)",
            ["result"], registry=r)
        self.verified_blocks = Counter("pushsvc_verify_blocks", "Blocks checked on D, by result", ["result"], registry=r)
        self.notifications = Counter("pushsvc_notifications", "NIXL notifications by kind", ["kind"], registry=r)
        self.events_dropped = Counter(
            "pushsvc_worker_events_dropped", "Worker events with no connection left to receive them, by type",
            ["type"], registry=r)
        # GPU path (docs/gpu.md): D's landing space and its copies.
        self.landing_waits = Counter(
            "pushsvc_landing_waits", "Registrations that waited for landing space before their PUSH_REG", registry=r)
        self.landing_wait_seconds = Histogram(
            "pushsvc_landing_wait_seconds", "Registration to landing space granted (those that waited)",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.landing_copies = Counter("pushsvc_landing_copies", "Gather copies into worker KV (one per part)",
                                      registry=r)
        self.ipc_copies = Counter("pushsvc_ipc_copies", "P: requests copied into a same-host D's KV by P itself "
                                  "(same-host push, no NIXL WRITE)", registry=r)
        self.staging_copies = Counter("pushsvc_staging_copies", "P: copies of a request's blocks into staging slots "
                                      "(one per KV group)", registry=r)
        self.staging_waits = Counter("pushsvc_staging_waits", "P: matches that waited for staging space", registry=r)
        self.landing_exposed_seconds = Histogram(
            "pushsvc_landing_exposed_seconds", "Last part landed to every copy into the worker's KV done",
            buckets=(0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.1, 1),
            registry=r)
        self.write_parts = Counter("pushsvc_write_parts", "WRITEs posted, counting every part and slice", registry=r)
        self.progress_pass_seconds = Histogram(
            "pushsvc_progress_pass_seconds", "Time of one progress pass, by the pace it chose next", ["pace"],
            buckets=(0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1),
            registry=r)
        self.progress_spin_seconds = Counter(
            "pushsvc_progress_spin_seconds", "Wall-clock time the progress loop busy-polled (poll_spin_s) while "
            "requests were tracked: the most CPU it cost (less where it yielded its CPU to other processes)",
            registry=r)
        self.engine_slow_calls = Counter(
            "pushsvc_engine_slow_calls", "NIXL calls that held the event loop for 0.25 s or more, by call", ["call"],
            registry=r)
        # Request timelines (docs/architecture.md): the time from each event of a request's
        # path to the next, and the whole (phase="total").
        self.phase_seconds = Histogram(
            "pushsvc_phase_seconds", "Per request: seconds from the previous event of its path to this one",
            ["side", "phase"], buckets=(0.00005, 0.0001, 0.00025, *_LATENCY_BUCKETS, 30, 60), registry=r)
        # process_open_fds, process_resident_memory_bytes, ...: leak checks read them.
        ProcessCollector(registry=r)

    def watch_nixl_handles(self, source: Callable[[], dict[str, int]]) -> None:
        """Export ``pushsvc_nixl_handles{kind}``, read from ``source`` at every scrape."""
        self.registry.register(_GaugesCollector(
            "pushsvc_nixl_handles", "Live NIXL handles by kind (registrations, dlists, xfers, remote_agents)",
            "kind", source))

    def watch_tables(self, source: Callable[[], dict[str, int]]) -> None:
        """Export ``pushsvc_table_entries{table}``, read from ``source`` once per scrape
        (tables change in many places; a gauge set eagerly went stale)."""
        self.registry.register(_GaugesCollector("pushsvc_table_entries", "Matching-table sizes", "table", source))

    def watch_gpu(self, memory: Callable[[], dict[str, int]], slots: Callable[[], dict[str, int]]) -> None:
        """``pushsvc_gpu_memory_bytes{kind}`` (imported, allocated) and
        ``pushsvc_landing_slots{state}`` (total, used, queued), read at every scrape."""
        self.registry.register(_GaugesCollector(
            "pushsvc_gpu_memory_bytes", "GPU memory this daemon holds: imported from workers, allocated itself",
            "kind", memory))
        self.registry.register(_GaugesCollector(
            "pushsvc_landing_slots", "Landing slots over every rank (total, used) and registrations waiting (queued)",
            "state", slots))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _GaugesCollector(Collector):
    """One labelled gauge family whose values ``source`` gives at scrape time."""

    def __init__(self, name: str, doc: str, label: str, source: Callable[[], dict[str, int]]) -> None:
        self._name, self._doc, self._label, self._source = name, doc, label, source

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self._name, self._doc, labels=[self._label])
        for key, n in self._source().items():
            family.add_metric([key], n)
        yield family
