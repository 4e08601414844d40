"""PushsvcConnectorStats (what the scheduler and workers count) and PushsvcPromMetrics
(how vLLM's front end exposes it), driven the way vLLM drives them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from pushsvc_connector.stats import COUNTERS, PushsvcConnectorStats, PushsvcPromMetrics


def test_take_returns_what_was_recorded_once_and_none_when_idle() -> None:
    stats = PushsvcConnectorStats()
    assert stats.is_empty() and stats.take() is None
    stats.record("refused_requests", "bad_kv_transfer_params")
    stats.record("refused_requests", "bad_kv_transfer_params")
    stats.record("daemon_disconnects")
    taken = stats.take()
    assert taken is not None and not taken.is_empty()
    assert taken.count("refused_requests", "bad_kv_transfer_params") == 2 and taken.count("daemon_disconnects") == 1
    assert stats.is_empty() and stats.take() is None
    stats.record("held_requests", n=3)
    assert taken.count("held_requests") == 0, "a taken snapshot must not see later counts"


def test_aggregate_adds_workers_and_scheduler_counts() -> None:
    worker_0 = PushsvcConnectorStats()
    worker_0.record("held_requests", n=2)
    worker_1 = PushsvcConnectorStats()
    worker_1.record("held_requests")
    worker_1.record("released_requests", "daemon_gone", 4)
    scheduler = PushsvcConnectorStats()
    scheduler.record("refused_requests", "request_id_too_long")
    total = worker_0.aggregate(worker_1).aggregate(scheduler)
    assert total.to_dict() == {"held_requests": {"": 3}, "released_requests": {"daemon_gone": 4},
                               "refused_requests": {"request_id_too_long": 1}}
    assert total.reduce() == {"held_requests": 3, "refused_requests[request_id_too_long]": 1,
                              "released_requests[daemon_gone]": 4}


def test_payload_survives_the_trip_between_processes() -> None:
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    stats = PushsvcConnectorStats()
    stats.record("backstop_expiries", "send")
    # The engine core sends its stats to the front end with vLLM's own msgpack serializer.
    payload = MsgpackDecoder().decode(MsgpackEncoder().encode(stats.take().to_dict()))
    rebuilt = PushsvcConnectorStats(data=payload)  # what build_kv_connector_stats does
    assert rebuilt.count("backstop_expiries", "send") == 1


def _metric_types(registry: CollectorRegistry) -> dict[type, type]:
    def bound(cls: type) -> type:
        class InRegistry(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *args, **kwargs) -> None:
                super().__init__(*args, registry=registry, **kwargs)

        return InRegistry

    return {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}


@pytest.fixture
def prom() -> tuple[CollectorRegistry, PushsvcPromMetrics]:
    registry = CollectorRegistry()
    vllm_config = SimpleNamespace(kv_transfer_config=None)  # all the base class reads
    metrics = PushsvcPromMetrics(vllm_config, _metric_types(registry),  # type: ignore[arg-type]
                                 ["model_name", "engine"], {0: ["tiny", "0"]})
    return registry, metrics


def test_prometheus_counters_start_at_zero_for_every_known_label(prom) -> None:
    registry, _ = prom
    for spec in COUNTERS:
        for value in spec.values:
            labels = {"model_name": "tiny", "engine": "0", **({spec.label: value} if spec.label else {})}
            assert registry.get_sample_value(f"vllm:pushsvc_connector_{spec.name}_total", labels) == 0.0, spec.name


def test_prometheus_counters_add_each_observation(prom) -> None:
    registry, metrics = prom
    stats = PushsvcConnectorStats()
    stats.record("refused_requests", "bad_kv_transfer_params", 2)
    stats.record("released_requests", "backstop")
    metrics.observe(stats.take().to_dict(), engine_idx=0)
    stats.record("refused_requests", "bad_kv_transfer_params")
    stats.record("not_a_counter_of_ours")  # a newer worker's counter: ignored, not an error
    metrics.observe(stats.take().to_dict(), engine_idx=0)
    metrics.observe({"refused_requests": {"bad_kv_transfer_params": 5}}, engine_idx=7)  # unknown engine
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("vllm:pushsvc_connector_refused_requests_total",
                                     {**labels, "reason": "bad_kv_transfer_params"}) == 3.0
    assert registry.get_sample_value("vllm:pushsvc_connector_released_requests_total",
                                     {**labels, "cause": "backstop"}) == 1.0
    text = generate_latest(registry).decode()
    assert 'vllm:pushsvc_connector_refused_requests_total{engine="0",model_name="tiny",' \
           'reason="request_id_too_long"} 0.0' in text
