"""D's registrations as they reach P (``PUSH_REG``, over NIXL's notifications): decoded
within ``max_notif_bytes``, checked against what D's daemon announced of the sending agent
(its blocks, its TP), entered in the rank's ``ProducerTable``, and each outcome counted and
logged. A match goes to the push path (``start``), a registration P cannot serve is
refused to D at once (``tell_d``).

Composed into the ``Sender``. A registration from an agent P has not heard of yet (D's
``AgentsUpdate`` may be on its way) waits, unverified, and ``agents_known`` checks it when
the agent is announced; one from a departed agent is late by definition and releases the
P request it was for. P never writes for, nor dials, a registration it could not check.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import structlog

from pushsvc.errors import ProtocolError
from pushsvc.metrics import Metrics
from pushsvc.protocol import notif
from pushsvc.protocol import worker as wp
from pushsvc.server.outbox import Outbox
from pushsvc.server.peers import Peer, PeerLink
from pushsvc.server.ranks import Rank
from pushsvc.server.remotes import registration_error
from pushsvc.state.layout import id_arrays, names_no_block
from pushsvc.state.producer import Match, ProducerTable, Registration, RegOutcome, RegResult

log = structlog.get_logger("pushsvc.sender")


class Intake:
    def __init__(self, *, engine_id: str, max_notif_bytes: int, peers: PeerLink, metrics: Metrics, outbox: Outbox,
                 table: Callable[[Rank], ProducerTable], tables: Callable[[], list[tuple[Rank, ProducerTable]]],
                 start: Callable[[Rank, Match], None], released: Callable[[Rank, str, str], None],
                 tell_d: Callable[[Rank, Peer, notif.PushReg, str], None], now: Callable[[], float]) -> None:
        self._engine_id = engine_id
        self._max_notif_bytes = max_notif_bytes
        self._peers = peers
        self._metrics = metrics
        self._outbox = outbox
        self._table = table  # the rank's producer table (made on first use)
        self._tables = tables  # every rank's, as a list
        self._start = start  # push a match
        self._released = released  # D released P's request: nothing to write
        self._tell_d = tell_d  # PushFailed to D's daemon
        self._now = now

    def on_push_reg(self, rank: Rank, sender: str, payload: bytes) -> None:
        try:
            reg = notif.decode_push_reg(payload, self._max_notif_bytes)
        except ProtocolError as exc:
            self._malformed("push_reg", sender, exc)
            return
        if reg.remote_engine_id != self._engine_id:
            self._malformed("push_reg_wrong_engine", sender, ProtocolError(f"PUSH_REG for engine {reg.remote_engine_id}"))
            return
        peer = self._peers.find_agent(sender)
        if peer is None and self._peers.departed(sender):
            # From a D incarnation or worker that is gone, or a D we lost: late, and never
            # to be written (D holds those blocks only for its grace). P's blocks for it
            # will never be claimed either: released now rather than at the lease.
            self._malformed("push_reg_departed_agent", sender, ProtocolError(f"PUSH_REG from departed agent {sender}"))
            self._release_counterpart(rank, reg)
            return
        if peer is not None and not self._admitted(rank, peer, sender, reg):
            return
        self._metrics.notifications.labels("push_reg").inc()
        result = self._table(rank).add_registration(reg, sender, self._now(), verified=peer is not None)
        self._registered(rank, reg, sender, peer, result)

    def _release_counterpart(self, rank: Rank, reg: notif.PushReg) -> None:
        table = self._table(rank)
        staged = table.counterpart(reg)
        if staged is not None and table.evict(staged.request_id, self._now()) is not None:
            reason = "late_registration: D's registration came after the session to D was lost"
            log.warning("push_failed", request_id=staged.request_id, kind="late_registration", error=reason)
            self._metrics.failures.labels("late_registration").inc()
            self._outbox.tell(rank, wp.SendFailed(request_id=staged.request_id, reason=reason))

    def peer_up(self, peer: Peer) -> None:
        """A new session with ``peer``: unverified registrations claiming its engine that came
        before it opened are dropped (only its own announcements vouch). Those that came
        during its handshake wait for its hello: D sends its first PUSH_REG once its own
        side of the handshake is done, which may be before ours. ``peer_down`` drops all."""
        self.drop_unverified(peer, min((s.opened_at for s in peer.sessions), default=math.inf))

    def drop_unverified(self, peer: Peer, before: float) -> None:
        for _, table in self._tables():
            for registration in table.drop_unverified(peer.engine_id, before):
                log.info("registration_dropped", request_id=registration.request_id, peer=registration.sender,
                         reason="unverified when the session changed")

    def agents_known(self, peer: Peer, names: set[str]) -> None:
        """``peer`` announced these agents: check the registrations that waited for
        them, and match the ones that check out."""
        for rank, table in self._tables():
            # An announced agent may replace one of the same rank (its worker
            # restarted): what the old one registered is for memory now retiring.
            stale = {r.sender for r in table.registrations.values() if self._peers.departed(r.sender)}
            for registration in table.drop_registrations_from(stale):
                log.info("registration_dropped", request_id=registration.request_id, peer=peer.engine_id,
                         reason="its agent was replaced")
            for registration in table.unverified_from(names):
                if not self._admitted(rank, peer, registration.sender, registration.reg):
                    table.drop_registration(registration.key)
                    continue
                result = table.confirm(registration.key, self._now())
                if result is not None:
                    self._registered(rank, registration.reg, registration.sender, peer, result)

    def _admitted(self, rank: Rank, peer: Peer, sender: str, reg: notif.PushReg) -> bool:
        """Whether ``reg``, from ``peer``'s announced agent ``sender``, passes the checks
        against that agent; if not, it is counted and logged, and D hears why where the
        registration is its own. First its long groups become arrays, kept from here on
        (once the sender is known: an unverified registration keeps its lists until it is):
        checked now, then paired or planned when P's blocks are ready, without turning the
        lists into arrays at each of those steps."""
        reg.local_block_ids = id_arrays(reg.local_block_ids)
        if (error := registration_error(peer.engine_id, peer.agents[sender], reg, rank.number, rank.tp_size,
                                        peer.described(sender))) is None:
            return True
        reason, message = error
        self._malformed(reason, sender, ProtocolError(message))
        if reason in ("push_reg_blocks", "push_reg_tp"):  # D's own registration, that cannot be written: D hears why
            self._tell_d(rank, peer, reg, f"registration rejected: {message}")
        return False

    def _registered(self, rank: Rank, reg: notif.PushReg, sender: str, peer: Peer | None, result: RegResult) -> None:
        outcome = result.outcome
        if outcome is RegOutcome.MATCHED:
            for match in result.matches:
                if match.registration.release:  # D's request ended unscheduled: nothing to write
                    self._table(rank).finish(match.request_id, self._now())
                    self._released(rank, match.request_id, "D registered no blocks")
                else:
                    self._start(rank, match)
        elif outcome is RegOutcome.RELEASED:
            self._metrics.notifications.labels("push_reg_release_noted").inc()
            log.info("push_reg_release_noted", request_id=reg.request_id, match_key=reg.match_key, peer=sender)
        elif outcome is RegOutcome.CANCELLED:
            self._metrics.notifications.labels("push_reg_cancelled").inc()
            log.info("push_reg_after_cancel", request_id=reg.request_id, peer=sender)
        elif outcome is RegOutcome.DUPLICATE:
            self._metrics.duplicates.labels("push_reg").inc()
            log.info("push_reg_duplicate", request_id=reg.request_id, peer=sender)
        elif outcome is RegOutcome.UNVERIFIED:
            self._metrics.notifications.labels("push_reg_unverified").inc()
            log.info("push_reg_unverified", request_id=reg.request_id, peer=sender, reason="sender not known yet")
        elif outcome is RegOutcome.AMBIGUOUS:
            self.ambiguous(rank, [s.request_id for s in result.collided], [Registration(reg, sender, 0.0, 0.0)], peer)
        elif outcome in (RegOutcome.FINISHED, RegOutcome.FULL):
            kind = "push_reg_finished" if outcome is RegOutcome.FINISHED else "push_reg_table_full"
            self._metrics.notifications.labels(kind).inc()
            log.info(kind, request_id=reg.request_id, match_key=reg.match_key, peer=sender)
            if peer is not None and not names_no_block(reg.local_block_ids):  # a release needs no answer
                why = ("the exchange's P request already ended" if outcome is RegOutcome.FINISHED
                       else "P holds too many registrations")
                self._tell_d(rank, peer, reg, f"registration refused: {why}")

    def ambiguous(self, rank: Rank, p_requests: list[str],
                  registrations: list[Registration] | tuple[Registration, ...], peer: Peer | None = None) -> None:
        """Requests that a shared base id pairs in more than one way: all are refused,
        none is written (each would risk decoding on another request's KV)."""
        self._metrics.failures.labels("ambiguous_match").inc()
        reason = (f"ambiguous_match: {len(p_requests)} P request(s) and {len(registrations)} D registration(s) share "
                  "a base request id and no match key decides; send one X-Request-Id per request, or go "
                  "through a front that sets transfer_id")
        for rid in p_requests:
            log.warning("push_failed", request_id=rid, kind="ambiguous_match", error=reason)
            self._outbox.tell(rank, wp.SendFailed(request_id=rid, reason=reason))
        for r in registrations:
            target = self._peers.find_agent(r.sender) or peer
            if target is not None:
                self._tell_d(rank, target, r.reg, reason)

    def _malformed(self, reason: str, sender: str, exc: Exception) -> None:
        self._metrics.malformed.labels("notification", reason).inc()
        log.warning("malformed_input", source="notification", reason=reason, peer=sender, error=str(exc)[:200])
