"""P's WRITEs: planning one push, posting it in parts (or, layer-wise, piece by piece as
its layers become final; from host memory, a slice per loop pass), releasing the parts as
they settle. The NIXL calls of the Sender's WRITE path, kept apart from its matching and
reporting (``sender.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import structlog
from prometheus_client import Counter

from pushsvc.engine.base import Agent, DListHandle, XferHandle, XferState
from pushsvc.errors import LayoutError, TransferError
from pushsvc.protocol import notif
from pushsvc.protocol import peer as pp
from pushsvc.server.ranks import Rank, RankMemory
from pushsvc.server.verify import digest_memory
from pushsvc.state.landing import parts_for
from pushsvc.state.layerwise import Progress, postable
from pushsvc.state.layout import Layout, WritePlan, part_run, plan_write, slice_cuts, split_plan
from pushsvc.state.producer import Match

if TYPE_CHECKING:
    from pushsvc.server.ipcpush import LayerCopy

log = structlog.get_logger("pushsvc.sender")


def _try_write(agent: Agent, local: DListHandle, src: np.ndarray, remote: DListHandle, dst: np.ndarray,
               note: bytes) -> tuple[XferHandle | None, XferState, str]:
    """Post one WRITE: its handle and first state, or (None, ERR, why it could not be posted)."""
    try:
        handle, state = agent.write(local, src, remote, dst, note)
    except TransferError as exc:
        return None, XferState.ERR, str(exc)
    return handle, state, ""


def _post_part(agent: Agent, local: DListHandle, src: np.ndarray, remote: DListHandle, dst: np.ndarray,
               remote_agent: str, note: bytes) -> tuple[XferHandle | None, XferState, str]:
    """Post one part of a WRITE with its notification (``_try_write``). A part without
    pairs (D registered no block of its regions' group) sends the notification alone: no
    handle, state ``DONE``. Not posted: no handle, state ``ERR``, and why."""
    if len(src):
        return _try_write(agent, local, src, remote, dst, note)
    try:
        agent.send_notif(remote_agent, note)
    except TransferError as exc:
        return None, XferState.ERR, str(exc)
    return None, XferState.DONE, ""


@dataclass(eq=False)
class LayerPost:
    """A matched layer-wise request's WRITE: planned whole, posted as its layers become
    final. Into a D that copies parts out of a landing buffer as they land
    (``AgentInfo.parts``), in ``parts`` parts of whole layers (``LayerMap.parts``), each
    posted once its layers are final, with its part notification: D copies each out while
    later layers compute. Else without a notification, the completion sent once all landed."""

    progress: Progress
    plan: WritePlan
    local: DListHandle
    remote: DListHandle
    descs: np.ndarray  # the source's descriptor table (P's digests, in verify mode, are over it)
    parts: int = 1
    note_id: str = ""  # D's request id, for the parts' notifications
    tp_size: int = 1
    posted: np.ndarray = field(init=False)  # per region the plan numbers (or per part): its pairs went

    def __post_init__(self) -> None:
        if self.parts > 1:
            self.posted = np.zeros(self.parts, dtype=bool)  # a part without pairs still says it landed
        else:
            self.posted = np.diff(self.plan.edges) == 0  # a region without pairs has nothing to post

    @property
    def all_posted(self) -> bool:
        return self.progress.complete and bool(self.posted.all())

    @property
    def nbytes(self) -> int:
        return self.plan.nbytes

    @property
    def logical_blocks(self) -> int:
        return self.plan.logical_blocks

    def digests(self, memory: RankMemory) -> bytes:
        """P's digests of the source (verify mode): taken once every region is final."""
        return digest_memory(self.descs, self.plan.src_indices, memory.vram)

    def post_final(self, agent: Agent, remote_agent: str) -> tuple[list[XferHandle], list[XferState], str]:
        """Post the descriptors that are final and not posted yet: the handles posted (none
        if nothing was final), their first states, and why a post failed ("" if none did;
        the posts before it stand)."""
        if self.parts > 1:
            return self._post_parts(agent, remote_agent)
        ready = postable(self.progress.final, self.posted)
        if not len(ready):
            return [], [], ""
        edges = self.plan.edges  # region r's pairs: plan[edges[r]:edges[r + 1]]
        runs = [slice(edges[r], edges[r + 1]) for r in ready.tolist()]
        src = np.concatenate([self.plan.src_indices[run] for run in runs])
        dst = np.concatenate([self.plan.dst_indices[run] for run in runs])
        handle, state, error = _try_write(agent, self.local, src, self.remote, dst, b"")
        if handle is None:
            return [], [], error
        self.posted[ready] = True
        return [handle], [state], ""

    def _post_parts(self, agent: Agent, remote_agent: str) -> tuple[list[XferHandle], list[XferState], str]:
        handles: list[XferHandle] = []
        states: list[XferState] = []
        for i in np.flatnonzero(~self.posted).tolist():
            part, run = part_run(self.plan, self.parts, i)
            if not self.progress.final[part].all():
                continue
            note = notif.encode_part(self.note_id, self.tp_size, i, self.parts)
            handle, state, error = _post_part(agent, self.local, self.plan.src_indices[run], self.remote,
                                              self.plan.dst_indices[run], remote_agent, note)
            if handle is None and state is XferState.ERR:
                return handles, states, error
            if handle is not None:
                handles.append(handle)
                states.append(state)
            self.posted[i] = True
        return handles, states, ""


@dataclass(eq=False)
class SlicedPost:
    """A WRITE from host memory, posted one slice per pass of the progress loop: a post
    moves its bytes before it returns (by cma on one host, over TCP between hosts), and
    holds the daemon's loop that long (docs/architecture.md, "UCX transports"). A slice
    goes once the ones before it settled; the last carries the completion notification."""

    plan: WritePlan
    local: DListHandle
    remote: DListHandle
    cuts: tuple[int, ...]  # slice i is the plan's pairs cuts[i]:cuts[i + 1]
    note: bytes
    posted: int = 0  # slices posted
    # The first slice is posted while the progress pass matches; its poll, later in the
    # same pass, leaves the next one to the pass after.
    fresh: bool = True

    @property
    def left(self) -> bool:
        return self.posted < len(self.cuts) - 1

    @property
    def progress(self) -> str:
        """Slices posted of all, as "posted/all" (for the log)."""
        return f"{self.posted}/{len(self.cuts) - 1}"

    def post_next(self, agent: Agent) -> tuple[XferHandle | None, XferState, str]:
        """Post the next slice: its handle (None if it could not be posted), its first
        state, and why it could not be posted ("" if it was)."""
        a, b = self.cuts[self.posted], self.cuts[self.posted + 1]
        last = self.posted + 2 == len(self.cuts)
        handle, state, error = _try_write(agent, self.local, self.plan.src_indices[a:b], self.remote,
                                          self.plan.dst_indices[a:b], self.note if last else b"")
        if handle is not None:
            self.posted += 1
        return handle, state, error


@dataclass(slots=True, eq=False)
class Write:
    """A posted WRITE, in one or more parts. Its blocks stay leased until every part's
    handle settled."""

    match: Match
    handles: list[XferHandle]  # the parts not settled yet
    remote_agent: str
    nbytes: int
    posted_at: float  # loop time
    started: float  # perf_counter() just before the post
    cancelled: bool = False  # D withdrew the registration: acknowledge once settled
    staged: str = ""  # the key of P's staging slots it reads ("" if none): freed once every part settled
    # Why a part failed (to post, or in NIXL), as (failure kind, reason): the push fails
    # with it once every part settled.
    failed: tuple[str, str] | None = None
    # Layer-wise push: posted piece by piece as the request's layers become final (into a
    # same-host D: copied so, ``LayerCopy``); the completion goes once all of it landed
    # (``server/layerwise.py``).
    layered: LayerPost | LayerCopy | None = None
    sliced: SlicedPost | None = None  # from host memory, a slice per loop pass
    # Same-host push (``server/ipcpush.py``): P's copies into D's KV, not NIXL parts, and
    # the completion notification sent once they finished.
    copies: list = field(default_factory=list)
    note: bytes = b""

    @property
    def waiting_for_layers(self) -> bool:
        """Some of it is still to be posted, and nothing stopped it."""
        return self.layered is not None and not self.layered.all_posted and self.failed is None and not self.cancelled


@dataclass(frozen=True, slots=True)
class PushPlan:
    plan: WritePlan
    parts: int
    digests: bytes  # verify mode: P's digests of the source blocks, else b""
    local: DListHandle  # the source descriptors: the worker's KV, or P's staging buffer
    descs: np.ndarray  # ... and their table (what digests are computed over)
    cuts: tuple[int, ...] = ()  # more than two: posted in slices (``SlicedPost``)


def plan_push(memory: RankMemory, remote: Layout, match: Match, target: pp.AgentInfo, peer_minor: int,
              part_bytes: int, verify: bool, slot_ids: list[list[int]] | None = None,
              source: tuple[Layout, np.ndarray, DListHandle] | None = None, whole: bool = False,
              slice_bytes: int = 0) -> PushPlan:
    """What ``match`` WRITEs into ``target``: from the worker's blocks, or with ``slot_ids``
    from the staging slots its blocks were copied into; into a joint agent, from
    ``source`` (``RankMemory.joint_source``). ``whole``: in one part, whatever the
    target (a layer-wise push). A WRITE in one part from host memory goes in slices of
    about ``slice_bytes`` (0: in one post). LayoutError if it cannot."""
    staging = memory.staging if slot_ids is not None else None
    if target.members > 1:  # a joint agent of D ranks: P's head slices, member by member
        if staging is not None:
            raise LayoutError("a D TP above P's reads the worker's blocks in head slices, "
                              "not P's staging buffer (staging_mib)")
        assert source is not None
        (layout, descs, local), src_ids = source, match.block_ids
    elif staging is not None:
        layout, descs, local, src_ids = staging.layout, staging.descs, staging.dlist, slot_ids
    elif memory.dlist is not None:
        layout, descs, local, src_ids = memory.layout, memory.descs, memory.dlist, match.block_ids
    else:
        raise LayoutError("this rank's KV memory was registered to receive only")
    plan = plan_write(layout, remote, src_ids, match.registration.reg.local_block_ids)
    if not len(plan.src_indices):
        raise LayoutError("D's registration names no block of P's layout")
    # A landing D copies each part out as it lands; others get one WRITE.
    parts = parts_for(plan.nbytes, part_bytes, plan.region_count) if (
        target.parts and peer_minor >= pp.PARTS_MINOR and not whole) else 1
    digests = digest_memory(descs, plan.src_indices, memory.vram) if verify else b""
    sliced = parts == 1 and not whole and memory.mem_type == "DRAM"
    return PushPlan(plan, parts, digests, local, descs, slice_cuts(plan, slice_bytes) if sliced else ())


def write_started(rank: Rank, reg: notif.PushReg, nbytes: int, digests: bytes) -> pp.WriteStarted:
    """D's announcement of the WRITE ``rank`` makes for ``reg`` (``digests``: verify mode)."""
    return pp.WriteStarted(request_id=reg.request_id, rank=reg.decode_rank,
                           source_rank=rank.source_rank(reg.decode_rank), nbytes=nbytes, digests=digests)


def post_parts(agent: Agent, remote: DListHandle, remote_agent: str, push: PushPlan,
               rid: str, tp_size: int) -> tuple[list[XferHandle], list[XferState], str]:
    """Post the WRITE's parts, each with its notification; stop at the first that fails
    to post (those posted land and settle as usual). Returns the handles, their latest
    states and why posting stopped ("" if it did not).

    A part still in progress when posted gets its notification sent by NIXL only when
    its state is checked and found done. So after each post the parts posted before it
    are checked: a part that landed is announced to D while later parts are still being
    posted, and D copies it out meanwhile (not all parts at once after the last post)."""
    handles: list[XferHandle] = []
    states: list[XferState] = []
    parts = push.parts
    for i, piece in enumerate(split_plan(push.plan, parts)):
        note = notif.encode_part(rid, tp_size, i, parts) if parts > 1 else notif.encode_completion(rid, tp_size)
        handle, xstate, error = _post_part(agent, push.local, piece.src_indices, remote, piece.dst_indices,
                                           remote_agent, note)
        if handle is None:
            if xstate is XferState.ERR:
                return handles, states, error
            continue
        for j, earlier in enumerate(states):
            if earlier is XferState.PROC:
                states[j] = agent.state(handles[j])
        handles.append(handle)
        states.append(xstate)
    return handles, states, ""


def post_write(agent: Agent, remote: DListHandle, remote_agent: str, push: PushPlan, rid: str,
               tp_size: int) -> tuple[list[XferHandle], list[XferState], str, SlicedPost | None]:
    """``post_parts``; for a WRITE in slices, its first slice and what posts the rest
    (``next_slice``)."""
    if len(push.cuts) <= 2:
        return (*post_parts(agent, remote, remote_agent, push, rid, tp_size), None)
    sliced = SlicedPost(push.plan, push.local, remote, push.cuts, notif.encode_completion(rid, tp_size))
    handle, xstate, error = sliced.post_next(agent)
    return ([handle], [xstate], "", sliced) if handle is not None else ([], [], error, sliced)


def next_slice(agent: Agent, write: Write, now: float, post: bool, posts: Counter) -> bool:
    """Every slice ``write`` posted so far settled: post the next one (with ``post``: from
    the progress loop's poll, once per pass). True while the WRITE goes on: it is not
    settled then. A failed post, or D's withdrawal, ends it with what was posted."""
    sliced = write.sliced
    if sliced is None or not sliced.left or write.failed is not None:
        return False
    if write.cancelled:
        write.failed = ("cancelled", "D withdrew the registration before the whole WRITE was posted")
        return False
    if not post:
        return True
    if sliced.fresh:  # the pass that posted the first slice
        sliced.fresh = False
        return True
    handle, _, error = sliced.post_next(agent)
    if handle is None:
        write.failed = ("write_submit_failed", error)
        return False
    write.handles.append(handle)
    write.posted_at = now  # moving: the loop stays at its hot pace
    posts.inc()
    return True


def release_settled(agent: Agent, write: Write, states: list[XferState]) -> bool:
    """Release the parts of ``write`` that ``states`` says settled (noting a failure);
    True once no part is left."""
    pending = []
    for handle, xstate in zip(write.handles, states):
        if xstate is XferState.PROC:
            pending.append(handle)
            continue
        if xstate is not XferState.DONE and write.failed is None:
            write.failed = ("write_failed", "NIXL reported the WRITE failed")
        try:
            agent.release(handle)
        except TransferError as exc:
            log.warning("write_release_failed", request_id=write.match.request_id, error=str(exc))
    write.handles = pending
    return not pending


def release_all(agent: Agent, write: Write) -> None:
    """Shutdown, after the drain: give back whatever handles are left."""
    for handle in write.handles:
        try:
            agent.release(handle)
        except TransferError:
            pass
