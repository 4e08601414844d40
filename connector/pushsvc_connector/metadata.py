"""What the scheduler hands its workers each step (in-process objects, never on a wire
of ours: vLLM carries them inside its SchedulerOutput). The fields are ``steps.StepPlan``'s."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from pushsvc_connector.steps import StepPlan


@dataclass
class PushsvcMetadata(StepPlan, KVConnectorMetadata):
    pass
