"""Same-host push on the GPU (docs/gpu.md, "Same-host push"): P's daemon maps the worker
KV of a D on the same host (``AgentInfo.ipc``: the D worker's CUDA IPC handles) and copies
a request's blocks into it with one kernel per KV group, then sends the completion
notification D waits for. No NIXL WRITE, no landing buffer, no second copy on D.

``IpcTargets`` (one per P rank with CUDA KV) maps and unmaps D agents as they are loaded
and unloaded with the rank's other remote agents, so a mapping lives exactly as long as
NIXL's copy of the agent, or until D withdraws it (its worker left): never unmapped while
a copy into it may run (the service keeps an agent with WRITEs in flight loaded until they
settle). ``plan_ipc``, ``launch_ipc`` and ``copies_settled`` are the Sender's WRITE path
for a registration that asks for it (``PushReg.ipc``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import structlog

from pushsvc.devmem.base import CopyJob, Device, DeviceBuffer, PairCopier
from pushsvc.engine.base import Agent
from pushsvc.errors import DeviceError, LayoutError, TransferError
from pushsvc.protocol import notif
from pushsvc.protocol import peer as pp
from pushsvc.server.peers import Peer
from pushsvc.server.ranks import Rank, RankMemory
from pushsvc.server.remotes import worker_view
from pushsvc.server.verify import digest_memory
from pushsvc.server.writes import Write
from pushsvc.state.landing import CopyPlan, entry_runs
from pushsvc.state.layerwise import Progress
from pushsvc.state.layout import BlockPairs, Layout, check_compatible, pair_blocks, plan_write
from pushsvc.state.producer import Match

log = structlog.get_logger("pushsvc.ipcpush")

MAX_IPC_BYTES = 1 << 50  # what one D agent may ask P to map, over all its buffers
# P launches a copy into D's KV only if it heard from D's daemon (a heartbeat, every 1 s by
# default) within this long. D's worker keeps the blocks of requests its daemon held when
# that daemon went away for longer (the connector's ``IPC_RELEASE_GRACE_S``, 5 s), so a copy
# never lands in blocks vLLM has taken back.
IPC_FENCE_S = 2.5


def host_id() -> str:
    """This host's kernel boot id: the same for every process and container of one host, and
    changed by a reboot (CUDA IPC handles mean nothing on another host)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@dataclass(eq=False)
class IpcTarget:
    """One D agent's worker KV, mapped here, and the copy into it."""

    buffers: list[DeviceBuffer]
    layout: Layout
    copier: PairCopier

    def close(self) -> None:
        self.copier.close()
        for b in self.buffers:
            b.close()
        self.buffers.clear()


class IpcTargets:
    """The same-host D agents one P rank copies into: mapped on the rank's device."""

    def __init__(self, device: Device, layout: Layout, host: str, failures) -> None:
        self._device = device
        self._layout = layout  # P's worker KV (the copies' source)
        self._host = host
        self._failures = failures  # counter of mappings refused, by reason
        self._targets: dict[str, IpcTarget] = {}
        self._withdrawn: set[str] = set()  # D retired them: unmapped once no copy into them runs
        self.refused: dict[str, str] = {}  # agent -> why it is not mapped (kept for its registrations)

    def load(self, info: pp.AgentInfo) -> bool:
        """Map ``info``'s worker KV if it offers it from this host; True if it was mapped now."""
        name, ipc = info.agent_name, info.ipc
        if ipc is None or name in self._targets or name in self.refused:
            return False
        if ipc.host != self._host or not self._host:
            self.refused[name] = "D is on another host"
            return False
        buffers: list[DeviceBuffer] = []
        try:
            if sum(b.size for b in ipc.buffers) > MAX_IPC_BYTES:
                raise LayoutError(f"asks to map more than {MAX_IPC_BYTES} bytes")
            if info.members != 1 or info.stages != 1:
                raise LayoutError("a joint or pipeline-stage agent is written over NIXL")
            for b in ipc.buffers:
                buffers.append(self._device.import_ipc(b.handle))
                if buffers[-1].size < b.size:
                    raise LayoutError(f"buffer of {b.size} bytes maps only {buffers[-1].size}")
            layout = worker_view(info, [b.address for b in buffers])
            check_compatible(self._layout, layout)
            copier = self._device.pair_copier(CopyPlan.build_pairs(self._layout, layout))
        except (DeviceError, LayoutError) as exc:
            for b in buffers:
                b.close()
            self.refused[name] = str(exc)
            self._failures.labels("ipc_map").inc()
            log.warning("ipc_map_failed", agent=name, error=str(exc))
            return False
        self._targets[name] = IpcTarget(buffers, layout, copier)
        log.info("ipc_mapped", agent=name, buffers=len(buffers), bytes=sum(b.size for b in buffers),
                 copy_width=copier.plan.width)
        return True

    def get(self, name: str) -> IpcTarget | None:
        return None if name in self._withdrawn else self._targets.get(name)

    def withdraw(self, name: str) -> None:
        """D retired agent ``name``: no new copy into it; ``reap`` unmaps it."""
        if name in self._targets:
            self._withdrawn.add(name)

    def reap(self, busy: set[str]) -> None:
        """Unmap the withdrawn agents no WRITE of this rank targets (``busy``)."""
        for name in self._withdrawn - busy:
            self.unload(name)

    def unload(self, name: str) -> None:
        """Unmap ``name`` (no copy into it may be in flight)."""
        self._withdrawn.discard(name)
        self.refused.pop(name, None)
        target = self._targets.pop(name, None)
        if target is not None:
            target.close()

    def close(self) -> None:
        for name in list(self._targets):
            self.unload(name)

    def __len__(self) -> int:
        return len(self._targets)


@dataclass(frozen=True, slots=True)
class IpcPlan:
    """A matched registration's same-host push, planned: the pairs and the announcement."""

    target: IpcTarget
    pairs: BlockPairs
    announce: pp.WriteStarted  # D hears of it before the copies launch (verify: P's digests)


def fence(heard_at: float) -> str:
    """Why P may not launch a copy into the KV of a D daemon last heard at ``heard_at``
    (``time.monotonic()``), or "": that daemon may be gone, and its worker may soon reuse
    the blocks."""
    silent = time.monotonic() - heard_at
    if silent <= IPC_FENCE_S:
        return ""
    return (f"nothing heard from D's daemon for {silent:.1f} s (over {IPC_FENCE_S} s): "
            "P copies into D's KV only while D's daemon is known alive")


def ipc_digests(memory: RankMemory, target: Layout, match: Match) -> bytes:
    """P's digests of ``match``'s source blocks (verify mode), in the order a WRITE of the
    same blocks would go: D checks them so."""
    plan = plan_write(memory.layout, target, match.block_ids, match.registration.reg.local_block_ids)
    return digest_memory(memory.descs, plan.src_indices, memory.vram)


def plan_ipc(rank: Rank, match: Match, target: pp.AgentInfo | None, heard_at: float, verify: bool
             ) -> tuple[IpcPlan | None, str, str]:
    """``match``'s copies into ``target``'s mapped worker KV, or why not as (failure kind,
    reason): not mapped, D's daemon not heard from within ``IPC_FENCE_S``, blocks that do
    not pair."""
    memory, reg, targets = rank.memory, match.registration.reg, rank.remotes.ipc
    known = targets if targets is not None and target is not None else None  # None: nothing to look up
    ipc = known.get(target.agent_name) if known is not None else None
    if memory is None or ipc is None:
        why = known.refused.get(target.agent_name, "") if known is not None else ""
        return None, "ipc_unavailable", f"P has not mapped D's KV{': ' + why if why else ''}"
    fenced = fence(heard_at)
    if fenced:
        return None, "ipc_fence", fenced
    try:
        pairs = pair_blocks(memory.layout, ipc.layout, match.block_ids, reg.local_block_ids)
        if not pairs.groups:
            raise LayoutError("D's registration names no block of P's layout")
        digests = ipc_digests(memory, ipc.layout, match) if verify else b""
    except LayoutError as exc:
        return None, "layout_mismatch", str(exc)
    announce = pp.WriteStarted(request_id=reg.request_id, rank=reg.decode_rank,
                               source_rank=rank.source_rank(reg.decode_rank), nbytes=pairs.nbytes, digests=digests)
    return IpcPlan(ipc, pairs, announce), "", ""


def launch_ipc(rank: Rank, match: Match, plan: IpcPlan, remote_agent: str, now: float) -> tuple[Write | None, str]:
    """Launch the planned copies: the Write (its copies in flight), or None and why nothing
    was launched. A launch that fails after others went leaves the Write failed, to settle
    once those finished."""
    started = time.perf_counter()
    copies, error = [], ""
    for group, src, dst in plan.pairs.groups:
        try:
            copies.append(plan.target.copier.launch(group, src, dst))
        except DeviceError as exc:
            error = str(exc)
            break
    if not copies:
        return None, error
    note = notif.encode_completion(match.registration.reg.request_id, rank.tp_size)
    return Write(match, [], remote_agent, plan.pairs.nbytes, now, started,
                 failed=("write_submit_failed", error) if error else None, copies=copies, note=note), ""


@dataclass(eq=False)
class LayerCopy:
    """A layer-wise request's same-host push (``Layerwise``, as ``LayerPost`` for a WRITE):
    planned whole at the match, its copies launched region by region as the request's
    layers become final."""

    progress: Progress
    plan: IpcPlan
    match: Match  # its blocks, for the digests
    copied: np.ndarray = field(init=False)  # per region of the rank: launched

    def __post_init__(self) -> None:
        self.copied = np.zeros(self.progress.map.regions, dtype=bool)

    @property
    def all_posted(self) -> bool:
        return self.progress.complete and bool(self.copied.all())

    @property
    def nbytes(self) -> int:
        return self.plan.pairs.nbytes

    @property
    def logical_blocks(self) -> int:
        return self.plan.pairs.logical_blocks

    def ready(self) -> np.ndarray:
        """The regions that are final and not copied yet."""
        return np.flatnonzero(self.progress.final & ~self.copied)

    def launch(self, ready: np.ndarray) -> tuple[list[CopyJob], str]:
        """Launch the copies of ``ready`` (``ready()``): one per KV group and run of
        adjacent regions. The jobs launched, and why one could not be ("" if none failed;
        what failed is not marked copied, and the push fails)."""
        jobs, error = _launch_runs(self.plan.target.copier, self.plan.pairs.groups, ready)
        if not error:
            self.copied[ready] = True
        return jobs, error

    def digests(self, memory: RankMemory) -> bytes:
        return ipc_digests(memory, self.plan.target.layout, self.match)


def _launch_runs(copier: PairCopier, groups: Iterable[tuple[int, np.ndarray, np.ndarray]], ready: np.ndarray
                 ) -> tuple[list[CopyJob], str]:
    """Launch the pairs of each ``(group, src, dst)`` of ``groups`` over the entries of
    ``ready`` regions: one launch per KV group and run of adjacent regions. The jobs
    launched, and why a launch was refused ("" if none was; those before it stand)."""
    jobs: list[CopyJob] = []
    for group, src, dst in groups:
        for entries in entry_runs(copier.plan, group, ready):
            try:
                jobs.append(copier.launch(group, src, dst, entries))
            except DeviceError as exc:
                return jobs, str(exc)
    return jobs, ""


def launch_together(copies: list[LayerCopy]) -> tuple[list[CopyJob], list[str]]:
    """Launch what each of ``copies`` has ``ready()`` (into one D, the same regions ready
    in each: a step's requests at one of its layers): one launch per KV group and run of
    adjacent regions (``entry_runs``), every copy's pairs in it, where ``LayerCopy.launch``
    makes one per copy. The jobs launched, and per copy why its regions could not be
    launched ("" if they were: they are marked copied).

    If a merged launch is refused (the copier checks every pair again), each copy is
    launched on its own, so that what one request holds fails that request only. The jobs
    of the merged launches that went before stay among those returned: they write into
    the blocks of every copy of the batch, and each waits for all of them."""
    ready = copies[0].ready()
    if len(copies) == 1:
        jobs, error = copies[0].launch(ready)
        return jobs, [error]
    merged: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    for copy in copies:
        for group, src, dst in copy.plan.pairs.groups:
            srcs, dsts = merged.setdefault(group, ([], []))
            srcs.append(src)
            dsts.append(dst)
    groups = [(group, np.concatenate(srcs), np.concatenate(dsts)) for group, (srcs, dsts) in merged.items()]
    jobs, refused = _launch_runs(copies[0].plan.target.copier, groups, ready)
    if refused:
        log.warning("ipc_merged_launch_refused", copies=len(copies), error=refused)
        errors = []
        for copy in copies:
            more, error = copy.launch(ready)
            jobs.extend(more)
            errors.append(error)
        return jobs, errors
    for copy in copies:
        copy.copied[ready] = True
    return jobs, [""] * len(copies)


def launch_check(rank: Rank, peer: Peer | None, copy: LayerCopy, remote_agent: str) -> tuple[str, str] | None:
    """Why a layer of ``copy`` may not be launched now, as (failure kind, reason), or None:
    D's daemon gone or silent past the fence, or D's KV no longer mapped."""
    if peer is None or not peer.alive:
        return "peer_lost", "D's daemon went away before the last layer was final"
    fenced = fence(peer.heard_at)
    if fenced:
        return "ipc_fence", fenced
    targets = rank.remotes.ipc
    if targets is None or targets.get(remote_agent) is not copy.plan.target:
        return "ipc_unavailable", "D withdrew its KV before the last layer was final"
    return None


def copies_settled(agent: Agent, write: Write) -> bool:
    """Whether ``write``'s copies all finished (never blocks). When they have, and none
    failed, D hears the completion notification, as it would after a WRITE."""
    try:
        # One stream per device, so they finish in the order they were launched: the
        # first not done ends the look (a layer-wise push holds up to one per layer).
        copies = write.copies
        done = 0
        while done < len(copies) and copies[done].done():
            done += 1
        del copies[:done]
    except DeviceError as exc:
        # A device fault leaves the context unusable: no later query means more.
        write.copies = []
        if write.failed is None:
            write.failed = ("ipc_copy", str(exc))
    if write.copies:
        return False
    if write.note and write.failed is None:
        try:
            agent.send_notif(write.remote_agent, write.note)
        except TransferError as exc:
            write.failed = ("write_failed", f"the completion notification could not be sent: {exc}")
    write.note = b""
    return True
