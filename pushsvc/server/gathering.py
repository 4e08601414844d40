"""D TP above P's: the members' registrations of a request, gathered into their joint's.

Each of a joint's ``k`` members (``joints.py``) registers the request from its own
worker; the joint's registration goes out, through the Receiver, once all ``k`` did with
the same blocks and the same P. Until then the request lives only here, in the joint's
``gathering``: a member withdrawing it, members that disagree, a member's worker leaving,
the joint retiring or a member that never registers within the watchdog end the
gathering, and every member that registered hears ``RecvFailed``; one that registers it
later hears the same at once (``Joint.ended``). Part of D's side (``receiver.py``), which
owns the tables.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from pushsvc.errors import LayoutError
from pushsvc.metrics import Metrics
from pushsvc.protocol import worker as wp
from pushsvc.server.joints import Gather, Joint, Joints
from pushsvc.server.outbox import Outbox
from pushsvc.server.ranks import Rank
from pushsvc.state.consumer import CANCELLED, ConsumerTable, Remote, flat
from pushsvc.state.layout import check_block_ids, names_no_block

log = structlog.get_logger("pushsvc.receiver")


class Gatherer:
    def __init__(self, *, joints: Joints, outbox: Outbox, metrics: Metrics, table: Callable[[Rank], ConsumerTable],
                 now: Callable[[], float], watchdog_s: float, held: Callable[[list[list[int]], list[Rank]], str],
                 register: Callable[[Joint, wp.RegisterRecv], None],
                 release: Callable[[Joint, wp.RegisterRecv, Remote], None]) -> None:
        self._joints = joints
        self._outbox = outbox
        self._metrics = metrics
        self._table = table  # a rank's (or joint's) ConsumerTable
        self._now = now
        self._watchdog_s = watchdog_s
        self._held = held  # why a registration of those ranks holds one of these blocks, or ''
        self._register = register  # the joint's registration, once every member's came
        self._release = release  # a release of P's blocks, sent through the joint

    def join(self, rank: Rank, msg: wp.RegisterRecv, predecessors: list[Rank]) -> None:
        """A member's registration for a P of lower TP: gathered until every member of
        its joint registered it, then the joint's goes out."""
        rid = msg.request_id
        bound = log.bind(request_id=rid, rank=rank.number, peer=msg.remote_engine_id)
        joint, why = self._joints.for_rank(rank, msg.remote_tp_size)
        gather, index = None, 0
        if joint is not None:
            index = joint.index_of(rank)
            gather = joint.gathering.get(rid)
            if self._table(rank).tracks(rid) or self._table(joint).tracks(rid) or (
                    gather is not None and index in gather.parts):
                self._metrics.duplicates.labels("registration").inc()
                bound.info("recv_duplicate")
                return
            ended = joint.late(rid, index, self._now(), self._watchdog_s)
            if ended:  # the others' registrations ended before this one came
                bound.info("recv_failed", kind="joint_ended", error=ended)
                self._outbox.tell(rank, wp.RecvFailed(request_id=rid, block_ids=flat(msg.local_block_ids),
                                                      reason=ended))
                return
        if names_no_block(msg.local_block_ids):  # a release: the first member's goes out through the joint
            if joint is not None and index == 0:
                self._release(joint, msg, Remote(msg.remote_engine_id, msg.remote_host, msg.remote_port,
                                                 msg.remote_tp_size))
            return
        if joint is None:
            reason = why
        elif rank.memory is None:
            reason = "no KV memory registered for this rank"
        else:
            try:
                check_block_ids(rank.memory.layout, msg.local_block_ids, "registration")
                reason = self._held(msg.local_block_ids, [rank, *predecessors])
            except LayoutError as exc:
                reason = str(exc)
            if not reason and gather is not None:
                reason = gather.disagreement(msg)
        if reason:
            self._metrics.malformed.labels("worker", "registration").inc()
            bound.warning("recv_rejected", phase="register", error=reason)
            self._outbox.tell(rank, wp.RecvFailed(request_id=rid, block_ids=flat(msg.local_block_ids), reason=reason))
            if joint is not None and gather is not None:
                self.end(joint, rid, "joint_refused", f"{reason} (D rank {rank.number})", also={index})
            elif joint is not None:
                joint.end(rid, self._now(), f"{reason} (D rank {rank.number})", {index})
            return
        assert joint is not None
        gather = joint.gathering.setdefault(rid, Gather(self._now()))
        gather.parts[index] = msg
        if len(gather.parts) == len(joint.members):
            del joint.gathering[rid]
            bound.debug("recv_joined", joint=joint.number, members=len(joint.members))
            self._register(joint, msg)

    def end(self, joint: Joint, rid: str, kind: str, reason: str, also: set[int] | None = None) -> None:
        """End ``rid``'s gathering: every member that registered it hears ``reason`` (and
        those to register it later, at once); counted as a failure of ``kind``. ``also``:
        members told already."""
        gather = joint.gathering.pop(rid, None)
        if gather is None:
            return
        joint.end(rid, self._now(), reason, set(gather.parts) | (also or set()))
        self._metrics.failures.labels(kind).inc()
        log.warning("recv_failed", request_id=rid, joint=joint.number, kind=kind, error=reason,
                    registered=sorted(joint.members[i].number for i in gather.parts))
        for index, msg in gather.parts.items():
            self._outbox.tell(joint.members[index], wp.RecvFailed(
                request_id=rid, block_ids=flat(msg.local_block_ids), reason=reason))

    def joined(self, rank: Rank, rid: str) -> bool:
        """``rank`` registered ``rid`` for a joint: it is gathering or tracked there."""
        return any(rid in j.gathering or self._table(j).tracks(rid) for j in self._joints.containing(rank))

    def of(self, ranks: list[Rank]) -> list[Joint]:
        """The joints ``ranks`` are members of, each once."""
        return list(dict.fromkeys(j for r in ranks for j in self._joints.containing(r)))

    def withdrawn(self, ranks: list[Rank], rid: str) -> bool:
        """A member withdrew ``rid`` while it was gathering: the others' registrations can
        never be joined now, so the gathering ends (True)."""
        for joint in self.of(ranks):
            if rid in joint.gathering:
                self.end(joint, rid, CANCELLED, CANCELLED)
                return True
        return False

    def detached(self, rank: Rank) -> list[Joint]:
        """``rank``'s worker left: no joint registration can finish without it, so what
        its joints gather ends; returns those joints (their registrations are withdrawn
        by the caller)."""
        joints = self.of([rank])
        for joint in joints:
            self.retired(joint, f"{CANCELLED}: D rank {rank.number}'s worker disconnected")
        return joints

    def retired(self, joint: Joint, reason: str) -> None:
        """``joint`` will not be registered with again: what it was still gathering ends,
        and its members hear ``reason``."""
        for rid in list(joint.gathering):
            self.end(joint, rid, CANCELLED, reason)

    def expire(self, now: float) -> None:
        """End the gatherings some member did not register within the watchdog."""
        watchdog = self._watchdog_s
        for joint in self._joints.all():
            for rid in [r for r, g in joint.gathering.items() if now - g.started_at >= watchdog]:
                members = [m.number for m in joint.members]
                self.end(joint, rid, "watchdog", f"watchdog: D ranks {members} did not all register it within "
                                                 f"{watchdog}s")
