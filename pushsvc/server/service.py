"""The push service: worker messages, NIXL notifications and peer events in, NIXL
WRITEs, notifications and worker events out.

Everything here runs on the daemon's one event loop. Decisions live in the pure tables
(``state/``); this module and its two halves, ``send`` (P) and ``recv`` (D), do the
I/O they ask for. Only two things ever wait: the handshake with a peer daemon (its own
task, so no other request waits behind it) and WRITE completion (polled by the
progress loop, ``progress``).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import structlog

from pushsvc.config import Config, read_secret_file
from pushsvc.engine.base import Engine, XferState
from pushsvc.errors import LayoutError, ProtocolError, TransferError
from pushsvc.metrics import Metrics
from pushsvc.protocol import notif
from pushsvc.protocol import peer as pp
from pushsvc.protocol import worker as wp
from pushsvc.server.peers import Peer, PeerEvents, PeerManager
from pushsvc.server.progress import Pace
from pushsvc.server.ranks import LocalRank, layout_from_regions, layout_of_agent
from pushsvc.server.recv import ReceiveSide
from pushsvc.server.send import SendSide
from pushsvc.shm import SharedBuffer
from pushsvc.state.consumer import PEER_LOST, ConsumerTable, RecvState
from pushsvc.state.layout import descriptor_table
from pushsvc.state.producer import ProducerTable

log = structlog.get_logger("pushsvc.service")

_EXPIRY_PERIOD_S = 0.05
# Block descriptors one rank may register (24 bytes each in the prepped lists): a
# 128-layer model with 64k blocks per layer and separate K/V regions fits.
MAX_DESCRIPTORS = 1 << 24


class PushService(SendSide, ReceiveSide, PeerEvents):
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
            # Read once, here at start; the file was checked when the config was loaded.
            secret=read_secret_file(config.side_channel_secret_file) if config.side_channel_secret_file else None,
        )
        metrics.watch_nixl_handles(self.nixl_handles)
        # The table gauges read the tables when scraped. Set eagerly, they went stale:
        # tables change in many places (settles, completions, cancellations), and a
        # gauge left at its last value read as a leak after every table was empty.
        for table in ("p_registrations", "p_staged", "p_writing", "d_pending"):
            metrics.table_entries.labels(table).set_function(lambda t=table: self.table_sizes()[t])
        metrics.inflight_writes.set_function(self.writes_in_flight)
        self._tasks: set[asyncio.Task] = set()
        self._retiring: list[LocalRank] = []  # replaced ranks whose WRITEs are settling
        self._generation = 0
        self._next_expiry = 0.0
        self.wake = lambda: None  # set by the progress loop

    # ================================================================ worker side

    def attach_worker(self, conn: Any, hello: wp.Hello) -> wp.Welcome:
        """A worker said hello: bind its connection to its rank, creating the agent once."""
        # A worker may name the engine it expects, or leave it empty and take the
        # daemon's (the vLLM connector does: peers know the engine by the daemon's id).
        if hello.engine_id and hello.engine_id != self.config.engine_id:
            raise ProtocolError(f"worker engine id {hello.engine_id!r} != daemon engine id {self.config.engine_id!r}")
        rank = self.ranks.get(hello.rank)
        if rank is not None and rank.conn is not None and rank.conn is not conn:
            raise ProtocolError(f"rank {hello.rank} already has a connected worker")
        if rank is not None and (rank.conn is None or rank.tp_size != hello.tp_size or rank.role != hello.role):
            # A new worker process for this rank: its KV lives in new memory, so the
            # rank gets a fresh agent under a new name and the old one retires once
            # its WRITEs settle. Peers replace the old agent when they hear of the new.
            self._retire_rank(rank, "worker replaced")
            rank = None
        if rank is None:
            self._generation += 1
            name = f"{self.config.engine_id}/r{hello.rank}/{self.daemon_id[:8]}.{self._generation}"
            rank = LocalRank(
                engine_id=self.config.engine_id,
                rank=hello.rank,
                tp_size=hello.tp_size,
                role=hello.role,
                agent=self.engine.create_agent(name),
                producer=ProducerTable(self.config.lease_s, self.config.registration_ttl_s),
                consumer=ConsumerTable(self.config.watchdog_s, hello.tp_size, self.config.peer_timeout_s),
            )
            self.ranks[hello.rank] = rank
            self.metrics.agents.set(len(self.ranks))
        rank.conn = conn
        return self.describe()

    def describe(self) -> wp.Welcome:
        return wp.Welcome(
            daemon_id=self.daemon_id,
            engine_id=self.config.engine_id,
            side_channel_host=self.config.advertised_host,
            side_channel_port=self.peers.port,
            max_frame=self.config.max_worker_frame,
        )

    def detach_worker(self, conn: Any) -> None:
        """The worker went away. Its rank, agent and memory stay until a new worker
        takes the rank (the daemon's mapping keeps the pages alive, so a late WRITE
        lands harmlessly); requests nobody can hear about any more are dropped, and P
        is asked to stop pushing the ones it knows."""
        for rank in self.ranks.values():
            if rank.conn is conn:
                rank.conn = None
                for rid in list(rank.consumer.pending):
                    self._cancel_recv(rank, rid)
                    rank.consumer.fail(rid)
                for rid in list(rank.producer.staged):
                    rank.producer.evict(rid)
                rank.registered_at.clear()
                rank.incoming.clear()
                rank.staged_at.clear()

    def register_kv(self, rank: LocalRank, msg: wp.RegisterKV, fds: list[int]) -> wp.KVRegistered:
        if rank.layout is not None:
            raise ProtocolError("KV memory is already registered for this rank")
        if not isinstance(msg.memory, wp.MemfdBuffers):
            raise ProtocolError("daemon-owned GPU arenas need a CUDA build of the daemon")
        if len(fds) != msg.memory.count:
            raise ProtocolError(f"expected {msg.memory.count} fds, got {len(fds)}")
        descriptors = sum(r.num_blocks for r in msg.regions)
        if descriptors > MAX_DESCRIPTORS:
            # Each block of each region becomes a NIXL descriptor held in memory.
            raise LayoutError(f"{descriptors} blocks across regions exceed the limit of {MAX_DESCRIPTORS}")
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
            rank.local_descs = descriptor_table(layout)
            rank.local_dlist = rank.agent.prep_local(rank.local_descs, "DRAM")
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
        if isinstance(msg, wp.RegisterRecv) and rank.role == "producer":
            raise ProtocolError("a producer worker cannot register to receive KV")
        if isinstance(msg, wp.SendReady) and rank.role == "consumer":
            raise ProtocolError("a consumer worker cannot send KV")
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
        self.wake()

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
        now = asyncio.get_running_loop().time()
        for rank in self.ranks.values():
            # D: registrations P will never serve now. A P known dead (a new incarnation
            # said hello) writes nothing more; one that went silent or closed may still
            # have a WRITE on the way, so its blocks are held until the WRITE's
            # completion or the cancel grace, never handed back while bytes may land.
            for entry in rank.consumer.waiting_on(peer.engine_id):
                if entry.state is RecvState.PENDING:
                    continue
                if peer.gone:
                    self._fail_recv(rank, entry.request_id, "peer_lost", f"P daemon {peer.engine_id} restarted")
                elif rank.consumer.orphan(entry.request_id, now) is not None:
                    log.warning("recv_held_for_lost_peer", request_id=entry.request_id, rank=rank.rank,
                                peer=peer.engine_id, until_s=round(entry.deadline - now, 3))
            # P: registrations from agents that no longer exist.
            for reg in rank.producer.drop_registrations_from(names):
                self.metrics.failures.labels("peer_lost").inc()
                log.info("registration_dropped", request_id=reg.reg.request_id, peer=peer.engine_id, reason="peer down")
            busy = {f.remote_agent for f in rank.inflight.values()}
            held = [rid for rid, f in rank.inflight.items() if f.remote_agent in names]
            if held:
                # NIXL cannot recall a posted WRITE (releasing the handle does not cancel a
                # UCX put), so these blocks stay leased until NIXL settles the WRITE: at
                # once if the peer died, when it resumes if it was only stopped.
                log.warning("writes_held", peer=peer.engine_id, rank=rank.rank, writes=len(held),
                            request_ids=held[:8])
            for name in names & set(rank.remote_dlists):
                if name in busy:
                    continue  # removed once its WRITEs settle (progress loop)
                self._unload_remote(rank, name)

    def peer_gone(self, peer: Peer) -> None:
        """The P incarnation D held blocks for is dead: no WRITE of it can land now."""
        for rank in self.ranks.values():
            for entry in rank.consumer.waiting_on(peer.engine_id):
                if entry.state is RecvState.CANCELLING and entry.reason == PEER_LOST:
                    self._fail_recv(rank, entry.request_id, PEER_LOST, f"P daemon {peer.engine_id} restarted")

    def _unload_remote(self, rank: LocalRank, name: str) -> None:
        handle = rank.remote_dlists.pop(name, None)
        rank.remote_checked.pop(name, None)
        try:
            if handle is not None:
                rank.agent.release_dlist(handle)
            rank.agent.remove_remote(name)
        except TransferError as exc:
            log.warning("remote_agent_unload_failed", rank=rank.rank, agent=name, error=str(exc))

    # ================================================================ progress

    def progress(self, now: float) -> Pace:
        """One pass over every agent: notifications, WRITE states, timers. Returns how
        soon the next pass should run (see ``progress.Pace``)."""
        for rank in list(self.ranks.values()):
            self._drain_notifs(rank)
            if rank.inflight:
                for flight in list(rank.inflight.values()):
                    state = rank.agent.state(flight.handle)
                    if state is not XferState.PROC:
                        self._settle(rank, flight, state, now)
            if not rank.inflight:
                self._unload_departed(rank)
        if self._retiring:
            self._poll_retiring(now)
        if now >= self._next_expiry:
            self._next_expiry = now + _EXPIRY_PERIOD_S
            self._expire(now)
        if any(r.hot(now, self.config.poll_hot_max_s) for r in [*self.ranks.values(), *self._retiring]):
            return Pace.HOT
        return Pace.BUSY if self._retiring or any(r.busy for r in self.ranks.values()) else Pace.IDLE

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
        for rank in self.ranks.values():
            for exp in rank.producer.expire(now):
                rank.staged_at.pop(exp.request_id, None)
                if exp.kind == "lease":
                    self.metrics.leases_expired.inc()
                    log.warning("lease_expired", request_id=exp.request_id, rank=rank.rank)
                    self._tell(rank, wp.SendFailed(request_id=exp.request_id, reason="lease expired: no registration"))
                else:
                    self.metrics.failures.labels("registration_expired").inc()
                    log.info("registration_expired", request_id=exp.request_id, peer=exp.sender)
            for rid, (entry, landed_at) in list(rank.landed.items()):
                if now - landed_at >= self.config.peer_timeout_s:
                    rank.forget_recv(rid)
                    self.metrics.verified.labels("missing").inc()
                    self.metrics.failures.labels("verify").inc()
                    log.error("verify_failed", request_id=rid, rank=rank.rank, peer=entry.remote.engine_id,
                              error="P's digests never arrived")
                    self._tell(rank, wp.RecvFailed(request_id=rid, block_ids=entry.flat_block_ids,
                                                   reason="verify: P's digests never arrived"))
            for entry in rank.consumer.expire(now):
                if entry.state is RecvState.CANCELLING and entry.request_id in rank.consumer.pending:
                    # P has the registration: its blocks are reusable only once P
                    # confirms (or its grace runs out), so ask before reporting.
                    log.warning("watchdog_expired", request_id=entry.request_id, rank=rank.rank,
                                peer=entry.remote.engine_id, phase="cancelling")
                    self.metrics.watchdog_expired.inc()
                    self._request_cancel(rank, entry)
                    continue
                rank.forget_recv(entry.request_id)
                kind = "cancel_unconfirmed" if entry.state is RecvState.CANCELLING else "watchdog"
                if entry.reason == PEER_LOST:
                    kind = PEER_LOST
                if kind == "watchdog":
                    self.metrics.watchdog_expired.inc()
                self.metrics.failures.labels(kind).inc()
                log.warning("watchdog_expired", request_id=entry.request_id, rank=rank.rank,
                            peer=entry.remote.engine_id, phase=kind)
                reason = (f"watchdog: no push within {self.config.watchdog_s}s" if entry.reason == "watchdog"
                          or entry.state is not RecvState.CANCELLING else f"{entry.reason}: P did not confirm")
                if kind == PEER_LOST:
                    reason = f"peer_lost: P daemon {entry.remote.engine_id} went away; no WRITE landed"
                self._tell(rank, wp.RecvFailed(request_id=entry.request_id, block_ids=entry.flat_block_ids,
                                               reason=reason))

    # ================================================================ misc

    def _evict(self, rank: LocalRank, rid: str) -> None:
        """Every request the daemon tracks ends in exactly one final event; eviction
        produces it too, once the request's blocks are safe to reuse."""
        if rank.producer.evict(rid):
            rank.staged_at.pop(rid, None)
            log.info("evicted", request_id=rid, rank=rank.rank)
            self._tell(rank, wp.SendFailed(request_id=rid, reason="cancelled"))
        self._cancel_recv(rank, rid)

    def _retire_rank(self, rank: LocalRank, reason: str) -> None:
        log.info("rank_retired", rank=rank.rank, agent=rank.agent.name, reason=reason, inflight=len(rank.inflight))
        self.ranks.pop(rank.rank, None)
        rank.conn = None
        # Registrations D sent to the old worker's agent will never be served: D
        # fails them now rather than at its watchdog.
        self._refuse_registrations(rank, f"P worker restarted: {reason}")
        self._retiring.append(rank)
        self._poll_retiring(asyncio.get_running_loop().time())
        self.metrics.agents.set(len(self.ranks))

    def nixl_handles(self) -> dict[str, int]:
        """Live NIXL handles over every agent, retiring ones included."""
        totals = {"registrations": 0, "dlists": 0, "xfers": 0, "remote_agents": 0}
        for rank in [*self.ranks.values(), *self._retiring]:
            for kind, n in rank.agent.handles().items():
                totals[kind] = totals.get(kind, 0) + n
        return totals

    def _refuse_registrations(self, rank: LocalRank, reason: str) -> None:
        """Drop the D registrations ``rank`` holds unmatched and tell each D now."""
        senders = {r.sender for r in rank.producer.registrations.values()}
        for reg in rank.producer.drop_registrations_from(senders):
            peer = self.peers.find_agent(reg.sender)
            if peer is not None:
                self.peers.send(peer, pp.PushFailed(request_id=reg.reg.request_id, rank=reg.reg.decode_rank,
                                                    reason=reason))

    def writes_in_flight(self) -> int:
        return sum(len(r.inflight) for r in [*self.ranks.values(), *self._retiring])

    def _poll_retiring(self, now: float) -> None:
        for rank in list(self._retiring):
            for flight in list(rank.inflight.values()):
                state = rank.agent.state(flight.handle)
                if state is not XferState.PROC:
                    self._settle(rank, flight, state, now)
            if not rank.inflight:
                self._retiring.remove(rank)
                self._close_rank(rank)

    @staticmethod
    def _close_rank(rank: LocalRank) -> None:
        for flight in rank.inflight.values():
            try:
                rank.agent.release(flight.handle)
            except TransferError:
                pass
        rank.inflight.clear()
        rank.agent.close()
        for b in rank.buffers:
            b.close()
        rank.buffers.clear()

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
        # D learns now which of its registrations will never be written (their blocks
        # are free at once); those with a WRITE still in flight it holds for its grace.
        for rank in self.ranks.values():
            self._refuse_registrations(rank, "P daemon shutting down")
        await self.peers.close()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for rank in [*self.ranks.values(), *self._retiring]:
            self._close_rank(rank)
        self.ranks.clear()
        self._retiring.clear()

    def __repr__(self) -> str:
        return f"<PushService {self.config.engine_id} ranks={sorted(self.ranks)} {self.table_sizes()}>"
