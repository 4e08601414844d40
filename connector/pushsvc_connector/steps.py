"""What the scheduler hands its workers each step, as the worker role reads it (no vLLM:
``metadata.PushsvcMetadata`` is this plan as vLLM carries it, inside its SchedulerOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pushsvc.protocol.worker import RegisterRecv, SendReady, SendStart


@dataclass
class StepPlan:
    # D: registrations to forward to the daemon (it sends PUSH_REG to P).
    recvs: dict[str, RegisterRecv] = field(default_factory=dict)
    # P: finished requests whose blocks the daemon pushes once D registered.
    sends: dict[str, SendReady] = field(default_factory=dict)
    # D: requests the engine dropped (aborted, finished early) after their registration
    # was shipped.
    evictions: list[str] = field(default_factory=list)
    # D: requests that take no KV from P (they ended before they were ever scheduled, or
    # vLLM allocated them with nothing to load). An empty registration still goes to P,
    # only so that P frees the blocks it holds for them; nobody on D waits for its answer.
    releases: list[RegisterRecv] = field(default_factory=list)
    # D: dropped before their registration was shipped: report finished at once.
    dropped_recvs: list[str] = field(default_factory=list)
    # D: loads the scheduler could not register: report them failed at once, with
    # these (flat) block ids as load errors.
    failed_recvs: dict[str, list[int]] = field(default_factory=dict)
    # Backstop timers that fired in the scheduler: the worker reports these as
    # finished (and D's as failed loads) whatever the daemon says.
    expired_recvs: list[str] = field(default_factory=list)
    expired_sends: list[str] = field(default_factory=list)
    # No tokens scheduled this step: the engine is only stepping to hear about
    # transfers, so the worker may wait for the daemon instead of returning at once.
    idle: bool = False
    # P, layer-wise push: requests whose prefill ends in this step; their KV becomes
    # final layer by layer during its forward pass. Their later entry in ``sends`` (or
    # ``dropped_starts``) is the scheduler's word that they finished (or were dropped).
    layerwise: dict[str, SendStart] = field(default_factory=dict)
    # P, layer-wise push: requests dropped after the step that ends their prefill was
    # scheduled; vLLM holds their blocks until the workers report them. Kept apart from
    # ``evictions``: a worker whose ``SendStart`` reached no daemon reports these finished
    # sending at once, while a D id the worker does not track was reported already (a
    # second report would name a request vLLM freed).
    dropped_starts: list[str] = field(default_factory=list)
    # P, layer-wise push: started requests vLLM preempted since the last step (a
    # preemption, or ``reset_prefix_cache`` with running requests, frees their blocks
    # without ``request_finished``): this step's forward pass may write another request's
    # KV into them, so the worker waits, before it, until the daemon reads none of them.
    # A live one runs again and starts anew; vLLM hears nothing of its first push.
    preempted_starts: list[str] = field(default_factory=list)
    step: int = 0  # this step's number, for ``LayerSaved``/``StepSaved`` (layer-wise only)

    @property
    def empty(self) -> bool:
        return not (self.recvs or self.sends or self.evictions or self.dropped_recvs or self.failed_recvs
                    or self.expired_recvs or self.expired_sends or self.releases or self.layerwise
                    or self.dropped_starts or self.preempted_starts)
