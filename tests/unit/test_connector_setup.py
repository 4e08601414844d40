"""PushsvcConnector construction and its dispatch of vLLM's stats hooks, with vLLM's own
config objects (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.config import KVTransferConfig, ParallelConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from pushsvc_connector import PushsvcConnector
from pushsvc_connector.stats import PushsvcConnectorStats


def _vllm_config(role: str = "kv_consumer", **parallel) -> SimpleNamespace:
    """The parts of a VllmConfig the connector reads."""
    kv = KVTransferConfig(kv_connector="PushsvcConnector", kv_connector_module_path="pushsvc_connector", kv_role=role,
                          kv_connector_extra_config={"daemon_socket": "/nonexistent/pushsvc.sock"})
    return SimpleNamespace(kv_transfer_config=kv, parallel_config=ParallelConfig(**parallel))


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_consumer", "kv_both"])
def test_data_parallelism_is_refused_at_construction(kv_role, role) -> None:
    """Regression: the daemon refused the second worker of a TP rank, the connector retried
    silently, and vLLM ran with every transfer failing."""
    with pytest.raises(ValueError, match=r"data_parallel_size=2.*Supported: tensor parallelism, and pipeline"):
        PushsvcConnector(_vllm_config(kv_role, data_parallel_size=2), role, None)  # type: ignore[arg-type]


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
@pytest.mark.parametrize("kv_role", ["kv_consumer", "kv_both"])
def test_pipeline_parallelism_is_refused_where_the_instance_decodes(kv_role, role) -> None:
    with pytest.raises(ValueError, match=rf"pipeline_parallel_size=2 with kv_role={kv_role}.*decode-side pipeline"):
        PushsvcConnector(_vllm_config(kv_role, pipeline_parallel_size=2), role, None)  # type: ignore[arg-type]


def test_a_pipeline_parallel_prefill_instance_is_accepted() -> None:
    connector = PushsvcConnector(_vllm_config("kv_producer", pipeline_parallel_size=2),  # type: ignore[arg-type]
                                 KVConnectorRole.SCHEDULER, None)
    assert connector.get_kv_connector_stats() is None  # constructed, serving the scheduler


def test_the_checked_settings_are_vllms_parallel_config_fields() -> None:
    fields = ParallelConfig.__dataclass_fields__
    assert "pipeline_parallel_size" in fields and "data_parallel_size" in fields


def test_vllm_loads_a_connector_that_refuses_sleep_mode_and_keeps_hybrid_kv_caches() -> None:
    """What vLLM asks the class it loads by module path: 0.33 refuses --enable-sleep-mode
    when supports_sleep_mode is False (the daemon keeps writing into the registered KV
    pages, which sleep frees), and both versions keep the hybrid KV-cache manager on only
    for a connector that is SupportsHMA."""
    kv = _vllm_config().kv_transfer_config
    cls = KVConnectorFactory.get_connector_class(kv)
    assert cls is PushsvcConnector
    assert cls.supports_sleep_mode(kv) is False
    assert KVConnectorFactory.supports_hma_config(kv)


def test_scheduler_role_reports_its_counters_and_builds_the_stats_vllm_sums() -> None:
    connector = PushsvcConnector(_vllm_config(), KVConnectorRole.SCHEDULER, None)  # type: ignore[arg-type]
    assert connector.get_kv_connector_stats() is None
    bad = SimpleNamespace(request_id="d1", kv_transfer_params={"do_remote_prefill": True}, prompt_token_ids=[1, 2])
    assert connector.get_num_new_matched_tokens(bad, 0) == (0, False)  # type: ignore[arg-type]
    stats = connector.get_kv_connector_stats()
    assert isinstance(stats, PushsvcConnectorStats) and stats.count("refused_requests", "bad_kv_transfer_params") == 1
    assert connector.get_kv_connector_stats() is None  # taken once
    rebuilt = PushsvcConnector.build_kv_connector_stats(stats.to_dict())
    assert isinstance(rebuilt, PushsvcConnectorStats) and rebuilt.to_dict() == stats.to_dict()
    rebuilt.aggregate(rebuilt.__class__(data={"refused_requests": {"bad_kv_transfer_params": 4}}))
    assert stats.count("refused_requests", "bad_kv_transfer_params") == 1, "the payload must not be aliased"
    assert PushsvcConnector.build_kv_connector_stats().is_empty()
