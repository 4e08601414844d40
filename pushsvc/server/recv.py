"""D side of the push service: registrations out, completions in.

Mixed into ``PushService``; uses its ``ranks``, ``peers``, ``metrics`` and helpers.
A registration is sent as soon as P's daemon is known; otherwise the handshake runs
in its own task, so no other request waits behind it.
"""

from __future__ import annotations

import asyncio

import structlog

from pushsvc.errors import HandshakeError, LayoutError, ProtocolError, TransferError
from pushsvc.protocol import notif
from pushsvc.protocol import peer as pp
from pushsvc.protocol import worker as wp
from pushsvc.server.peers import Peer
from pushsvc.server.ranks import LocalRank
from pushsvc.state.consumer import CompletionOutcome, PendingRecv, RecvState, Remote
from pushsvc.server.verify import count_mismatches, digest_blocks
from pushsvc.state.layout import check_block_ids, dest_indices

log = structlog.get_logger("pushsvc.recv")


class ReceiveSide:
    def _on_register_recv(self, rank: LocalRank, msg: wp.RegisterRecv) -> None:
        rid = msg.request_id
        bound = structlog.get_logger("pushsvc.recv").bind(request_id=rid, rank=rank.rank, peer=msg.remote_engine_id)
        if rank.consumer.tracks(rid) or rid in rank.landed:
            # Checked before the blocks: a refusal would answer RecvFailed for the
            # live request, and its worker would reuse blocks P may still write into.
            self.metrics.duplicates.labels("registration").inc()
            bound.info("recv_duplicate")
            return
        reason = ""
        if rank.layout is None:
            reason = "no KV memory registered for this rank"
        elif msg.remote_tp_size != rank.tp_size:
            reason = f"P TP {msg.remote_tp_size} != D TP {rank.tp_size} is not supported"
        else:
            try:
                check_block_ids(rank.layout, msg.local_block_ids, "registration")
            except LayoutError as exc:
                reason = str(exc)
            else:
                held = rank.consumer.holder(msg.local_block_ids)
                if held is not None:
                    reason = f"registration: block {held[0]} is held by live request {held[1]}"
        if reason:
            self.metrics.malformed.labels("worker", "registration").inc()
            bound.warning("recv_rejected", phase="register", error=reason)
            self._tell(rank, wp.RecvFailed(request_id=rid, block_ids=_flat(msg.local_block_ids), reason=reason))
            return
        remote = Remote(msg.remote_engine_id, msg.remote_host, msg.remote_port, msg.remote_tp_size)
        now = asyncio.get_running_loop().time()
        entry = rank.consumer.add(rid, msg.local_block_ids, remote, now)
        if entry is None:  # duplicates were answered above; kept for safety
            self.metrics.duplicates.labels("registration").inc()
            return
        rank.registered_at[rid] = now
        peer = self.peers.find_engine(remote.engine_id)
        if peer is not None and self._send_push_reg(rank, entry, peer):
            return
        self._spawn(self._register_with_peer(rank, entry))

    async def _register_with_peer(self, rank: LocalRank, entry: PendingRecv) -> None:
        r = entry.remote
        try:
            peer = await self.peers.ensure(r.host, r.port, r.engine_id)
        except HandshakeError as exc:
            self._fail_recv(rank, entry.request_id, "handshake_failed", str(exc))
            return
        if rank.consumer.pending.get(entry.request_id) is entry:  # not evicted meanwhile
            self._send_push_reg(rank, entry, peer)

    def _send_push_reg(self, rank: LocalRank, entry: PendingRecv, peer: Peer) -> bool:
        target = peer.agent_for_rank(rank.rank)
        if target is None:
            self._fail_recv(rank, entry.request_id, "handshake_failed", f"peer {peer.engine_id} has no rank {rank.rank}")
            return True
        reg = notif.PushReg(
            request_id=entry.request_id,
            decode_engine_id=self.config.engine_id,
            decode_host=self.config.advertised_host,
            decode_port=self.peers.port,
            decode_tp_size=rank.tp_size,
            local_block_ids=entry.block_ids,
            remote_engine_id=entry.remote.engine_id,
            remote_host=entry.remote.host,
            remote_port=entry.remote.port,
            remote_tp_size=entry.remote.tp_size,
            decode_rank=rank.rank,
            decode_daemon_id=self.daemon_id,
        )
        try:
            rank.agent.send_notif(target.agent_name, notif.encode_push_reg(reg))
        except TransferError as exc:
            self._fail_recv(rank, entry.request_id, "push_reg_send_failed", str(exc))
            return True
        rank.consumer.mark_sent(entry.request_id)
        self.wake()
        return True

    def _fail_recv(self, rank: LocalRank, rid: str, kind: str, reason: str) -> None:
        entry = rank.consumer.fail(rid)
        rank.forget_recv(rid)
        if entry is None:
            return
        self.metrics.failures.labels(kind).inc()
        log.warning("recv_failed", request_id=rid, rank=rank.rank, peer=entry.remote.engine_id, kind=kind, error=reason)
        self._tell(rank, wp.RecvFailed(request_id=rid, block_ids=entry.flat_block_ids, reason=f"{kind}: {reason}"))

    def _on_completion(self, rank: LocalRank, sender: str, payload: bytes) -> None:
        try:
            rid, _tp = notif.decode_completion(payload)
        except ProtocolError as exc:
            self._malformed("notification", "completion", sender, exc)
            return
        entry = rank.consumer.pending.get(rid)
        peer = self.peers.find_agent(sender)
        if entry is not None and (peer is None or peer.engine_id != entry.remote.engine_id):
            self._malformed("notification", "foreign_completion", sender, ProtocolError("sender is not the registration's P"))
            return
        outcome, entry = rank.consumer.on_completion(rid)
        if outcome is CompletionOutcome.UNKNOWN:
            self.metrics.notifications.labels("late_completion").inc()
            log.info("completion_ignored", request_id=rid, peer=sender, reason="unknown or late")
            return
        self.metrics.notifications.labels("completion").inc()
        log.debug("completion", request_id=rid, peer=sender, outcome=outcome.value)
        if outcome is CompletionOutcome.CANCELLED:
            rank.forget_recv(rid)
            self._tell(rank, wp.RecvFailed(request_id=rid, block_ids=entry.flat_block_ids,
                                           reason=_final_reason(entry.reason, self.config.watchdog_s)))
        elif outcome is CompletionOutcome.DONE:
            self._finish_recv(rank, entry)

    def _finish_recv(self, rank: LocalRank, entry: PendingRecv) -> None:
        """Every WRITE into this request landed. In verify mode, compare D's blocks with
        P's digests first (waiting for them if the completion overtook them)."""
        rid = entry.request_id
        now = asyncio.get_running_loop().time()
        if self.config.verify:
            expected = rank.digests.pop(rid, None)
            if expected is None:
                rank.landed[rid] = (entry, now)
                return
            result = self._verify(rank, entry, expected)
            if result:
                rank.forget_recv(rid)
                self.metrics.failures.labels("verify").inc()
                log.error("verify_failed", request_id=rid, rank=rank.rank, peer=entry.remote.engine_id, error=result)
                self._tell(rank, wp.RecvFailed(request_id=rid, block_ids=entry.flat_block_ids, reason=f"verify: {result}"))
                return
        started = rank.forget_recv(rid)
        if started is not None:
            self.metrics.recv_seconds.observe(now - started)
        self._tell(rank, wp.RecvDone(request_id=rid))

    def _verify(self, rank: LocalRank, entry: PendingRecv, expected: bytes) -> str:
        """'' if D's blocks equal P's, else what is wrong."""
        if not expected:
            self.metrics.verified.labels("missing").inc()
            return "P sent no digests (is P's daemon running with verify on?)"
        actual = digest_blocks(rank.local_descs, dest_indices(rank.layout, entry.block_ids))
        bad = count_mismatches(expected, actual)
        total = len(actual) // 8
        self.metrics.verified_blocks.labels("mismatch").inc(bad)
        self.metrics.verified_blocks.labels("identical").inc(max(0, total - bad))
        self.metrics.verified.labels("mismatch" if bad else "identical").inc()
        return f"{bad} of {total} blocks differ from P's" if bad else ""

    def push_failed(self, peer: Peer, msg: pp.PushFailed) -> None:
        rank = self.ranks.get(msg.rank)
        entry = rank.consumer.pending.get(msg.request_id) if rank else None
        if rank is None or entry is None or entry.remote.engine_id != peer.engine_id:
            self.metrics.malformed.labels("side_channel", "unknown_push_failed").inc()
            return
        self._fail_recv(rank, msg.request_id, "push_failed_remote", msg.reason)

    def write_started(self, peer: Peer, msg: pp.WriteStarted) -> None:
        rank = self.ranks.get(msg.rank)
        if rank is not None and self.config.verify:
            landed = rank.landed.get(msg.request_id)
            if landed is not None and landed[0].remote.engine_id == peer.engine_id:
                del rank.landed[msg.request_id]  # the completion overtook the digests
                rank.digests[msg.request_id] = msg.digests
                self._finish_recv(rank, landed[0])
                return
        entry = rank.consumer.pending.get(msg.request_id) if rank else None
        if rank is None or entry is None or entry.remote.engine_id != peer.engine_id:
            return  # finished or failed already
        if self.config.verify:
            rank.digests[msg.request_id] = msg.digests
        rank.incoming[msg.request_id] = asyncio.get_running_loop().time()
        log.debug("write_announced", request_id=msg.request_id, peer=peer.engine_id, bytes=msg.nbytes)
        self.wake()

    def _cancel_recv(self, rank: LocalRank, rid: str) -> None:
        """The worker evicted ``rid``. Its blocks are reusable only once P can no longer
        write into them: at once if P never saw the registration, else after P says so."""
        entry = rank.consumer.evict(rid, asyncio.get_running_loop().time())
        if entry is None:
            return
        log.info("recv_cancelled", request_id=rid, rank=rank.rank, peer=entry.remote.engine_id,
                 waiting_for_p=entry.state is RecvState.CANCELLING)
        if entry.state is not RecvState.CANCELLING:
            rank.forget_recv(rid)
            self._tell(rank, wp.RecvFailed(request_id=rid, block_ids=entry.flat_block_ids, reason="cancelled"))
            return
        self._request_cancel(rank, entry)

    def _request_cancel(self, rank: LocalRank, entry: PendingRecv) -> None:
        peer = self.peers.find_engine(entry.remote.engine_id)
        if peer is None or not self.peers.send(peer, pp.CancelPush(request_id=entry.request_id, rank=rank.rank)):
            # P cannot confirm, but a WRITE it posted may still land: the blocks stay
            # held until the entry's cancel deadline (or the WRITE's completion).
            log.warning("cancel_unsent", request_id=entry.request_id, rank=rank.rank, peer=entry.remote.engine_id,
                        reason="P daemon unreachable")

    def push_cancelled(self, peer: Peer, msg: pp.PushCancelled) -> None:
        rank = self.ranks.get(msg.rank)
        entry = rank.consumer.pending.get(msg.request_id) if rank else None
        if rank is None or entry is None or entry.state is not RecvState.CANCELLING:
            return  # the WRITE's completion got here first: already final
        rank.forget_recv(msg.request_id)
        rank.consumer.fail(msg.request_id)
        self._tell(rank, wp.RecvFailed(request_id=msg.request_id, block_ids=entry.flat_block_ids,
                                       reason=_final_reason(entry.reason, self.config.watchdog_s)))


def _flat(block_ids: list[list[int]]) -> list[int]:
    return [b for g in block_ids for b in g]


def _final_reason(reason: str, watchdog_s: float) -> str:
    return f"watchdog: no push within {watchdog_s}s" if reason == "watchdog" else reason
