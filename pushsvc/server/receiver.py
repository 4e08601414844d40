"""D's side: registrations out (PUSH_REG), completions in, withdrawals settled.

One ``ConsumerTable`` per ``Rank``. A registration's PUSH_REG goes out through the
``Registrar`` (``registrar.py``): at once where P's daemon is known, else after a
handshake in a task of its own, so no other request waits behind it. The blocks of a
registration P may be writing into are reported (``RecvFailed``) only once no WRITE can
land in them: P confirmed, the WRITE's completion came, P is known dead, or P has been
lost for the grace (``state/consumer.py``).

An empty registration only releases P's blocks (D's request ended before it was ever
scheduled): its PUSH_REG goes out and nothing is tracked, nobody waits for an answer.

A rank whose KV is on a GPU lands WRITEs in a buffer of its own (``landing.py``): a
registration first takes landing slots (and may wait for them), its PUSH_REG names the
slots, each landed part is copied into the worker's blocks, and every final event goes
through ``_settle``, which holds it until no copy into the request's blocks is in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import structlog

from pushsvc.config import Config
from pushsvc.errors import LayoutError, ProtocolError
from pushsvc.metrics import Metrics
from pushsvc.protocol import notif
from pushsvc.protocol import peer as pp
from pushsvc.protocol import worker as wp
from pushsvc.server.gathering import Gatherer
from pushsvc.server.joints import Joint, Joints
from pushsvc.server.landing import Action, Landing, PartOutcome
from pushsvc.server.outbox import Outbox
from pushsvc.server.peers import Peer, PeerLink
from pushsvc.server.ranks import Rank
from pushsvc.server.registrar import Identity, Registrar
from pushsvc.server.tasks import TaskSet
from pushsvc.server.timelines import Timelines
from pushsvc.server.verify import count_mismatches, digest_memory
from pushsvc.state.consumer import (
    CANCELLED,
    CompletionOutcome,
    ConsumerTable,
    EvictOutcome,
    ExpiryAction,
    PendingRecv,
    RecvExpiry,
    RecvState,
    Remote,
    SourceOutcome,
    flat,
)
from pushsvc.state import tp
from pushsvc.state.landing import AllocOutcome
from pushsvc.state.layout import (Layout, check_block_ids, descriptor_table, dest_indices, names_no_block,
                                   source_view)
from pushsvc.state.stages import LayerKey, keys, stage_view
from pushsvc.state.timeline import RECV

log = structlog.get_logger("pushsvc.receiver")


@dataclass(frozen=True, slots=True)
class ReceiveSettings:
    engine_id: str
    daemon_id: str
    advertised_host: str
    watchdog_s: float
    peer_timeout_s: float  # the grace a lost P's WRITEs get, and the wait for late digests
    verify: bool

    @classmethod
    def of(cls, config: Config, daemon_id: str) -> ReceiveSettings:
        return cls(config.engine_id, daemon_id, config.advertised_host, config.watchdog_s, config.peer_timeout_s,
                   config.verify)


class Receiver:
    def __init__(self, *, settings: ReceiveSettings, outbox: Outbox, peers: PeerLink, metrics: Metrics,
                 tasks: TaskSet, wake: Callable[[], None], timelines: Timelines, joints: Joints) -> None:
        self._settings = settings
        self._joints = joints  # D TP above P's: registrations gathered over a joint's members
        self._timelines = timelines
        self._outbox = outbox
        self._peers = peers
        self._metrics = metrics
        self._wake = wake
        self._tables: dict[Rank, ConsumerTable] = {}
        # Verify mode: each source's descriptors of a rank's blocks (a rank's memory is
        # registered once; ``forget`` drops them with the rank).
        self._views: dict[tuple[Rank, int, int, tuple[LayerKey, ...] | None], tuple[Layout, np.ndarray]] = {}
        self.landing = Landing(metrics=metrics, now=self._now, granted=self._granted)
        self._registrar = Registrar(
            identity=Identity(settings.engine_id, settings.daemon_id, settings.advertised_host), peers=peers,
            tasks=tasks, landing=self.landing, timelines=timelines, table=self._of, fail=self._fail,
            withdraw=self._withdraw, wake=wake)
        self._gatherer = Gatherer(
            joints=joints, outbox=outbox, metrics=metrics, table=self._of, now=self._now,
            watchdog_s=settings.watchdog_s, held=self._held, register=lambda joint, msg: self.on_register_recv(
                joint, msg, []), release=self._release)

    def _of(self, rank: Rank) -> ConsumerTable:
        table = self._tables.get(rank)
        if table is None:
            s = self._settings
            table = self._tables[rank] = ConsumerTable(watchdog_s=s.watchdog_s, cancel_grace_s=s.peer_timeout_s,
                                                       digest_wait_s=s.peer_timeout_s, verify=s.verify)
        return table

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    # ------------------------------------------------------------------ from the worker

    def on_register_recv(self, rank: Rank, msg: wp.RegisterRecv, predecessors: list[Rank]) -> None:
        """``predecessors``: retiring ranks of the same worker process, whose blocks are
        this rank's blocks too."""
        if msg.remote_tp_size < rank.tp_size and not isinstance(rank, Joint):
            self._gatherer.join(rank, msg, predecessors)
            return
        rid = msg.request_id
        table = self._of(rank)
        bound = log.bind(request_id=rid, rank=rank.number, peer=msg.remote_engine_id)
        if table.tracks(rid) or (not isinstance(rank, Joint) and self._gatherer.joined(rank, rid)):
            # Checked before the blocks: a refusal would answer RecvFailed for the
            # live request, and its worker would reuse blocks P may still write into.
            self._metrics.duplicates.labels("registration").inc()
            bound.info("recv_duplicate")
            return
        reason = self._refusal(rank, msg, predecessors)
        if reason:
            self._metrics.malformed.labels("worker", "registration").inc()
            bound.warning("recv_rejected", phase="register", error=reason)
            self._outbox.tell(rank, wp.RecvFailed(request_id=rid, block_ids=flat(msg.local_block_ids), reason=reason))
            return
        remote = Remote(msg.remote_engine_id, msg.remote_host, msg.remote_port, msg.remote_tp_size)
        if names_no_block(msg.local_block_ids):
            self._release(rank, msg, remote)
            return
        entry = table.add(rid, msg.local_block_ids, remote, self._now(), msg.match_key)
        assert entry is not None  # duplicates were answered above
        self._timelines.open(rank, RECV, rid, "registered")
        entry.ipc = self._ipc(rank, remote)
        if self.landing.active(rank) and not entry.ipc:
            outcome, why = self.landing.reserve(rank, rid, msg.local_block_ids)
            if outcome is AllocOutcome.TOO_LARGE:
                self._fail(rank, rid, "landing_too_small", why)
                self._release(rank, msg, remote)  # P frees its blocks now, not at its lease
                return
            if outcome is AllocOutcome.QUEUED:
                self._wake()
                return  # its PUSH_REG goes out when ``_granted`` hears of its slots
        self._registrar.dispatch(rank, entry)

    def _ipc(self, rank: Rank, remote: Remote) -> bool:
        """Whether P copies this registration into the worker's blocks itself (same-host
        push): P said it mapped this rank's KV, on the live session, at equal TP."""
        peer = self._peers.find_engine(remote.engine_id)
        return (peer is not None and rank.agent.name in peer.ipc_ready and remote.tp_size == rank.tp_size
                and not isinstance(rank, Joint))

    def _granted(self, rank: Rank, rid: str, waited_s: float) -> None:
        """A registration that waited for landing space has its slots now."""
        entry = self._of(rank).pending.get(rid)
        if entry is None or entry.state is not RecvState.PENDING:
            return
        self._metrics.landing_wait_seconds.observe(waited_s)
        self._timelines.mark(rank, RECV, rid, "landing_granted")
        log.info("landing_granted", request_id=rid, rank=rank.number, waited_s=round(waited_s, 6))
        self._registrar.dispatch(rank, entry)

    def _refusal(self, rank: Rank, msg: wp.RegisterRecv, predecessors: list[Rank]) -> str:
        if rank.memory is None:
            return "no KV memory registered for this rank"
        mismatch = self._tp_refusal(rank, msg.remote_tp_size)
        if mismatch:
            return mismatch
        try:
            check_block_ids(rank.memory.layout, msg.local_block_ids, "registration")
        except LayoutError as exc:
            return str(exc)
        # A joint's blocks are its members' blocks: a registration of one of them holds them too.
        held = self._held(msg.local_block_ids, [rank, *predecessors, *(rank.members if isinstance(rank, Joint)
                                                                       else ())])
        if held:
            return held
        if self.landing.tracks(rank, msg.request_id):
            return "registration: the request id's previous registration is still landing"
        return ""

    def _held(self, block_ids: list[list[int]], ranks: list[Rank]) -> str:
        """Whether a registration of ``ranks`` or of a joint they are members of holds a
        block of ``block_ids`` (the same worker's blocks either way)."""
        for r in [*ranks, *(j for r in ranks for j in self._joints.containing(r))]:
            held = self._of(r).holder(block_ids) or self.landing.holder(r, block_ids)
            if held is not None:
                return f"registration: block {held[0]} is held by live request {held[1]}"
        return ""

    def joint_retired(self, joint: Joint, reason: str = f"{CANCELLED}: D's ranks changed while it was registered"
                      ) -> None:
        """``joint`` will not be registered with again (a member retired, or the daemon
        stops): what it was still gathering ends, and its members hear ``reason``."""
        self._gatherer.retired(joint, reason)

    def _tp_refusal(self, rank: Rank, p_tp: int) -> str:
        """Why this rank cannot take KV from a P of TP ``p_tp``, or ''. With P TP = k x D
        TP each P rank fills a head slice of D's blocks: every region must be head-major
        with heads that split by k (or all of it replicated, MLA: one P rank writes it
        whole), and nothing lands in a GPU landing buffer."""
        why = tp.refusal(p_tp, rank.tp_size)
        k = tp.ratio(p_tp, rank.tp_size) if not why else 1
        if why or k == 1:
            return why
        if self.landing.active(rank):
            return f"P TP {p_tp} -> D TP {rank.tp_size}: a GPU landing buffer takes KV from one P rank only"
        assert rank.memory is not None
        try:  # MLA: one P rank writes it whole, the others free their blocks
            source_view(rank.memory.layout, k, 0)
        except LayoutError as exc:
            return f"P TP {p_tp} -> D TP {rank.tp_size}: {exc}"
        return ""

    def _release(self, rank: Rank, msg: wp.RegisterRecv, remote: Remote) -> None:
        self._registrar.release(rank, PendingRecv(msg.request_id, [], remote, self._now(), None, msg.match_key))

    def evict(self, ranks: list[Rank], rid: str) -> None:
        """The worker withdrew ``rid`` (from any of its ranks: a reconnected worker
        withdraws what it registered on its old connection too). Its blocks are given
        back once P can no longer write into them."""
        if self._gatherer.withdrawn(ranks, rid):
            return
        for rank in [*ranks, *self._gatherer.of(ranks)]:
            table = self._tables.get(rank)
            entry = table.pending.get(rid) if table is not None else None
            if entry is None:
                continue
            outcome, entry = table.evict(rid, self._now(), entry.p_daemon in self._peers.live_daemons())
            if entry is None:
                return
            log.info("recv_cancelled", request_id=rid, rank=rank.number, peer=entry.remote.engine_id,
                     waiting_for_p=outcome is not EvictOutcome.FINAL, outcome=outcome.value)
            if outcome is EvictOutcome.FINAL:
                self._tell_final(rank, wp.RecvFailed(request_id=rid, block_ids=entry.flat_block_ids,
                                                     reason="cancelled"))
            elif outcome is EvictOutcome.CANCEL:
                self._request_cancel(rank, entry)
            return

    def _withdraw(self, rank: Rank, rid: str, reason: str) -> None:
        """The daemon gives up on ``rid`` after some of P's ranks got its PUSH_REG: they
        are asked to cancel, and the worker hears ``reason`` once none can write."""
        table = self._of(rank)
        entry = table.pending.get(rid)
        if entry is None:
            return
        outcome, entry = table.evict(rid, self._now(), entry.p_daemon in self._peers.live_daemons(), reason)
        if entry is None:
            return
        self._metrics.failures.labels(reason.split(":", 1)[0]).inc()
        log.warning("recv_failed", request_id=rid, rank=rank.number, peer=entry.remote.engine_id, error=reason,
                    waiting_for_p=outcome is not EvictOutcome.FINAL)
        if outcome is EvictOutcome.FINAL:
            self._tell_final(rank, wp.RecvFailed(request_id=rid, block_ids=entry.flat_block_ids, reason=reason))
        elif outcome is EvictOutcome.CANCEL:
            self._request_cancel(rank, entry)

    def worker_detached(self, rank: Rank) -> None:
        """The worker's connection closed. Its registrations are withdrawn; those P may
        be writing into stay held until P confirms (the same process may connect again
        and hear how they ended)."""
        table = self._tables.get(rank)
        for rid in list(table.pending) if table is not None else ():
            self.evict([rank], rid)
        for joint in self._gatherer.detached(rank):  # no joint registration can finish without it
            for rid in list(self._of(joint).pending):
                self.evict([joint], rid)

    # ------------------------------------------------------------------ from P

    def on_completion(self, rank: Rank, sender: str, payload: bytes) -> None:
        try:
            rid, _tp, index, parts = notif.decode_notification(payload)
        except ProtocolError as exc:
            self._malformed("notification", "completion", sender, exc)
            return
        table = self._of(rank)
        entry = table.pending.get(rid)
        if entry is not None and sender not in entry.sources:
            # Also every notification for a PENDING registration: no P has seen it yet (its
            # sources are named as its PUSH_REGs go out), so none of it may count or land.
            self._malformed("notification", "foreign_completion", sender,
                            ProtocolError("sender is not an agent the registration went to"))
            return
        if self.landing.tracks(rank, rid) and entry is not None:
            # Before its copy is launched; a timeline keeps an event's first time.
            self._timelines.mark(rank, RECV, rid, "first_part_landed")
            # Copied while a completion may still make the request done (held for a lost P
            # too); never into the blocks of a withdrawn one.
            landed = self.landing.part_landed(rank, rid, index, parts, copy=entry.may_finish)
            if landed is PartOutcome.MALFORMED:
                self._malformed("notification", "part", sender, ProtocolError(f"part {index} of {parts} again"))
                return
            if landed is PartOutcome.MORE:
                self._metrics.notifications.labels("part").inc()
                self._wake()
                return
        elif parts > 1:
            self._malformed("notification", "part", sender, ProtocolError("parts for a rank without landing"))
            return
        outcome, entry = table.on_completion(rid, sender, self._now())
        if outcome is CompletionOutcome.UNKNOWN or entry is None:
            self._metrics.notifications.labels("late_completion").inc()
            log.info("completion_ignored", request_id=rid, peer=sender, reason="unknown or late")
            return
        self._metrics.notifications.labels("completion").inc()
        self._timelines.mark(rank, RECV, rid, "completion")
        log.debug("completion", request_id=rid, peer=sender, outcome=outcome.value)
        if outcome is CompletionOutcome.CANCELLED:
            self._tell_final(rank, wp.RecvFailed(request_id=rid, block_ids=entry.flat_block_ids,
                                                 reason=table.final_reason(entry, settled=True)))
        elif outcome is CompletionOutcome.DONE:
            landed = entry
            self._settle(rank, rid, lambda error: self._done(rank, landed, error))
        elif outcome is CompletionOutcome.VERIFY:
            landed = entry
            self._settle(rank, rid, lambda error: self._verified(rank, landed, error))

    def write_started(self, peer: Peer, msg: pp.WriteStarted, ranks: list[Rank]) -> None:
        for rank in ranks:
            table = self._tables.get(rank)
            if table is None or table.sent_by(msg.request_id, peer.daemon_id) is None:
                continue
            self._timelines.mark(rank, RECV, msg.request_id, "write_announced")
            landed = table.announce(msg.request_id, peer.daemon_id, pp.source_rank(msg), msg.digests, self._now())
            if landed is not None:  # the completion overtook the digests
                self._settle(rank, msg.request_id, lambda error: self._verified(rank, landed, error))
            else:
                log.debug("write_announced", request_id=msg.request_id, peer=peer.engine_id, bytes=msg.nbytes)
                self._wake()
            return

    def push_failed(self, peer: Peer, msg: pp.PushFailed, ranks: list[Rank]) -> None:
        """P rank ``source_rank`` cannot write. The request fails; where other P ranks
        write into it too, only once they confirmed (or completed)."""
        rid, kind = msg.request_id, "push_failed_remote"
        for rank in ranks:
            table = self._tables.get(rank)
            held = table.sent_by(rid, peer.daemon_id) if table is not None else None
            if table is None or held is None:
                continue
            withdrawn = held.state is RecvState.CANCELLING  # failed or withdrawn before: counted then
            outcome, entry = table.source_failed(rid, peer.daemon_id, pp.source_rank(msg), f"{kind}: {msg.reason}",
                                                 self._now(), peer.daemon_id in self._peers.live_daemons())
            if entry is None:
                break
            if not withdrawn:
                self._metrics.failures.labels(kind).inc()
            log.warning("recv_failed", request_id=rid, rank=rank.number, peer=entry.remote.engine_id, kind=kind,
                        error=msg.reason, source_rank=pp.source_rank(msg), waiting_for_p=bool(entry.open))
            if outcome is SourceOutcome.FINAL:
                # Withdrawn before (by the worker, the watchdog, another source's failure):
                # it ends for that reason, now that no source can write.
                reason = (table.final_reason(entry, settled=True) if entry.state is RecvState.CANCELLING
                          else f"{kind}: {msg.reason}")
                self._tell_final(rank, wp.RecvFailed(request_id=rid, block_ids=entry.flat_block_ids, reason=reason))
            elif outcome is SourceOutcome.CANCEL:
                self._request_cancel(rank, entry)
            return
        self._metrics.malformed.labels("side_channel", "unknown_push_failed").inc()

    def push_cancelled(self, peer: Peer, msg: pp.PushCancelled, ranks: list[Rank]) -> None:
        for rank in ranks:
            table = self._tables.get(rank)
            if table is None or table.sent_by(msg.request_id, peer.daemon_id) is None:
                continue
            entry = table.source_cancelled(msg.request_id, peer.daemon_id, pp.source_rank(msg))
            if entry is not None:  # the last source that could write confirmed
                self._tell_final(rank, wp.RecvFailed(request_id=msg.request_id, block_ids=entry.flat_block_ids,
                                                     reason=table.final_reason(entry, settled=True)))
            return

    # ------------------------------------------------------------------ endings

    def _settle(self, rank: Rank, rid: str, action: Action) -> None:
        """``rid`` is final: ``action`` tells the worker, once no copy into its blocks is in
        flight (at once where nothing is landing for it)."""
        if self.landing.tracks(rank, rid):
            def after_copies(error: str) -> None:
                self._timelines.mark(rank, RECV, rid, "copies_done")
                action(error)

            self.landing.finish(rank, rid, after_copies)
        else:
            action("")

    def _tell_final(self, rank: Rank, event: wp.RecvFailed) -> None:
        self._settle(rank, event.request_id, lambda _error: self._outbox.tell(rank, event))

    def _done(self, rank: Rank, entry: PendingRecv, copy_error: str = "") -> None:
        if copy_error:
            self._copy_failed(rank, entry, copy_error)
            return
        self._metrics.recv_seconds.observe(self._now() - entry.registered_at)
        log.debug("recv_done", request_id=entry.request_id, rank=rank.number)
        self._outbox.tell(rank, wp.RecvDone(request_id=entry.request_id))

    def _copy_failed(self, rank: Rank, entry: PendingRecv, error: str) -> None:
        self._metrics.failures.labels("landing_copy").inc()
        log.error("recv_failed", request_id=entry.request_id, rank=rank.number, kind="landing_copy", error=error)
        self._outbox.tell(rank, wp.RecvFailed(request_id=entry.request_id, block_ids=entry.flat_block_ids,
                                              reason=f"landing_copy: {error}"))

    def _verified(self, rank: Rank, entry: PendingRecv, copy_error: str = "") -> None:
        """Every WRITE landed and P's digests are here: compare D's blocks with them."""
        if copy_error:
            self._copy_failed(rank, entry, copy_error)
            return
        error = self._verify(rank, entry)
        if not error:
            self._done(rank, entry)
            return
        self._metrics.failures.labels("verify").inc()
        log.error("verify_failed", request_id=entry.request_id, rank=rank.number, peer=entry.remote.engine_id,
                  error=error)
        self._outbox.tell(rank, wp.RecvFailed(request_id=entry.request_id, block_ids=entry.flat_block_ids,
                                              reason=f"verify: {error}"))

    def _verify(self, rank: Rank, entry: PendingRecv) -> str:
        """'' if D's blocks equal P's, else what is wrong: each source's digests against
        the part of D's blocks it wrote (all of them, or its head slice)."""
        if not all(entry.digests.get(a) for a in entry.sources):
            self._metrics.verified.labels("missing").inc()
            return "P sent no digests (is P's daemon running with verify on?)"
        assert rank.memory is not None
        memory = rank.memory
        k = tp.ratio(entry.remote.tp_size, rank.tp_size)
        bad = total = 0
        for agent, source in entry.sources.items():
            view, descs = self._source_descs(rank, k, source % k, entry.layers.get(agent))
            actual = digest_memory(descs, dest_indices(view, entry.block_ids), memory.vram)
            bad += count_mismatches(entry.digests[agent], actual)
            total += len(actual) // 8
        self._metrics.verified_blocks.labels("mismatch").inc(bad)
        self._metrics.verified_blocks.labels("identical").inc(max(0, total - bad))
        self._metrics.verified.labels("mismatch" if bad else "identical").inc()
        return f"{bad} of {total} blocks differ from P's" if bad else ""

    def _source_descs(self, rank: Rank, parts: int, index: int,
                      layers: tuple[LayerKey, ...] | None) -> tuple[Layout, np.ndarray]:
        """What the ``index``-th of ``parts`` sources writes of ``rank``'s blocks
        (``layout.source_view``; of a pipeline stage whose regions hold ``layers``, only
        the regions of those layers) and its descriptors, built once per rank's memory."""
        memory = rank.memory
        assert memory is not None
        key = (rank, parts, index, layers)
        kept = self._views.get(key)
        if kept is None:
            layout = memory.layout
            if layers is not None:
                members = len(rank.members) if isinstance(rank, Joint) else 1
                layout = stage_view(layout, keys(r.layer_names for r in memory.regions), layers * members)
            view = source_view(layout, parts, index)
            kept = self._views[key] = (view, memory.descs if view is memory.layout else descriptor_table(view))
        return kept

    def _fail(self, rank: Rank, rid: str, kind: str, reason: str) -> None:
        entry = self._of(rank).fail(rid)
        if entry is None:
            return
        self._metrics.failures.labels(kind).inc()
        log.warning("recv_failed", request_id=rid, rank=rank.number, peer=entry.remote.engine_id, kind=kind,
                    error=reason)
        self._tell_final(rank, wp.RecvFailed(request_id=rid, block_ids=entry.flat_block_ids,
                                             reason=f"{kind}: {reason}"))

    def _final(self, rank: Rank, exp: RecvExpiry) -> None:
        entry = exp.entry
        self._metrics.failures.labels(exp.kind).inc()
        if exp.kind == "watchdog":
            self._metrics.watchdog_expired.inc()
        if exp.kind == "verify":
            self._metrics.verified.labels("missing").inc()
        log.warning("recv_failed", request_id=entry.request_id, rank=rank.number, peer=entry.remote.engine_id,
                    kind=exp.kind, error=exp.reason)
        self._tell_final(rank, wp.RecvFailed(request_id=entry.request_id, block_ids=entry.flat_block_ids,
                                             reason=exp.reason))

    def _request_cancel(self, rank: Rank, entry: PendingRecv) -> None:
        """Ask each source that may still write to cancel (one ``CancelPush`` per P rank)."""
        peer = self._peers.find_engine(entry.remote.engine_id)
        sent = peer is not None and peer.daemon_id == entry.p_daemon and all([
            self._peers.send(peer, pp.CancelPush(request_id=entry.request_id, rank=rank.number,
                                                 source_rank=p_rank if p_rank != rank.number else -1))
            for p_rank in sorted(entry.sources[a] for a in entry.open)])
        if not sent:
            # P cannot confirm, but a WRITE it posted may still land: the blocks stay
            # held until P's loss is noticed and its grace ends (or the WRITE completes).
            log.warning("cancel_unsent", request_id=entry.request_id, rank=rank.number, peer=entry.remote.engine_id,
                        reason="P daemon unreachable")

    # ------------------------------------------------------------------ peers, timers

    def expire(self, now: float) -> None:
        self._gatherer.expire(now)
        live = self._peers.live_daemons()
        for rank, table in list(self._tables.items()):
            for exp in table.expire(now, live):
                entry = exp.entry
                if exp.action is ExpiryAction.FAIL:
                    self._final(rank, exp)
                    continue
                self._metrics.watchdog_expired.inc()
                log.warning("watchdog_expired", request_id=entry.request_id, rank=rank.number,
                            peer=entry.remote.engine_id, phase="cancelling", waiting_for_p=True)
                if exp.action is ExpiryAction.CANCEL:
                    self._request_cancel(rank, entry)

    def peer_up(self, peer: Peer) -> None:
        """A lost P incarnation is back: it dropped what it held for us, so the
        registrations held for it are cancelled (and freed once it confirms)."""
        for rank, table in self._tables.items():
            for entry in table.peer_back(peer.daemon_id):
                self._request_cancel(rank, entry)

    def peer_down(self, peer: Peer) -> None:
        now = self._now()
        for rank, table in self._tables.items():
            # A P known dead writes nothing more; one that went silent or closed may
            # still have a WRITE on the way, so its blocks are held until the WRITE's
            # completion or the grace, never handed back while bytes may land.
            for entry in table.peer_lost(peer.daemon_id, now):
                log.warning("recv_held_for_lost_peer", request_id=entry.request_id, rank=rank.number,
                            peer=peer.engine_id, until_s=round((entry.deadline or now) - now, 3))
        if peer.gone:
            self.peer_gone(peer)

    def peer_gone(self, peer: Peer) -> None:
        """The P incarnation D held blocks for is dead: no WRITE of it can land now."""
        for rank, table in self._tables.items():
            for exp in table.peer_gone(peer.daemon_id):
                self._final(rank, exp)

    # ------------------------------------------------------------------ views

    def settled(self, rank: Rank) -> bool:
        """Nothing can land in or be copied into ``rank``'s memory any more."""
        table = self._tables.get(rank)
        return (table is None or not table.unsettled) and not self.landing.busy(rank)

    def unsettled(self) -> int:
        """Registrations P may still write into, over every rank."""
        return sum(1 for t in self._tables.values() for e in t.pending.values()
                   if e.state in (RecvState.SENT, RecvState.CANCELLING))

    def busy(self, rank: Rank) -> bool:
        table = self._tables.get(rank)
        return (table is not None and table.busy) or self.landing.busy(rank)

    def hot(self, rank: Rank, now: float, hot_max_s: float) -> bool:
        """A WRITE into ``rank`` is moving, or a copy into its worker's KV."""
        table = self._tables.get(rank)
        return (table is not None and table.hot(now, hot_max_s)) or self.landing.hot(rank)

    def sizes(self, rank: Rank) -> dict[str, int]:
        table = self._tables.get(rank)
        return table.sizes() if table is not None else {"d_pending": 0}

    def empty(self, rank: Rank) -> bool:
        table = self._tables.get(rank)
        return table is None or not table.pending

    def abandon(self, rank: Rank, reason: str) -> None:
        """The daemon stops with ``rank``'s agent closed (nothing can land any more):
        report every registration still tracked, once the copies into its blocks are done."""
        self.landing.abandon(rank)
        table = self._tables.get(rank)
        for rid in list(table.pending) if table is not None else ():
            entry = table.fail(rid)
            if entry is not None:
                self._tell_final(rank, wp.RecvFailed(request_id=rid, block_ids=entry.flat_block_ids, reason=reason))

    def poll(self) -> None:
        """Copies into workers' KV that finished release the events they held."""
        self.landing.poll()

    def forget(self, rank: Rank) -> None:
        self._tables.pop(rank, None)
        for key in [key for key in self._views if key[0] is rank]:
            del self._views[key]
        self.landing.forget(rank)

    def _malformed(self, source: str, reason: str, sender: str, exc: Exception) -> None:
        self._metrics.malformed.labels(source, reason).inc()
        log.warning("malformed_input", source=source, reason=reason, peer=sender, error=str(exc)[:200])

    def __repr__(self) -> str:
        return f"<Receiver ranks={len(self._tables)} unsettled={self.unsettled()}>"
