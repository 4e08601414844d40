"""P's side: match D's registrations with the worker's finished blocks, WRITE, settle.

One ``ProducerTable`` and one set of posted WRITEs per ``Rank``. The fast path (the
registration's sender is a live, known agent; descriptors prepared) posts the WRITE
inline, in the same loop iteration that completed the match; only a peer without a live
session defers it to a handshake task. Any failure frees P's lease at once and tells D
at once over the side channel, so neither side waits for a timer.

D's registrations (PUSH_REG) come in through ``Intake`` (``server/intake.py``), which
checks each against what P knows of its sender before it can match.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from pushsvc.config import Config
from pushsvc.engine.base import XferState
from pushsvc.errors import HandshakeError, LayoutError, ProtocolError, TransferError
from pushsvc.metrics import Metrics
from pushsvc.protocol import notif
from pushsvc.protocol import peer as pp
from pushsvc.protocol import worker as wp
from pushsvc.server.intake import Intake
from pushsvc.server.ipcpush import LayerCopy, copies_settled, launch_ipc, plan_ipc
from pushsvc.server.layerwise import Layerwise
from pushsvc.server.outbox import Outbox
from pushsvc.server.peers import Peer, PeerLink
from pushsvc.server.ranks import Rank
from pushsvc.server.tasks import TaskSet
from pushsvc.server.timelines import Timelines
from pushsvc.server.staging import Staging
from pushsvc.server.writes import (LayerPost, Write, next_slice, plan_push, post_write, release_all,
                                   release_settled, write_started)
from pushsvc.state.layout import check_block_ids
from pushsvc.state.timeline import SEND
from pushsvc.state.producer import ExpiryKind, Match, ProducerTable, Registration, StageOutcome

log = structlog.get_logger("pushsvc.sender")


@dataclass(frozen=True, slots=True)
class SendSettings:
    engine_id: str
    lease_s: float
    registration_ttl_s: float
    max_notif_bytes: int
    verify: bool
    unverified_ttl_s: float  # how long a PUSH_REG from an unannounced agent may wait
    part_bytes: int = 0  # WRITEs into a landing buffer go in parts of about this size
    slice_bytes: int = 0  # WRITEs from host memory go a slice of about this size per loop pass

    @classmethod
    def of(cls, config: Config) -> SendSettings:
        return cls(config.engine_id, config.lease_s, config.registration_ttl_s, config.max_notif_bytes, config.verify,
                   config.handshake_timeout_s, config.write_part_mib << 20, config.post_slice_mib << 20)


# How long P polls hot for staged blocks whose registration D's ``RegSent`` announced: the
# PUSH_REG went out before it, so it is normally there at the first pass.
REG_SENT_HOT_S = 0.005


@dataclass(eq=False)
class _RankSends:
    table: ProducerTable
    writes: dict[str, Write] = field(default_factory=dict)  # by P's request id
    # Staged requests whose registration is on its way (``RegSent``): P's request id ->
    # until when to poll hot for it. Set once per request; dropped once matched or past.
    expected: dict[str, float] = field(default_factory=dict)


class Sender:
    def __init__(self, *, settings: SendSettings, outbox: Outbox, peers: PeerLink, metrics: Metrics,
                 tasks: TaskSet, drain: Callable[[Rank], None], wake: Callable[[], None],
                 timelines: Timelines) -> None:
        self._settings = settings
        self._timelines = timelines
        self._outbox = outbox
        self._peers = peers
        self._metrics = metrics
        self._tasks = tasks
        self._drain = drain  # reads the rank's queued notifications (a PUSH_REG may wait there)
        self._wake = wake
        self._ranks: dict[Rank, _RankSends] = {}
        self.staging = Staging(metrics=metrics, current=self._current, ready=self._post, failed=self._fail_push)
        self.layerwise = Layerwise(metrics=metrics, timelines=timelines, peers=peers, verify=settings.verify,
                                   writes=lambda rank: self._of(rank).writes, settle=self._settle_parts,
                                   unposted=self._end_unposted, wake=wake, now=self._now)
        self.intake = Intake(engine_id=settings.engine_id, max_notif_bytes=settings.max_notif_bytes, peers=peers,
                             metrics=metrics, outbox=outbox, table=lambda rank: self._of(rank).table,
                             tables=lambda: [(rank, state.table) for rank, state in self._ranks.items()],
                             start=self._start_push, released=self._released, tell_d=self._tell_d, now=self._now)

    def _current(self, rank: Rank, match: Match) -> bool:
        state = self._ranks.get(rank)
        return state is not None and state.table.writing.get(match.request_id) is match

    def _of(self, rank: Rank) -> _RankSends:
        state = self._ranks.get(rank)
        if state is None:
            s = self._settings
            state = self._ranks[rank] = _RankSends(ProducerTable(s.lease_s, s.registration_ttl_s, s.unverified_ttl_s))
        return state

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    # ------------------------------------------------------------------ from the worker

    def on_send_ready(self, rank: Rank, msg: wp.SendReady | wp.SendStart) -> None:
        """P's blocks of ``msg.request_id`` are final, or (``SendStart``, layer-wise push)
        become final layer by layer in the step now running: stage them, and push at once
        if D's registration is here."""
        rid = msg.request_id
        step = msg.step if isinstance(msg, wp.SendStart) else None
        state = self._of(rank)
        log.debug("send_ready" if step is None else "send_start", request_id=rid, rank=rank.number)
        if state.table.tracks(rid):
            # Before the block check: refusing it would fail the live request, and its
            # worker would free blocks a WRITE may still be reading.
            self._metrics.duplicates.labels("finished_blocks").inc()
            return
        try:
            if rank.memory is None:
                raise LayoutError("no KV memory registered for this rank")
            block_ids = wp.unpack_ids(msg.block_ids)
            check_block_ids(rank.memory.layout, block_ids, "finished blocks")
            why = self.layerwise.refusal(rank, step) if step is not None else ""
            if why:
                raise LayoutError(why)
        except (LayoutError, ProtocolError) as exc:
            self._rejected(rank, rid, str(exc))
            return
        self._timelines.open(rank, SEND, rid, "send_ready" if step is None else "send_start")
        if step is not None:
            self.layerwise.start(rank, step, rid)  # before a match: the WRITE is then posted layer by layer
        self._drain(rank)  # a PUSH_REG may already be queued in the agent: read it first
        result = state.table.add_staged(rid, block_ids, self._now(), msg.match_key)
        if result.outcome is StageOutcome.DUPLICATE:
            self._metrics.duplicates.labels("finished_blocks").inc()
        elif result.outcome is StageOutcome.RELEASED:
            self.layerwise.drop(rank, rid)
            self._released(rank, rid, "D released the exchange before P's blocks were ready")
        elif result.outcome is StageOutcome.AMBIGUOUS:
            self.layerwise.drop(rank, rid)
            self.intake.ambiguous(rank, [rid], result.collided)
        elif result.outcome is StageOutcome.FULL:
            self.layerwise.drop(rank, rid)
            self._rejected(rank, rid, f"P holds {state.table.max_staged} staged requests of this rank already, "
                                      "none registered for by D yet")
        elif result.match is not None:
            self._start_push(rank, result.match)

    def _rejected(self, rank: Rank, rid: str, reason: str) -> None:
        """The worker's finished blocks of ``rid`` are refused: a per-request refusal of its input."""
        self._metrics.malformed.labels("worker", "finished_blocks").inc()
        log.warning("send_rejected", request_id=rid, rank=rank.number, error=reason)
        self._outbox.tell(rank, wp.SendFailed(request_id=rid, reason=reason))

    def reg_sent(self, peer: Peer, msg: pp.RegSent, ranks: list[Rank]) -> None:
        """D's ``RegSent``: the PUSH_REGs of its registration went out. Where a rank holds
        staged blocks that registration would pair with, poll hot until they are matched
        (``REG_SENT_HOT_S`` at most); read the agents' notifications at once either way."""
        now, awaited = self._now(), False
        for rank in ranks:
            state = self._ranks.get(rank)
            if state is None:
                continue
            staged = state.table.awaiting(msg.request_id, msg.match_key)
            if staged is not None:
                state.expected.setdefault(staged.request_id, now + REG_SENT_HOT_S)
                awaited = True
        self._metrics.reg_sent.labels("awaited" if awaited else "ahead").inc()
        log.debug("reg_sent", request_id=msg.request_id, peer=peer.engine_id, awaited=awaited)
        self._wake()

    def evict(self, rank: Rank, rid: str) -> None:
        """The worker dropped ``rid``: staged blocks are released at once; a WRITE in
        flight is not evictable (its SendDone/SendFailed follows)."""
        state = self._ranks.get(rank)
        if state is None:
            return
        self.layerwise.drop(rank, rid)
        if state.table.evict(rid, self._now()) is not None:
            log.info("evicted", request_id=rid, rank=rank.number)
            self._outbox.tell(rank, wp.SendFailed(request_id=rid, reason="cancelled"))
            return
        write = state.writes.get(rid)
        if write is not None and write.waiting_for_layers:
            # Layers still to come will never be final for D: stop, fail once posted ones settled.
            self.layerwise.stop(rank, write, ("cancelled", "P's request ended before its last layer was final"))

    def worker_detached(self, rank: Rank) -> None:
        """The worker left: nothing of its requests is pushed any more beyond what is posted.
        Its staged blocks go back; a match that posted nothing yet (its handshake or its
        staging copy running) fails on both sides now, not at D's watchdog; a layer-wise
        WRITE posts nothing more and fails once what it posted settled."""
        state = self._ranks.get(rank)
        if state is None:
            return
        for rid in list(state.table.staged):
            self.evict(rank, rid)
        for rid in [rid for rid in state.table.writing if rid not in state.writes]:
            self._end_unposted(rank, rid, ("worker_gone", "P's worker left before the WRITE was posted"))
        for write in [w for w in state.writes.values() if w.waiting_for_layers]:
            self.layerwise.stop(rank, write, ("worker_gone", "P's worker left before the last layer was final"))
        self.layerwise.forget(rank)

    def _end_unposted(self, rank: Rank, rid: str, failure: tuple[str, str]) -> None:
        """``rid`` must not be pushed, and nothing of it is posted: staged, its blocks go
        back; matched (a handshake or a staging copy running), its push fails on both
        sides now. Either way its worker hears ``SendFailed`` with ``failure``'s reason."""
        state = self._ranks.get(rank)
        if state is None:
            return
        kind, reason = failure
        if state.table.evict(rid, self._now()) is not None:
            self._metrics.failures.labels(kind).inc()
            log.warning("push_failed", request_id=rid, rank=rank.number, kind=kind, error=reason)
            self._outbox.tell(rank, wp.SendFailed(request_id=rid, reason=f"{kind}: {reason}"))
        elif (match := state.table.writing.get(rid)) is not None and rid not in state.writes:
            self._fail_push(rank, match, None, kind, reason)

    # ------------------------------------------------------------------ the WRITE

    def _start_push(self, rank: Rank, match: Match) -> None:
        self._timelines.mark(rank, SEND, match.request_id, "matched")
        self._timelines.paired(rank, match.request_id, match.registration.request_id)
        peer = self._peers.find_agent(match.registration.sender)
        if peer is not None and peer.alive:
            self._write(rank, match, peer)
        elif peer is not None:
            self._tasks.spawn(self._push_after_handshake(rank, match, peer))
        else:
            self._fail_push(rank, match, None, "peer_lost", "the registration's D daemon went away")

    async def _push_after_handshake(self, rank: Rank, match: Match, known: Peer) -> None:
        # Dial where D's daemon said it listens in its hello: never an address the
        # PUSH_REG itself names.
        try:
            peer: Peer | None = await self._peers.ensure(known.host, known.port, known.engine_id)
            error = ""
        except HandshakeError as exc:
            peer, error = None, str(exc)
        if not self._current(rank, match):
            return  # cancelled, failed or its rank closed while the handshake ran: already final
        if peer is None or match.registration.sender not in peer.agents:
            self._fail_push(rank, match, None, "handshake_failed", error or "D's agent is gone")
        else:
            self._write(rank, match, peer)

    def _write(self, rank: Rank, match: Match, peer: Peer) -> None:
        if match.registration.reg.ipc:  # same-host push: P copies into D's KV itself
            self._copy_into(rank, match, peer)
        elif self.staging.applies(rank):  # copy into staging slots first; _post once copied
            self.staging.start(rank, match, peer)
        else:
            self._post(rank, match, peer, None, "")

    def _copy_into(self, rank: Rank, match: Match, peer: Peer) -> None:
        """Same-host push: P's copies into D's mapped KV (``server/ipcpush.py``), then the
        completion notification once they finished (``poll``). A layer-wise request whose
        layers are not all final is copied layer by layer as they become so (``LayerCopy``)."""
        sender = match.registration.sender
        progress = self.layerwise.pending(rank, match.request_id)
        plan, kind, reason = plan_ipc(rank, match, peer.agents.get(sender), peer.heard_at,
                                      self._settings.verify and progress is None)
        if plan is None:  # checked at the match, so what cannot be copied fails at once
            self._fail_push(rank, match, peer, kind, reason)
            return
        if progress is not None:  # digests once every layer is final
            self.layerwise.begin(rank, match, peer, sender, LayerCopy(progress, plan, match), self._now(),
                                 time.perf_counter())
            return
        self._timelines.mark(rank, SEND, match.request_id, "write_planned")
        self._peers.send(peer, plan.announce)
        write, error = launch_ipc(rank, match, plan, sender, self._now())
        if write is None:
            self._fail_push(rank, match, peer, "write_submit_failed", error)
        else:
            self._metrics.ipc_copies.inc()
            self._posted(rank, write, peer, 0)  # no NIXL part: copies on the device

    def _post(self, rank: Rank, match: Match, peer: Peer, slot_ids: list[list[int]] | None, staged: str) -> None:
        """Plan and post ``match``'s WRITE: from the worker's blocks, or (``staged``: the
        key of its staging slots) from the slots ``slot_ids`` they were copied into."""
        reg = match.registration.reg
        target = peer.agents.get(match.registration.sender)
        memory = rank.memory
        if target is None or memory is None:
            self._unposted(rank, match, peer, staged, "layout_mismatch", "D's agent or P's KV memory is gone")
            return
        s = self._settings
        # Layer-wise: the step that finishes its prefill is still running; posted as its
        # layers become final, in one part, digests once all of it is.
        pending = self.layerwise.pending(rank, match.request_id) if not staged else None
        layered = pending is not None
        try:
            joint = target.members > 1  # a joint agent of D's ranks: P's head slices, member by member
            remote = rank.remotes.layout(target, memory.joint_view(target.members) if joint else memory.layout)
            source = memory.joint_source(rank.agent, target.members) if joint else None  # once it fits D's
            push = plan_push(memory, remote, match, target, peer.minor, s.part_bytes, s.verify and not layered,
                             slot_ids, source, whole=layered, slice_bytes=s.slice_bytes)
        except LayoutError as exc:
            self._unposted(rank, match, peer, staged, "layout_mismatch", str(exc))
            return
        except TransferError as exc:  # preparing the joint source's descriptors
            self._unposted(rank, match, peer, staged, "write_submit_failed", str(exc))
            return
        # Wall clock, not loop.time(): uvloop caches the loop's time per iteration, and a
        # WRITE over shared memory may complete inside this very call.
        started = time.perf_counter()
        if pending is not None:
            # Into a landing D, in parts of whole layers that D copies out as they land (one
            # source of the request's blocks: not a joint agent, not one of several stages).
            parts = pending.map.parts() if (target.parts and peer.minor >= pp.PARTS_MINOR and target.members == 1
                                            and rank.stages == 1
                                            and push.plan.region_count == pending.map.regions) else 1
            post = LayerPost(pending, push.plan, push.local, rank.remotes.dlist(target.agent_name), push.descs,
                             parts, reg.request_id, rank.tp_size)
            self.layerwise.begin(rank, match, peer, target.agent_name, post, self._now(), started)
            return
        self._timelines.mark(rank, SEND, match.request_id, "write_planned")
        # Announced before the post: D polls back to back from when it hears of the WRITE,
        # and a WRITE between two processes of a host settles only while D progresses, so D
        # starts while P posts.
        self._peers.send(peer, write_started(rank, reg, push.plan.nbytes, push.digests))
        handles, states, failed, sliced = post_write(rank.agent, rank.remotes.dlist(target.agent_name),
                                                     target.agent_name, push, reg.request_id, rank.tp_size)
        if not handles:
            self._unposted(rank, match, peer, staged, "write_submit_failed", failed)
            return
        write = Write(match, handles, target.agent_name, push.plan.nbytes, self._now(), started,
                      failed=("write_submit_failed", failed) if failed else None, staged=staged, sliced=sliced)
        self._posted(rank, write, peer, len(handles), descriptors=len(push.plan.src_indices))
        self._settle_parts(rank, write, states, post=False)  # a next slice goes in the next pass

    def _posted(self, rank: Rank, write: Write, peer: Peer, parts: int, **details: int) -> None:
        match = write.match
        self._metrics.match_wait_seconds.observe(write.posted_at - match.staged.staged_at)
        self._metrics.write_parts.inc(parts)
        self._of(rank).writes[match.request_id] = write
        self._timelines.mark(rank, SEND, match.request_id, "write_posted")
        self._metrics.transfer_blocks.inc(sum(len(ids) for ids in match.registration.reg.local_block_ids))
        log.debug("write_posted", request_id=match.request_id, peer=peer.engine_id, bytes=write.nbytes, parts=parts,
                  copies=len(write.copies), **details)
        self._wake()

    def _unposted(self, rank: Rank, match: Match, peer: Peer, staged: str, kind: str, reason: str) -> None:
        """``match``'s WRITE cannot be posted: its staging slots go back, the push fails."""
        self.staging.release(rank, staged)
        self._fail_push(rank, match, peer, kind, reason)

    def _settle_parts(self, rank: Rank, write: Write, states: list[XferState], post: bool = True) -> None:
        """Release the parts of ``write`` that settled; once none is left (and none of its
        same-host copies runs), settle it (layer-wise once all is posted or it stopped; in
        slices once the last one settled, ``post``: the next now)."""
        if write.copies and not copies_settled(rank.agent, write):
            return
        if not release_settled(rank.agent, write, states) or next_slice(rank.agent, write, self._now(), post,
                                                                        self._metrics.write_parts):
            return
        layered = write.layered
        if layered is not None and write.failed is None:
            if not layered.all_posted:
                if not write.cancelled:
                    return  # the rest goes as its layers become final
                write.failed = ("cancelled", "D withdrew the registration before the last layer was final")
            else:
                self.layerwise.complete(rank, write)
        self._settle(rank, write)

    def _released(self, rank: Rank, rid: str, reason: str) -> None:
        """D released P's request (its own ended before it was scheduled): the blocks are
        free now, with nothing written."""
        self._metrics.transfers.labels("released").inc()
        log.info("push_released", request_id=rid, rank=rank.number, reason=reason)
        self._outbox.tell(rank, wp.SendDone(request_id=rid))

    def poll(self, rank: Rank) -> None:
        """Settle every WRITE of ``rank`` that is no longer in progress."""
        self.layerwise.poll(rank)  # a GPU worker's layers, final once its events say so (held with or without sends)
        state = self._ranks.get(rank)
        if state is None:
            return
        for write in list(state.writes.values()):
            self._settle_parts(rank, write, [rank.agent.state(h) for h in write.handles])
        self.staging.poll(rank)
        if state.expected:
            now = self._now()
            state.expected = {rid: until for rid, until in state.expected.items()
                              if until > now and rid in state.table.staged}

    def _settle(self, rank: Rank, write: Write) -> None:
        rid = write.match.request_id
        state = self._of(rank)
        del state.writes[rid]
        self.staging.release(rank, write.staged)  # every part settled: nothing reads the slots
        seconds = time.perf_counter() - write.started
        self._timelines.mark(rank, SEND, rid, "write_settled")
        log.debug("write_settled", request_id=rid, state="ERR" if write.failed else "DONE",
                  error=write.failed and ": ".join(write.failed), seconds=round(seconds, 6),
                  **({"slices": write.sliced.progress} if write.sliced else {}))
        if write.failed is None:
            state.table.finish(rid, self._now())
            self._metrics.transfers.labels("done").inc()
            self._metrics.transfer_bytes.inc(write.nbytes)
            self._metrics.transfer_seconds.observe(seconds)
            self._outbox.tell(rank, wp.SendDone(request_id=rid))
        else:
            kind, reason = write.failed
            self._fail_push(rank, write.match, self._peers.find_agent(write.remote_agent), kind, reason,
                            notify_remote=not write.cancelled)
        if write.cancelled:
            self._ack_cancel(rank, write.match.registration)

    def _fail_push(self, rank: Rank, match: Match, peer: Peer | None, kind: str, reason: str,
                   notify_remote: bool = True) -> None:
        """P cannot push: free P's lease now and tell D now (not at its watchdog)."""
        self._of(rank).table.finish(match.request_id, self._now())
        self._metrics.transfers.labels("failed").inc()
        self._metrics.failures.labels(kind).inc()
        reg = match.registration.reg
        log.warning("push_failed", request_id=match.request_id, remote_request_id=reg.request_id,
                    peer=reg.decode_engine_id, kind=kind, error=reason)
        self._outbox.tell(rank, wp.SendFailed(request_id=match.request_id, reason=f"{kind}: {reason}"))
        peer = peer or self._peers.find_agent(match.registration.sender)
        if notify_remote and peer is not None:
            self._tell_d(rank, peer, reg, f"{kind}: {reason}")

    def _tell_d(self, rank: Rank, peer: Peer, reg: notif.PushReg, reason: str) -> None:
        self._peers.send(peer, pp.PushFailed(request_id=reg.request_id, rank=reg.decode_rank, reason=reason[:4096],
                                             source_rank=rank.source_rank(reg.decode_rank)))

    # ------------------------------------------------------------------ cancellation

    def cancel_push(self, peer: Peer, msg: pp.CancelPush, ranks: list[Rank]) -> None:
        """D withdrew a registration. Answer once nothing more can land in its blocks.
        ``ranks`` are this daemon's ranks of that number, the current one first."""
        if not ranks:
            # No such rank (its worker left and the rank was released): nothing of ours
            # can write into D's blocks, and D waits for our word, so it gets it.
            self._metrics.malformed.labels("side_channel", "unknown_cancel").inc()
            self._peers.send(peer, pp.PushCancelled(request_id=msg.request_id, rank=msg.rank,
                                                    source_rank=msg.source_rank))
            return
        # A PUSH_REG already queued in the agent is read first; one still on the wire
        # meets the tombstone ``cancel_registration`` leaves.
        self._drain(ranks[0])
        now = self._now()
        match = None
        for rank in ranks:
            state = self._of(rank)
            match = state.table.cancel_registration(peer.engine_id, msg.request_id, now)
            if match is not None:
                break
        log.info("push_cancelled", remote_request_id=msg.request_id, peer=peer.engine_id, writing=match is not None)
        if match is not None:
            write = state.writes.get(match.request_id)
            if write is not None:
                write.cancelled = True  # acknowledged in _settle
                return
            # Matched, handshake still running: nothing posted yet.
            self._fail_push(rank, match, None, "cancelled", "D withdrew the registration", notify_remote=False)
        self._peers.send(peer, pp.PushCancelled(request_id=msg.request_id, rank=msg.rank, source_rank=msg.source_rank))

    def _ack_cancel(self, rank: Rank, registration: Registration) -> None:
        peer = self._peers.find_agent(registration.sender) or self._peers.find_engine(registration.reg.decode_engine_id)
        if peer is not None:
            self._peers.send(peer, pp.PushCancelled(request_id=registration.request_id,
                                                    rank=registration.reg.decode_rank,
                                                    source_rank=rank.source_rank(registration.reg.decode_rank)))

    def refuse_registrations(self, rank: Rank, reason: str) -> None:
        """Drop the registrations ``rank`` holds unmatched and tell each D now."""
        state = self._ranks.get(rank)
        if state is None:
            return
        for registration in state.table.drop_registrations_from({r.sender for r in state.table.registrations.values()}):
            peer = self._peers.find_agent(registration.sender)
            if peer is not None:
                self._tell_d(rank, peer, registration.reg, reason)

    # ------------------------------------------------------------------ peers, timers

    def peer_down(self, peer: Peer) -> set[str]:
        """Forget the registrations of ``peer``'s agents; return the remote agents that
        WRITEs still target (they stay loaded until those settle)."""
        names = set(peer.agents)
        busy: set[str] = set()
        self.intake.drop_unverified(peer, math.inf)  # its unverified registrations go as well
        for rank, state in self._ranks.items():
            for registration in state.table.drop_registrations_from(names):
                self._metrics.failures.labels("peer_lost").inc()
                log.info("registration_dropped", request_id=registration.request_id, peer=peer.engine_id,
                         reason="peer down")
            held = [rid for rid, w in state.writes.items() if w.remote_agent in names]
            if held:
                # NIXL cannot recall a posted WRITE (releasing the handle does not cancel a
                # UCX put), so these blocks stay leased until NIXL settles the WRITE: at
                # once if the peer died, when it resumes if it was only stopped.
                log.warning("writes_held", peer=peer.engine_id, rank=rank.number, writes=len(held),
                            request_ids=held[:8])
            busy |= {w.remote_agent for w in state.writes.values()}
        return busy

    def expire(self, now: float) -> None:
        for rank, state in self._ranks.items():
            for exp in state.table.expire(now):
                if exp.kind is ExpiryKind.LEASE:
                    self._metrics.leases_expired.inc()
                    log.warning("lease_expired", request_id=exp.request_id, rank=rank.number)
                    self._outbox.tell(rank, wp.SendFailed(request_id=exp.request_id, reason=exp.reason))
                else:
                    self._metrics.failures.labels("registration_expired").inc()
                    log.info("registration_expired", request_id=exp.request_id, peer=exp.sender, reason=exp.reason)

    # ------------------------------------------------------------------ views

    def writes_to(self, rank: Rank) -> set[str]:
        state = self._ranks.get(rank)
        return {w.remote_agent for w in state.writes.values()} if state else set()

    def settled(self, rank: Rank) -> bool:
        """Nothing reads ``rank``'s memory any more: no WRITE posted, and no staging copy
        (it reads the worker's blocks into the staging buffer) or WRITE holds staging slots."""
        return not self.writes_to(rank) and not self.staging.busy(rank)

    def busy(self, rank: Rank) -> bool:
        state = self._ranks.get(rank)
        return ((state is not None and (bool(state.writes) or state.table.busy)) or self.staging.busy(rank)
                or self.layerwise.busy(rank))

    def hot(self, rank: Rank, now: float, hot_max_s: float) -> bool:
        """A WRITE from this rank's memory is moving (for at most ``hot_max_s``), or a
        registration D announced (``RegSent``) is on its way to staged blocks."""
        state = self._ranks.get(rank)
        # A layer-wise WRITE whose later layers are still being computed is not hot: the
        # worker computing them needs the cores more than its posted layers need progress.
        return (state is not None and (any(now - w.posted_at < hot_max_s for w in state.writes.values()
                                           if not w.waiting_for_layers)
                                       or any(until > now and rid in state.table.staged
                                              for rid, until in state.expected.items()))
                or self.staging.hot(rank) or self.layerwise.hot(rank, now, hot_max_s))

    def writes_in_flight(self) -> int:
        return sum(len(s.writes) for s in self._ranks.values())

    def sizes(self, rank: Rank) -> dict[str, int]:
        state = self._ranks.get(rank)
        sizes = state.table.sizes() if state else {"p_registrations": 0, "p_staged": 0, "p_writing": 0}
        return {**sizes, "inflight": len(state.writes) if state else 0}

    def abandon(self, rank: Rank, reason: str) -> None:
        """The daemon stops with ``rank``'s agent closed: report what is still tracked."""
        state = self._ranks.get(rank)
        self.staging.abandon(rank)
        for rid in [*state.table.staged, *state.table.writing] if state is not None else ():
            self._outbox.tell(rank, wp.SendFailed(request_id=rid, reason=reason))

    def forget(self, rank: Rank) -> None:
        """``rank`` is being closed: release the handles of WRITEs still posted (only at
        shutdown, after the drain, can any be left)."""
        self.layerwise.forget(rank)
        state = self._ranks.pop(rank, None)
        for write in state.writes.values() if state else ():
            release_all(rank.agent, write)
        self.staging.forget(rank)

    def __repr__(self) -> str:
        return f"<Sender ranks={len(self._ranks)} writes={self.writes_in_flight()}>"
