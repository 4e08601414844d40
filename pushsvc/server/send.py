"""P side of the push service: match registrations with finished blocks, WRITE.

Mixed into ``PushService``. The fast path (peer known, descriptors prepped) posts the
WRITE inline, in the same loop iteration that completed the match; only a missing
handshake defers it to a task. Any failure frees P's lease at once and tells D at once
over the side channel, so neither side waits for a timer.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from pushsvc.engine.base import XferState
from pushsvc.errors import HandshakeError, LayoutError, ProtocolError, TransferError
from pushsvc.protocol import notif
from pushsvc.protocol import peer as pp
from pushsvc.protocol import worker as wp
from pushsvc.server.peers import Peer
from pushsvc.server.ranks import Inflight, LocalRank, layout_of_agent
from pushsvc.server.verify import digest_blocks
from pushsvc.state.layout import Layout, check_block_ids, check_compatible, plan_write
from pushsvc.state.producer import Match, RegOutcome, StageOutcome

log = structlog.get_logger("pushsvc.send")


class SendSide:
    def _on_send_ready(self, rank: LocalRank, msg: wp.SendReady) -> None:
        rid = msg.request_id
        if rank.producer.tracks(rid):
            # Before the block check: refusing it would fail the live request, and its
            # worker would free blocks a WRITE may still be reading.
            self.metrics.duplicates.labels("finished_blocks").inc()
            return
        try:
            if rank.layout is None:
                raise LayoutError("no KV memory registered for this rank")
            check_block_ids(rank.layout, msg.block_ids, "finished blocks")
        except LayoutError as exc:
            self.metrics.malformed.labels("worker", "finished_blocks").inc()
            log.warning("send_rejected", request_id=rid, rank=rank.rank, error=str(exc))
            self._tell(rank, wp.SendFailed(request_id=rid, reason=str(exc)))
            return
        now = asyncio.get_running_loop().time()
        # A PUSH_REG may already be queued in the agent: read it before deciding.
        self._drain_notifs(rank)
        outcome, match = rank.producer.add_staged(rid, msg.block_ids, now)
        if outcome is StageOutcome.DUPLICATE:
            self.metrics.duplicates.labels("finished_blocks").inc()
        elif outcome is StageOutcome.STASHED:
            rank.staged_at[rid] = now
        elif match is not None:
            rank.staged_at[rid] = now
            self._start_push(rank, match)

    def _on_push_reg(self, rank: LocalRank, sender: str, payload: bytes) -> None:
        try:
            reg = notif.decode_push_reg(payload, self.config.max_notif_bytes)
        except ProtocolError as exc:
            self._malformed("notification", "push_reg", sender, exc)
            return
        if reg.remote_engine_id != self.config.engine_id:
            self._malformed("notification", "push_reg_wrong_engine", sender,
                            ProtocolError(f"PUSH_REG for engine {reg.remote_engine_id}"))
            return
        known = self.peers.find_agent(sender)
        if known is None and self.peers.departed(sender):
            # From a D incarnation or worker that is gone: late, and never to be written.
            self._malformed("notification", "push_reg_departed_agent", sender,
                            ProtocolError(f"PUSH_REG from departed agent {sender}"))
            return
        if known is not None and (known.engine_id != reg.decode_engine_id or
                                  (a := known.agents[sender]).rank != reg.decode_rank or a.tp_size != reg.decode_tp_size):
            # A known agent registering for someone else's engine or rank: refusing it
            # here keeps it from squatting on a request id the real D will use.
            self._malformed("notification", "push_reg_sender_mismatch", sender,
                            ProtocolError(f"agent of {known.engine_id} sent a PUSH_REG for {reg.decode_engine_id}"))
            return
        if known is not None:
            # D's layout is known: blocks outside it, or named twice, can never be
            # written. Refused now, and D hears why.
            try:
                check_block_ids(layout_of_agent(known.agents[sender]), reg.local_block_ids, "PUSH_REG")
            except LayoutError as exc:
                self._malformed("notification", "push_reg_blocks", sender, exc)
                self.peers.send(known, pp.PushFailed(request_id=reg.request_id, rank=reg.decode_rank,
                                                     reason=f"registration rejected: {exc}"))
                return
        now = asyncio.get_running_loop().time()
        outcome, match = rank.producer.add_registration(reg, sender, now, verified=known is not None)
        self.metrics.notifications.labels("push_reg").inc()
        if outcome is RegOutcome.CANCELLED:
            self.metrics.notifications.labels("push_reg_cancelled").inc()
            log.info("push_reg_after_cancel", request_id=reg.request_id, peer=sender)
        elif outcome is RegOutcome.DUPLICATE:
            self.metrics.duplicates.labels("push_reg").inc()
            log.info("push_reg_duplicate", request_id=reg.request_id, peer=sender)
        elif match is not None:
            self._start_push(rank, match)

    def _start_push(self, rank: LocalRank, match: Match) -> None:
        reg = match.registration.reg
        peer = self.peers.find_agent(match.registration.sender) or self.peers.find_engine(reg.decode_engine_id)
        if peer is not None:
            self._write(rank, match, peer)
        else:
            self._spawn(self._push_after_handshake(rank, match))

    async def _push_after_handshake(self, rank: LocalRank, match: Match) -> None:
        reg = match.registration.reg
        try:
            peer = await self.peers.ensure(reg.decode_host, reg.decode_port, reg.decode_engine_id)
        except HandshakeError as exc:
            peer, error = None, exc
        if rank.producer.writing.get(match.request_id) is not match:
            return  # cancelled or evicted while the handshake ran: already final
        if peer is None:
            self._fail_push(rank, match, None, "handshake_failed", str(error))
        else:
            self._write(rank, match, peer)

    def _write(self, rank: LocalRank, match: Match, peer: Peer) -> None:
        reg = match.registration.reg
        target = peer.agents.get(match.registration.sender)
        if (peer.engine_id != reg.decode_engine_id or target is None or target.rank != reg.decode_rank
                or target.tp_size != reg.decode_tp_size):
            # Not D's own registration: D is not told (it may not even exist).
            self.metrics.malformed.labels("notification", "push_reg_sender_unknown").inc()
            self._fail_push(rank, match, None, "sender_mismatch",
                            f"PUSH_REG sender {match.registration.sender} is not {reg.decode_engine_id} "
                            f"rank {reg.decode_rank}", notify_remote=False)
            return
        try:
            remote_layout = self._remote_layout(rank, target)
            plan = plan_write(rank.layout, remote_layout, match.block_ids, reg.local_block_ids)
            if not len(plan.src_indices):
                # D registered no blocks: its request ended before it was scheduled,
                # and the registration only releases P. Nothing to write.
                rank.agent.send_notif(target.agent_name, notif.encode_completion(reg.request_id, rank.tp_size))
                self._release_without_write(rank, match)
                return
            digests = digest_blocks(rank.local_descs, plan.src_indices) if self.config.verify else b""
            # Wall clock, not loop.time(): uvloop caches the loop's time per iteration,
            # and a WRITE over shared memory may complete inside this very call.
            write_start = time.perf_counter()
            handle, state = rank.agent.write(
                rank.local_dlist, plan.src_indices, rank.remote_dlists[target.agent_name], plan.dst_indices,
                notif.encode_completion(reg.request_id, rank.tp_size),
            )
        except LayoutError as exc:
            self._fail_push(rank, match, peer, "layout_mismatch", str(exc))
            return
        except TransferError as exc:
            self._fail_push(rank, match, peer, "write_submit_failed", str(exc))
            return
        now = asyncio.get_running_loop().time()
        staged = rank.staged_at.get(match.request_id)
        if staged is not None:
            self.metrics.match_wait_seconds.observe(now - staged)
        rank.inflight[match.request_id] = Inflight(match, handle, target.agent_name, plan.nbytes, now,
                                                  write_start=write_start)
        self.metrics.transfer_blocks.inc(plan.logical_blocks)
        log.debug("write_posted", request_id=match.request_id, peer=peer.engine_id, bytes=plan.nbytes,
                  descriptors=len(plan.src_indices))
        if state is XferState.PROC or digests:
            self.peers.send(peer, pp.WriteStarted(request_id=reg.request_id, rank=reg.decode_rank, nbytes=plan.nbytes,
                                                  digests=digests))
        if state is not XferState.PROC:
            self._settle(rank, rank.inflight[match.request_id], state, now)
        self.wake()

    def _release_without_write(self, rank: LocalRank, match: Match) -> None:
        rank.producer.finish(match.request_id)
        rank.staged_at.pop(match.request_id, None)
        self.metrics.transfers.labels("released").inc()
        log.info("push_released", request_id=match.request_id, peer=match.registration.reg.decode_engine_id,
                 reason="D registered no blocks")
        self._tell(rank, wp.SendDone(request_id=match.request_id))

    def _remote_layout(self, rank: LocalRank, target: pp.AgentInfo) -> Layout:
        """The remote's layout, checked against ours and prepped once per remote agent."""
        layout = layout_of_agent(target)
        error = rank.remote_checked.get(target.agent_name)
        if error is None:
            try:
                check_compatible(rank.layout, layout)
                if target.agent_name not in rank.remote_dlists:
                    raise LayoutError(f"agent {target.agent_name} was not loaded")
                error = ""
            except LayoutError as exc:
                error = str(exc)
            rank.remote_checked[target.agent_name] = error
        if error:
            raise LayoutError(error)
        return layout

    def _settle(self, rank: LocalRank, flight: Inflight, state: XferState, now: float) -> None:
        rid = flight.match.request_id
        del rank.inflight[rid]
        try:
            rank.agent.release(flight.handle)
        except TransferError as exc:
            log.warning("write_release_failed", request_id=rid, error=str(exc))
        log.debug("write_settled", request_id=rid, state=state.value, seconds=round(time.perf_counter() - flight.write_start, 6))
        if state is XferState.DONE:
            rank.producer.finish(rid)
            rank.staged_at.pop(rid, None)
            self.metrics.transfers.labels("done").inc()
            self.metrics.transfer_bytes.inc(flight.nbytes)
            self.metrics.transfer_seconds.observe(time.perf_counter() - flight.write_start)
            self._tell(rank, wp.SendDone(request_id=rid))
        else:
            peer = self.peers.find_agent(flight.remote_agent)
            self._fail_push(rank, flight.match, peer, "write_failed", "NIXL reported the WRITE failed",
                            notify_remote=not flight.cancelled)
        if flight.cancelled:
            self._ack_cancel(flight.match.registration.reg)

    def cancel_push(self, peer: Peer, msg: pp.CancelPush) -> None:
        """D withdrew a registration. Answer once nothing more can land in its blocks."""
        rank = self.ranks.get(msg.rank)
        if rank is None:
            self.metrics.malformed.labels("side_channel", "unknown_cancel").inc()
            return
        # A PUSH_REG already queued in the agent is read first; one still on the wire
        # meets the tombstone ``cancel_registration`` leaves.
        self._drain_notifs(rank)
        match = rank.producer.cancel_registration(msg.request_id, asyncio.get_running_loop().time())
        log.info("push_cancelled", remote_request_id=msg.request_id, peer=peer.engine_id,
                 writing=match is not None)
        if match is not None and match.request_id in rank.inflight:
            rank.inflight[match.request_id].cancelled = True  # acknowledged in _settle
            return
        if match is not None:  # matched, handshake still running: nothing posted yet
            self._fail_push(rank, match, None, "cancelled", "D withdrew the registration", notify_remote=False)
        self.peers.send(peer, pp.PushCancelled(request_id=msg.request_id, rank=msg.rank))

    def _ack_cancel(self, reg) -> None:
        peer = self.peers.find_engine(reg.decode_engine_id)
        if peer is not None:
            self.peers.send(peer, pp.PushCancelled(request_id=reg.request_id, rank=reg.decode_rank))

    def _fail_push(self, rank: LocalRank, match: Match, peer: Peer | None, kind: str, reason: str,
                   notify_remote: bool = True) -> None:
        """P cannot push: free P's lease now and tell D now (not at its watchdog)."""
        rank.producer.finish(match.request_id)
        rank.staged_at.pop(match.request_id, None)
        self.metrics.transfers.labels("failed").inc()
        self.metrics.failures.labels(kind).inc()
        reg = match.registration.reg
        log.warning("push_failed", request_id=match.request_id, remote_request_id=reg.request_id,
                    peer=reg.decode_engine_id, kind=kind, error=reason)
        self._tell(rank, wp.SendFailed(request_id=match.request_id, reason=f"{kind}: {reason}"))
        peer = peer or self.peers.find_engine(reg.decode_engine_id)
        if notify_remote and peer is not None:
            self.peers.send(peer, pp.PushFailed(request_id=reg.request_id, rank=reg.decode_rank,
                                                reason=f"{kind}: {reason}"))
