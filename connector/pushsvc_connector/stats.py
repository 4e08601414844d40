"""The connector's counters, carried the way vLLM carries connector statistics.

The scheduler and each worker record events in a ``PushsvcConnectorStats``; vLLM takes
them every engine step (``get_kv_connector_stats`` on both roles), sums the workers' and
the scheduler's (``aggregate``) and hands the sum to its front end, which logs a summary
(``reduce``) and feeds ``PushsvcPromMetrics``: one Prometheus counter per entry of
``COUNTERS``, named ``vllm:pushsvc_connector_<name>`` (``_total`` in the exposition) and
labelled like vLLM's own metrics (``model_name``, ``engine``) plus the entry's label.

The payload is a plain ``{name: {label value: count}}`` dict: it crosses process
boundaries pickled or msgpack-encoded, and counts from several workers add up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from pushsvc_connector import counters
from pushsvc_connector.counters import COUNTERS, CounterSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig

METRIC_PREFIX = "vllm:pushsvc_connector_"


@dataclass
class PushsvcConnectorStats(KVConnectorStats):
    """Counts since the last ``take``: ``data[name][label value]``."""

    def record(self, name: str, label: str = "", n: int = 1) -> None:
        counters.record(self.data, name, label, n)

    def count(self, name: str, label: str = "") -> int:
        return counters.count(self.data, name, label)

    def take(self) -> PushsvcConnectorStats | None:
        """What was recorded since the last call (None if nothing), and start afresh."""
        if self.is_empty():
            return None
        taken = PushsvcConnectorStats(data=self.data)
        self.reset()
        return taken

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return counters.is_empty(self.data)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, by_label in other.data.items():
            for label, n in by_label.items():
                self.record(name, label, n)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {(f"{name}[{label}]" if label else name): n
                for name, by_label in sorted(self.data.items()) for label, n in sorted(by_label.items()) if n}


class PushsvcPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per ``COUNTERS`` entry, fed from the stats payload."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, tuple[CounterSpec, Any]] = {}
        for spec in COUNTERS:
            counter = self._counter_cls(name=METRIC_PREFIX + spec.name, documentation=spec.documentation,
                                        labelnames=[*labelnames, *([spec.label] if spec.label else [])])
            self._counters[spec.name] = (spec, counter)
            for values in per_engine_labelvalues.values():
                for value in spec.values:  # present at 0 before the first event
                    counter.labels(*values, *([value] if spec.label else []))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = self.per_engine_labelvalues.get(engine_idx)
        if values is None:
            return
        for name, by_label in transfer_stats_data.items():
            if name not in counters.NAMES:
                continue
            spec, counter = self._counters[name]
            for label, n in by_label.items():
                if n > 0:
                    counter.labels(*values, *([label] if spec.label else [])).inc(n)
