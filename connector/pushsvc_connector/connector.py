"""``PushsvcConnector``: the vLLM-facing class. It only dispatches: the scheduler role
to ``PushScheduler`` (bookkeeping), the worker role to ``PushWorker`` (daemon client).

Configuration (``kv_connector_extra_config``):

* ``daemon_socket`` (required on workers): the daemon's Unix socket.
* ``watchdog_s`` / ``lease_s``: the connector's backstop timers (default 180 s), set
  above the daemon's own watchdog and lease so the daemon's fire first.
* ``connect_timeout_s``: bound on the blocking connect and KV registration, at start-up
  and on each reconnect attempt (default 10 s).
* ``idle_wait_ms``: on a step with nothing scheduled and transfers pending, how long
  the worker may wait for a daemon event before returning (default 10 ms).

Hybrid models: the connector is ``SupportsHMA``, so vLLM keeps its hybrid KV-cache manager
on; ``transfer_groups`` says which groups a transfer carries and how many trailing blocks
of a sliding-window group (``groups.py``). Group kinds other than full attention and
sliding window (Mamba state, chunked local attention) are refused at construction.

Supported parallelism: tensor parallelism, and pipeline parallelism on the prefill
(``kv_producer``) side. One daemon serves the workers of one vLLM instance, each known by
its TP rank and pipeline stage; each stage's workers push their own layers, which D's
daemon pairs with its regions by layer name. A decoding instance runs one stage (it
counts a request's KV as landed per rank of that stage), and data-parallel replicas
would bring several workers for the same rank and stage: construction refuses both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

from pushsvc.protocol import worker as wp
from pushsvc_connector.coordinates import DaemonCoordinates
from pushsvc_connector.groups import TransferGroups
from pushsvc_connector.kvshare import share_kv
from pushsvc_connector.metadata import PushsvcMetadata
from pushsvc_connector.scheduler import PushScheduler
from pushsvc_connector.stats import PushsvcConnectorStats, PushsvcPromMetrics
from pushsvc_connector.worker import PushWorker

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

_ROLES = {"kv_producer": "producer", "kv_consumer": "consumer", "kv_both": "both"}
DEFAULT_BACKSTOP_S = 180.0
# ParallelConfig fields whose value must be 1 (see the module docstring); the first only
# where the instance decodes (is not a pure kv_producer).
_UNSUPPORTED_PARALLELISM = ("pipeline_parallel_size", "data_parallel_size")


class PushsvcConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        check_parallelism(vllm_config.parallel_config, self._kv_transfer_config.kv_role)
        self._groups = transfer_groups(kv_cache_config)
        extra: dict[str, Any] = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        # P: push each layer's KV while later layers compute (docs/connector.md).
        self._layerwise = layerwise_setting(extra)
        self._scheduler: PushScheduler | None = None
        self._worker: PushWorker | None = None
        self._coords: DaemonCoordinates | None = None
        if role == KVConnectorRole.SCHEDULER:
            socket_path = str(extra.get("daemon_socket", ""))
            if socket_path and self._kv_transfer_config.is_kv_producer:  # only P returns its coordinates
                self._coords = DaemonCoordinates(socket_path, vllm_config.parallel_config.tensor_parallel_size)
            self._scheduler = PushScheduler(watchdog_s=float(extra.get("watchdog_s", DEFAULT_BACKSTOP_S)),
                                            lease_s=float(extra.get("lease_s", DEFAULT_BACKSTOP_S)),
                                            coordinates=self._coords.get if self._coords else lambda: None,
                                            groups=self._groups,
                                            layerwise=self._layerwise and self._kv_transfer_config.is_kv_producer)
            return
        socket_path = extra.get("daemon_socket")
        if not socket_path:
            raise ValueError('PushsvcConnector needs kv_connector_extra_config["daemon_socket"]: the path of '
                             "the co-located pushsvc daemon's Unix socket")
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        # On a step with nothing scheduled, vLLM only steps to learn about transfers;
        # waiting here for the daemon (woken by its first event) replaces an empty-step
        # spin that measured ~650 steps/s and ~1.4 cores on a 2-core host.
        self._idle_wait_s = float(extra.get("idle_wait_ms", 10.0)) / 1000.0
        role_name = _ROLES.get(self._kv_transfer_config.kv_role or "kv_both", "both")
        pp_size = vllm_config.parallel_config.pipeline_parallel_size
        self._worker = PushWorker(socket_path=str(socket_path), rank=get_tensor_model_parallel_rank(),
                                  tp_size=vllm_config.parallel_config.tensor_parallel_size, role=role_name,
                                  connect_timeout_s=float(extra.get("connect_timeout_s", 10.0)),
                                  pp_rank=get_pp_group().rank_in_group if pp_size > 1 else 0, pp_size=pp_size,
                                  layerwise=self._layerwise and role_name != "consumer", stream=_current_stream)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        # vLLM 0.33 asks this when --enable-sleep-mode is set and refuses the
        # configuration on False (its base class answers True; 0.32 never asks). Sleep
        # frees and remaps the KV cache while the daemon keeps writing into the pages it
        # registered: refusing beats pushing KV into memory vLLM gave back.
        return False

    # ================================================================ worker role

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # Raises DaemonRefused when the daemon refuses this worker (vLLM then fails to
        # start, with the daemon's reason); a daemon not there yet is retried later.
        assert self._worker is not None
        share = share_kv(kv_caches, self._kv_cache_config.num_blocks, self._groups, kv_heads(self._kv_cache_config),
                         replicated_layers(self._kv_cache_config))
        self._worker.register(share)
        if self._layerwise and self._worker.welcome is not None and not self._worker.client.supports(
                wp.LAYERWISE_MINOR):
            raise ValueError('PushsvcConnector: kv_connector_extra_config["layerwise_push"] needs a pushsvc daemon '
                             f"at worker protocol 1.{wp.LAYERWISE_MINOR} or later; the one at "
                             f"{self._worker.client.socket_path} is older")

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # vLLM binds the step's metadata before the forward pass and calls start_load_kv
        # after it (0.32 starts asynchronous loads once the forward is launched; on a CPU
        # that is once it ran). What the step tells the daemon goes now: the
        # layer-wise starts, which must precede the layers, and the step's other messages
        # (P's finished requests, D's registrations, evictions), which then do not wait
        # for this step's forward pass.
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, PushsvcMetadata):
            if self._layerwise:
                self._worker.begin_step(connector_metadata)
            self._worker.start_step(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return  # the step's messages went at bind_connector_metadata; P pushes, nothing loads here

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # KV arrives whole, before the request is scheduled on D

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        # Layer-wise push: this layer's KV of the step's finishing prefills is final (vLLM
        # CPU computes it synchronously; on a GPU its kernels are queued and the worker
        # records the layer's event); otherwise P pushes whole requests once finished.
        if self._layerwise and self._worker is not None:
            self._worker.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        if self._layerwise and self._worker is not None:
            self._worker.step_saved()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        idle = self.has_connector_metadata() and getattr(self._get_connector_metadata(), "idle", False)
        sending, recving = self._worker.get_finished(wait_s=self._idle_wait_s if idle else 0.0)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._coords is not None:
            self._coords.close()

    # ================================================================ scheduler role

    def on_new_request(self, request: Request) -> None:
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        if self._coords is not None:
            self._coords.refresh()  # non-blocking; keeps P's coordinates fresh between requests
        return self._scheduler.build_connector_meta(scheduler_output.total_num_scheduled_tokens, scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        # What vLLM calls on a SupportsHMA connector, with one list per KV-cache group.
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output.finished_sending,
                                                    connector_output.finished_recving)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    def has_pending_block_frees(self) -> bool:
        # Asked when a step's KV blocks run out: True makes vLLM wait instead of preempting
        # (layer-wise push: a started request's blocks may be read by the daemon).
        return self._scheduler is not None and self._scheduler.has_pending_block_frees()

    # ================================================================ metrics (both roles)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # Each role counts its own events; vLLM sums the workers' and the scheduler's.
        if self._scheduler is not None:
            return self._scheduler.take_stats()
        counts = self._worker.take_stats() if self._worker is not None else None
        return PushsvcConnectorStats(data=counts.data) if counts is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        # A copy: vLLM's loggers aggregate into the object they build, and the payload
        # is also read by its Prometheus logger.
        return PushsvcConnectorStats(data={name: dict(by_label) for name, by_label in (data or {}).items()})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return PushsvcPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def transfer_groups(kv_cache_config: Any) -> TransferGroups:
    """The groups a transfer carries (``groups.py``), from vLLM's KV-cache config; one
    full-attention group where there is none (a role built without it)."""
    if kv_cache_config is None or not getattr(kv_cache_config, "kv_cache_groups", None):
        return TransferGroups()
    groups = kv_cache_config.kv_cache_groups
    ids = tuple(getattr(kv_cache_config, "transfer_group_ids", range(len(groups))))
    keep = []
    for gid in ids:
        spec = groups[gid].kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            keep.append(-(-spec.sliding_window // spec.block_size) + 1)
        elif isinstance(spec, FullAttentionSpec):  # MLA's spec is one too
            keep.append(0)
        else:
            raise ValueError(f"PushsvcConnector does not support KV-cache group {gid} of kind "
                             f"{type(spec).__name__} (layers {', '.join(groups[gid].layer_names[:4])}...): "
                             "supported are full-attention and sliding-window groups")
    layer_group = {name: i for i, gid in enumerate(ids) for name in groups[gid].layer_names}
    return TransferGroups(ids, tuple(keep), layer_group if len(ids) > 1 or any(keep) else {})


def kv_heads(kv_cache_config: Any) -> dict[str, int]:
    """Each layer's KV heads on this rank, from its KV-cache spec (MLA's latent row counts
    as one head: it cannot be split by head)."""
    out: dict[str, int] = {}
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: one spec per layer
        for name in group.layer_names:
            layer_spec = per_layer.get(name, spec) if isinstance(per_layer, dict) else spec
            out[name] = int(getattr(layer_spec, "num_kv_heads", 0) or 0)
    return out


def replicated_layers(kv_cache_config: Any) -> frozenset[str]:
    """The layers whose KV every TP rank holds whole: MLA's latent rows."""
    return frozenset(name for group in getattr(kv_cache_config, "kv_cache_groups", None) or ()
                     if isinstance(group.kv_cache_spec, MLAAttentionSpec) for name in group.layer_names)


def _current_stream() -> int:
    """The handle of the CUDA stream vLLM computes on now (layer-wise push records the
    layer events there)."""
    return int(torch.cuda.current_stream().cuda_stream)


def layerwise_setting(extra: dict[str, Any]) -> bool:
    """``kv_connector_extra_config["layerwise_push"]``: a bool (JSON true/false), nothing else."""
    value = extra.get("layerwise_push", False)
    if not isinstance(value, bool):
        raise ValueError(f'PushsvcConnector: kv_connector_extra_config["layerwise_push"] must be true or false, '
                         f"not {value!r}")
    return value


def check_parallelism(parallel_config: Any, kv_role: str | None = "kv_both") -> None:
    """Refuse what the daemon cannot serve: several workers for one TP rank and stage
    (data parallelism), or pipeline stages on an instance that decodes."""
    for name in _UNSUPPORTED_PARALLELISM:
        size = getattr(parallel_config, name)
        if size == 1 or (name == "pipeline_parallel_size" and kv_role == "kv_producer"):
            continue
        if name == "pipeline_parallel_size":
            raise ValueError(
                f"PushsvcConnector does not support {name}={size} with kv_role={kv_role}: only a prefill "
                "instance (kv_role=kv_producer) may be pipeline-parallel; a decoding instance runs one "
                "stage (decode-side pipeline parallelism is not supported). Supported: tensor "
                "parallelism on both sides, pipeline parallelism on P.")
        raise ValueError(
            f"PushsvcConnector does not support {name}={size}: one pushsvc daemon serves the "
            "workers of one vLLM instance, and a data-parallel replica would bring another worker for "
            "the same rank. Supported: tensor parallelism, and pipeline parallelism on P "
            "(data_parallel_size=1); for data parallelism run separate vLLM instances, each with its "
            "own daemon.")
