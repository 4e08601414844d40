"""The push service: worker messages, NIXL notifications and peer events in, NIXL
WRITEs, notifications and worker events out.

Everything here runs on the daemon's one event loop. Decisions live in the pure tables
(``state/``); this module does the I/O they ask for. Only two things ever wait: the
handshake with a peer daemon (its own task, so no other request waits behind it) and
WRITE completion (polled by the progress loop).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import structlog

from pushsvc.config import Config
from pushsvc.engine.base import Engine, XferState
from pushsvc.errors import HandshakeError, LayoutError, ProtocolError, TransferError
from pushsvc.metrics import Metrics
from pushsvc.protocol import notif
from pushsvc.protocol import peer as pp
from pushsvc.protocol import worker as wp
from pushsvc.server.peers import Peer, PeerEvents, PeerManager
from pushsvc.server.ranks import Inflight, LocalRank, layout_from_regions, layout_of_agent
from pushsvc.shm import SharedBuffer
from pushsvc.state.consumer import CompletionOutcome, ConsumerTable, PendingRecv, RecvState, Remote
from pushsvc.state.layout import Layout, check_block_ids, check_compatible, descriptor_table, plan_write
from pushsvc.state.producer import Match, ProducerTable, RegOutcome, StageOutcome

log = structlog.get_logger("pushsvc.service")

_EXPIRY_PERIOD_S = 0.05


class PushService(PeerEvents):
    def __init__(self, config: Config, engine: Engine, metrics: Metrics, daemon_id: str | None = None) -> None:
        self.config = config
        self.engine = engine
        self.metrics = metrics
        self.daemon_id = daemon_id or uuid.uuid4().hex
        self.ranks: dict[int, LocalRank] = {}
        self.peers = PeerManager(
            daemon_id=self.daemon_id,
            engine_id=config.engine_id,
            advertised_host=config.advertised_host,
            local_agents=self.agent_infos,
            events=self,
            metrics=metrics,
            max_frame=config.max_peer_frame,
            handshake_timeout_s=config.handshake_timeout_s,
            heartbeat_interval_s=config.heartbeat_interval_s,
            peer_timeout_s=config.peer_timeout_s,
        )
        self._tasks: set[asyncio.Task] = set()
        self._next_expiry = 0.0
        self.wake = lambda: None  # set by the progress loop

    # ================================================================ worker side

    def attach_worker(self, conn: Any, hello: wp.Hello) -> wp.Welcome:
        """A worker said hello: bind its connection to its rank, creating the agent once."""
        if hello.engine_id != self.config.engine_id:
            raise ProtocolError(f"worker engine id {hello.engine_id!r} != daemon engine id {self.config.engine_id!r}")
        rank = self.ranks.get(hello.rank)
        if rank is not None and rank.conn is not None and rank.conn is not conn:
            raise ProtocolError(f"rank {hello.rank} already has a connected worker")
        if rank is not None and (rank.tp_size != hello.tp_size or rank.role != hello.role):
            self._drop_rank(rank, "worker re-registered with another shape")
            rank = None
        if rank is None:
            name = f"{self.config.engine_id}/r{hello.rank}/{self.daemon_id[:8]}"
            rank = LocalRank(
                engine_id=hello.engine_id,
                rank=hello.rank,
                tp_size=hello.tp_size,
                role=hello.role,
                agent=self.engine.create_agent(name),
                producer=ProducerTable(self.config.lease_s, self.config.registration_ttl_s),
                consumer=ConsumerTable(self.config.watchdog_s, hello.tp_size),
            )
            self.ranks[hello.rank] = rank
            self.metrics.agents.set(len(self.ranks))
        rank.conn = conn
        return wp.Welcome(
            daemon_id=self.daemon_id,
            engine_id=self.config.engine_id,
            side_channel_host=self.config.advertised_host,
            side_channel_port=self.peers.port,
            max_frame=self.config.max_worker_frame,
        )

    def detach_worker(self, conn: Any) -> None:
        """The worker went away. Its rank, agent and memory stay (the mapping keeps the
        pages alive); requests it cannot hear about any more are dropped."""
        for rank in self.ranks.values():
            if rank.conn is conn:
                rank.conn = None
                for rid in list(rank.consumer.pending):
                    rank.consumer.evict(rid)
                for rid in list(rank.producer.staged):
                    rank.producer.evict(rid)
                self._update_gauges()

    def register_kv(self, rank: LocalRank, msg: wp.RegisterKV, fds: list[int]) -> wp.KVRegistered:
        if rank.layout is not None:
            raise ProtocolError("KV memory is already registered for this rank")
        if not isinstance(msg.memory, wp.MemfdBuffers):
            raise ProtocolError("daemon-owned GPU arenas need a CUDA build of the daemon")
        if len(fds) != msg.memory.count:
            raise ProtocolError(f"expected {msg.memory.count} fds, got {len(fds)}")
        buffers: list[SharedBuffer] = []
        try:
            for fd in fds:
                buffers.append(SharedBuffer.attach(fd))
            fds.clear()  # owned by the buffers now
            for r in msg.regions:
                if r.buffer >= len(buffers):
                    raise LayoutError(f"region names buffer {r.buffer}, only {len(buffers)} sent")
                end = r.offset + (r.num_blocks - 1) * r.stride + r.block_len
                if end > buffers[r.buffer].size:
                    raise LayoutError(f"region ends at {end}, past buffer {r.buffer} of {buffers[r.buffer].size} bytes")
            rank.agent.register([(b.address, b.size) for b in buffers], "DRAM")
            layout = layout_from_regions(msg.regions, [b.address for b in buffers], msg.blocks_per_logical)
            rank.local_dlist = rank.agent.prep_local(descriptor_table(layout), "DRAM")
        except BaseException:
            for b in buffers:
                b.close()
            raise
        rank.buffers = buffers
        rank.regions = list(msg.regions)
        rank.layout = layout
        log.info("kv_registered", rank=rank.rank, agent=rank.agent.name, regions=len(msg.regions),
                 bytes=sum(b.size for b in buffers))
        # Peers that already know us learn about the new agent; we learn theirs.
        self.peers.broadcast(pp.AgentsUpdate(agents=[self._agent_info(rank)]))
        for peer in self.peers.peers.values():
            self._load_agents(peer, list(peer.agents.values()), [rank])
        return wp.KVRegistered(agent_name=rank.agent.name, regions=len(msg.regions),
                               bytes=sum(b.size for b in buffers))

    def on_worker_message(self, rank: LocalRank, msg: wp.WorkerMessage) -> None:
        self.metrics.worker_messages.labels(type(msg).__name__).inc()
        if isinstance(msg, wp.RegisterRecv):
            self._on_register_recv(rank, msg)
        elif isinstance(msg, wp.SendReady):
            self._on_send_ready(rank, msg)
        elif isinstance(msg, wp.Evict):
            for rid in msg.request_ids:
                self._evict(rank, rid)
        elif isinstance(msg, wp.Ping):
            self._tell(rank, wp.Pong(token=msg.token))
        else:
            raise ProtocolError(f"unexpected {type(msg).__name__}")
        self._update_gauges()
        self.wake()

    # ---------------------------------------------------------------- D: receive

    def _on_register_recv(self, rank: LocalRank, msg: wp.RegisterRecv) -> None:
        rid = msg.request_id
        bound = structlog.get_logger("pushsvc.recv").bind(request_id=rid, rank=rank.rank, peer=msg.remote_engine_id)
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
        if reason:
            self.metrics.malformed.labels("worker", "registration").inc()
            bound.warning("recv_rejected", phase="register", error=reason)
            self._tell(rank, wp.RecvFailed(request_id=rid, block_ids=_flat(msg.local_block_ids), reason=reason))
            return
        remote = Remote(msg.remote_engine_id, msg.remote_host, msg.remote_port, msg.remote_tp_size)
        now = asyncio.get_running_loop().time()
        entry = rank.consumer.add(rid, msg.local_block_ids, remote, now)
        if entry is None:
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
        rank.registered_at.pop(rid, None)
        if entry is None:
            return
        self.metrics.failures.labels(kind).inc()
        log.warning("recv_failed", request_id=rid, rank=rank.rank, peer=entry.remote.engine_id, kind=kind, error=reason)
        self._tell(rank, wp.RecvFailed(request_id=rid, block_ids=entry.flat_block_ids, reason=f"{kind}: {reason}"))
        self._update_gauges()

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
        if outcome is CompletionOutcome.DONE:
            started = rank.registered_at.pop(rid, None)
            if started is not None:
                self.metrics.recv_seconds.observe(asyncio.get_running_loop().time() - started)
            self._tell(rank, wp.RecvDone(request_id=rid))

    # ---------------------------------------------------------------- P: send

    def _on_send_ready(self, rank: LocalRank, msg: wp.SendReady) -> None:
        rid = msg.request_id
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
            reg = notif.decode_push_reg(payload)
        except ProtocolError as exc:
            self._malformed("notification", "push_reg", sender, exc)
            return
        if reg.remote_engine_id != self.config.engine_id:
            self._malformed("notification", "push_reg_wrong_engine", sender,
                            ProtocolError(f"PUSH_REG for engine {reg.remote_engine_id}"))
            return
        known = self.peers.find_agent(sender)
        if known is not None and (known.engine_id != reg.decode_engine_id or
                                  (a := known.agents[sender]).rank != reg.decode_rank or a.tp_size != reg.decode_tp_size):
            # A known agent registering for someone else's engine or rank: refusing it
            # here keeps it from squatting on a request id the real D will use.
            self._malformed("notification", "push_reg_sender_mismatch", sender,
                            ProtocolError(f"agent of {known.engine_id} sent a PUSH_REG for {reg.decode_engine_id}"))
            return
        now = asyncio.get_running_loop().time()
        outcome, match = rank.producer.add_registration(reg, sender, now)
        self.metrics.notifications.labels("push_reg").inc()
        if outcome is RegOutcome.DUPLICATE:
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
            self._fail_push(rank, match, None, "handshake_failed", str(exc))
            return
        if rank.producer.writing.get(match.request_id) is match:
            self._write(rank, match, peer)

    def _write(self, rank: LocalRank, match: Match, peer: Peer) -> None:
        reg = match.registration.reg
        target = peer.agents.get(match.registration.sender)
        if (peer.engine_id != reg.decode_engine_id or target is None or target.rank != reg.decode_rank
                or target.tp_size != reg.decode_tp_size):
            # Not D's own registration: D is not told (it may not even exist).
            self._fail_push(rank, match, None, "sender_mismatch",
                            f"PUSH_REG sender {match.registration.sender} is not {reg.decode_engine_id} "
                            f"rank {reg.decode_rank}", notify_remote=False)
            return
        try:
            remote_layout = self._remote_layout(rank, target)
            plan = plan_write(rank.layout, remote_layout, match.block_ids, reg.local_block_ids)
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
        rank.inflight[match.request_id] = Inflight(match, handle, target.agent_name, plan.nbytes, now)
        self.metrics.transfer_blocks.inc(plan.logical_blocks)
        log.debug("write_posted", request_id=match.request_id, peer=peer.engine_id, bytes=plan.nbytes,
                  descriptors=len(plan.src_indices))
        if state is not XferState.PROC:
            self._settle(rank, rank.inflight[match.request_id], state, now)
        self.wake()

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
        if state is XferState.DONE:
            rank.producer.finish(rid)
            rank.staged_at.pop(rid, None)
            self.metrics.transfers.labels("done").inc()
            self.metrics.transfer_bytes.inc(flight.nbytes)
            self.metrics.transfer_seconds.observe(now - flight.posted_at)
            self._tell(rank, wp.SendDone(request_id=rid))
        else:
            peer = self.peers.find_agent(flight.remote_agent)
            self._fail_push(rank, flight.match, peer, "write_failed", "NIXL reported the WRITE failed")

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
        self._update_gauges()
        peer = peer or self.peers.find_engine(reg.decode_engine_id)
        if notify_remote and peer is not None:
            self.peers.send(peer, pp.PushFailed(request_id=reg.request_id, rank=reg.decode_rank,
                                                reason=f"{kind}: {reason}"))

    # ================================================================ peer events

    def agent_infos(self) -> list[pp.AgentInfo]:
        return [self._agent_info(r) for r in self.ranks.values() if r.layout is not None]

    def _agent_info(self, rank: LocalRank) -> pp.AgentInfo:
        assert rank.layout is not None
        return pp.AgentInfo(
            rank=rank.rank,
            tp_size=rank.tp_size,
            agent_name=rank.agent.name,
            metadata=rank.agent.metadata(),
            regions=[
                pp.RegionInfo(base=s.base, block_len=s.block_len, num_blocks=s.num_blocks,
                              block_stride=r.block_stride, group=s.group, layer_names=r.layer_names)
                for s, r in zip(rank.layout.regions, rank.regions)
            ],
            blocks_per_logical=rank.layout.blocks_per_logical,
        )

    def peer_up(self, peer: Peer, new_agents: list[pp.AgentInfo]) -> None:
        self._load_agents(peer, new_agents, [r for r in self.ranks.values() if r.layout is not None])

    def _load_agents(self, peer: Peer, agents: list[pp.AgentInfo], ranks: list[LocalRank]) -> None:
        for rank in ranks:
            for info in agents:
                if info.agent_name in rank.remote_dlists:
                    continue
                try:
                    name = rank.agent.add_remote(info.metadata)
                    if name != info.agent_name:
                        raise TransferError(f"metadata names agent {name}, hello said {info.agent_name}")
                    rank.remote_dlists[name] = rank.agent.prep_remote(
                        name, descriptor_table(layout_of_agent(info)), info.mem_type)
                    rank.remote_checked.pop(name, None)
                except TransferError as exc:
                    rank.remote_checked[info.agent_name] = f"cannot load remote agent: {exc}"
                    log.warning("remote_agent_load_failed", rank=rank.rank, peer=peer.engine_id,
                                agent=info.agent_name, error=str(exc))

    def peer_down(self, peer: Peer) -> None:
        names = set(peer.agents)
        for rank in self.ranks.values():
            # D: registrations P will never serve now.
            for entry in rank.consumer.waiting_on(peer.engine_id):
                if entry.state is RecvState.SENT:
                    self._fail_recv(rank, entry.request_id, "peer_lost", f"P daemon {peer.engine_id} went away")
            # P: registrations from agents that no longer exist.
            for reg in rank.producer.drop_registrations_from(names):
                self.metrics.failures.labels("peer_lost").inc()
                log.info("registration_dropped", request_id=reg.reg.request_id, peer=peer.engine_id, reason="peer down")
            busy = {f.remote_agent for f in rank.inflight.values()}
            for name in names & set(rank.remote_dlists):
                if name in busy:
                    continue  # removed once its WRITEs settle (progress loop)
                self._unload_remote(rank, name)
        self._update_gauges()

    def _unload_remote(self, rank: LocalRank, name: str) -> None:
        handle = rank.remote_dlists.pop(name, None)
        rank.remote_checked.pop(name, None)
        try:
            if handle is not None:
                rank.agent.release_dlist(handle)
            rank.agent.remove_remote(name)
        except TransferError as exc:
            log.warning("remote_agent_unload_failed", rank=rank.rank, agent=name, error=str(exc))

    def push_failed(self, peer: Peer, msg: pp.PushFailed) -> None:
        rank = self.ranks.get(msg.rank)
        entry = rank.consumer.pending.get(msg.request_id) if rank else None
        if rank is None or entry is None or entry.remote.engine_id != peer.engine_id:
            self.metrics.malformed.labels("side_channel", "unknown_push_failed").inc()
            return
        self._fail_recv(rank, msg.request_id, "push_failed_remote", msg.reason)

    # ================================================================ progress

    def progress(self, now: float) -> bool:
        """One pass over every agent: notifications, WRITE states, timers. Returns
        whether anything is in flight (the caller then polls again soon)."""
        for rank in list(self.ranks.values()):
            self._drain_notifs(rank)
            if rank.inflight:
                for flight in list(rank.inflight.values()):
                    state = rank.agent.state(flight.handle)
                    if state is not XferState.PROC:
                        self._settle(rank, flight, state, now)
            if not rank.inflight:
                self._unload_departed(rank)
        if now >= self._next_expiry:
            self._next_expiry = now + _EXPIRY_PERIOD_S
            self._expire(now)
        return any(r.busy for r in self.ranks.values())

    def _drain_notifs(self, rank: LocalRank) -> None:
        try:
            batches = rank.agent.notifs()
        except TransferError as exc:
            log.error("notif_poll_failed", rank=rank.rank, error=str(exc))
            return
        for sender, payloads in batches.items():
            for payload in payloads:
                if notif.is_push_reg(payload):
                    self._on_push_reg(rank, sender, payload)
                else:
                    self._on_completion(rank, sender, payload)

    def _unload_departed(self, rank: LocalRank) -> None:
        for name in [n for n in rank.remote_dlists if self.peers.find_agent(n) is None]:
            self._unload_remote(rank, name)

    def _expire(self, now: float) -> None:
        changed = False
        for rank in self.ranks.values():
            for exp in rank.producer.expire(now):
                changed = True
                rank.staged_at.pop(exp.request_id, None)
                if exp.kind == "lease":
                    self.metrics.leases_expired.inc()
                    log.warning("lease_expired", request_id=exp.request_id, rank=rank.rank)
                    self._tell(rank, wp.SendFailed(request_id=exp.request_id, reason="lease expired: no registration"))
                else:
                    self.metrics.failures.labels("registration_expired").inc()
                    log.info("registration_expired", request_id=exp.request_id, peer=exp.sender)
            for entry in rank.consumer.expire(now):
                changed = True
                rank.registered_at.pop(entry.request_id, None)
                self.metrics.watchdog_expired.inc()
                self.metrics.failures.labels("watchdog").inc()
                log.warning("watchdog_expired", request_id=entry.request_id, rank=rank.rank, peer=entry.remote.engine_id)
                self._tell(rank, wp.RecvFailed(request_id=entry.request_id, block_ids=entry.flat_block_ids,
                                               reason=f"watchdog: no push within {self.config.watchdog_s}s"))
        if changed:
            self._update_gauges()

    # ================================================================ misc

    def _evict(self, rank: LocalRank, rid: str) -> None:
        evicted = rank.producer.evict(rid) | rank.consumer.evict(rid)
        rank.staged_at.pop(rid, None)
        rank.registered_at.pop(rid, None)
        if evicted:
            log.info("evicted", request_id=rid, rank=rank.rank)

    def _drop_rank(self, rank: LocalRank, reason: str) -> None:
        log.warning("rank_dropped", rank=rank.rank, reason=reason)
        self.ranks.pop(rank.rank, None)
        for b in rank.buffers:
            b.close()
        rank.agent.close()

    def _tell(self, rank: LocalRank, msg: Any) -> None:
        if rank.conn is not None:
            rank.conn.send(msg)

    def _malformed(self, source: str, reason: str, sender: str, exc: Exception) -> None:
        self.metrics.malformed.labels(source, reason).inc()
        log.warning("malformed_input", source=source, reason=reason, peer=sender, error=str(exc)[:200])

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _update_gauges(self) -> None:
        totals: dict[str, int] = {}
        for rank in self.ranks.values():
            for k, v in rank.sizes().items():
                totals[k] = totals.get(k, 0) + v
        for k, v in totals.items():
            if k == "inflight":
                self.metrics.inflight_writes.set(v)
            else:
                self.metrics.table_entries.labels(k).set(v)

    def table_sizes(self) -> dict[str, int]:
        totals: dict[str, int] = {"p_registrations": 0, "p_staged": 0, "p_writing": 0, "d_pending": 0, "inflight": 0}
        for rank in self.ranks.values():
            for k, v in rank.sizes().items():
                totals[k] += v
        return totals

    @property
    def idle(self) -> bool:
        return not any(r.busy or r.producer.registrations or r.consumer.pending for r in self.ranks.values())

    async def close(self) -> None:
        await self.peers.close()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for rank in list(self.ranks.values()):
            for flight in list(rank.inflight.values()):
                try:
                    rank.agent.release(flight.handle)
                except TransferError:
                    pass
            rank.inflight.clear()
            rank.agent.close()
            for b in rank.buffers:
                b.close()
        self.ranks.clear()

    def __repr__(self) -> str:
        return f"<PushService {self.config.engine_id} ranks={sorted(self.ranks)} {self.table_sizes()}>"


def _flat(block_ids: list[list[int]]) -> list[int]:
    return [b for g in block_ids for b in g]

