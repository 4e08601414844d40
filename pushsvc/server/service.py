"""The push service: routes worker messages, NIXL notifications and side-channel events
to the side that owns them, and runs one progress pass over every agent.

It owns the ranks (``ranks.py``: agent, memory, connection per worker rank) and composes
the two sides, each built with its collaborators: ``Sender`` (P: matching, WRITEs) and
``Receiver`` (D: registrations, completions). Both tell workers through one ``Outbox``
and reach peers through the ``PeerManager``. Decisions live in the pure tables
(``state/``); everything here runs on the daemon's one event loop.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import structlog

from pushsvc.config import MiB, Config, read_secret_file
from pushsvc.devmem.base import DeviceMemory
from pushsvc.engine.base import Engine
from pushsvc.errors import ProtocolError, TransferError
from pushsvc.metrics import Metrics
from pushsvc.peer_hosts import PeerHostPolicy
from pushsvc.protocol import notif
from pushsvc.protocol import peer as pp
from pushsvc.protocol import worker as wp
from pushsvc.server.ipcpush import IPC_FENCE_S, IpcTargets, host_id
from pushsvc.server.outbox import Outbox
from pushsvc.server.peers import Peer, PeerManager, PeerSettings
from pushsvc.server.progress import Pace
from pushsvc.server.joints import Joint, Joints
from pushsvc.server.kvmemory import MemorySettings, map_kv
from pushsvc.server.ranks import Rank, RankRegistry, WorkerLink
from pushsvc.server.receiver import ReceiveSettings, Receiver
from pushsvc.server.remotes import RemoteAgents
from pushsvc.server.sender import Sender, SendSettings
from pushsvc.server.tasks import TaskSet
from pushsvc.server.timelines import Timelines
from pushsvc.state import tp
from pushsvc.state.stages import keys
from pushsvc.state.layout import MAX_DESCRIPTORS

log = structlog.get_logger("pushsvc.service")

_EXPIRY_PERIOD_S = 0.05
_TABLES = ("p_registrations", "p_staged", "p_writing", "d_pending", "inflight")


class PushService:
    def __init__(self, config: Config, engine: Engine, metrics: Metrics, daemon_id: str | None = None, *,
                 devmem: DeviceMemory | None = None) -> None:
        self.config = config
        self.engine = engine
        self.devmem = devmem
        self._host = host_id() if config.ipc_push == "auto" else ""  # same-host push offered and taken
        self._memory_settings = MemorySettings(landing_bytes=config.landing_mib * MiB,
                                               staging_bytes=config.staging_mib * MiB, ipc_host=self._host)
        self.metrics = metrics
        self.daemon_id = daemon_id or uuid.uuid4().hex
        self.ranks = RankRegistry()
        self.draining = False
        self._tasks = TaskSet("service")
        self._generation = 0
        self._next_expiry = 0.0
        self.wake: Callable[[], None] = lambda: None  # set by the progress loop
        self.peers = PeerManager(
            daemon_id=self.daemon_id,
            engine_id=config.engine_id,
            advertised_host=config.advertised_host,
            local_agents=self.agent_infos,
            events=self,
            metrics=metrics,
            settings=PeerSettings(config.max_peer_frame, config.handshake_timeout_s, config.heartbeat_interval_s,
                                  config.peer_timeout_s, config.ucx_error_handling_mode),
            # Read once, here at start; the file was checked when the config was loaded.
            secret=read_secret_file(config.side_channel_secret_file) if config.side_channel_secret_file else None,
            # D dials the P a client's kv_transfer_params name, P the D that registered:
            # only hosts the operator listed (loopback when none).
            allowed_host=PeerHostPolicy.build(config.allowed_peer_hosts).allows,
        )
        # A worker whose connection broke has its requests' events kept this long for it.
        self.timelines = timelines = Timelines(metrics, config.timelines_kept)
        self.outbox = outbox = Outbox(self.ranks, metrics, keep_s=max(config.watchdog_s, config.lease_s),
                                      timelines=timelines)
        self.sender = Sender(settings=SendSettings.of(config), outbox=outbox, peers=self.peers, metrics=metrics,
                             tasks=self._tasks, drain=self.drain_notifs, wake=self._wake, timelines=timelines)
        self.joints = Joints(engine=engine, engine_id=config.engine_id, daemon_id=self.daemon_id, tell=outbox.tell)
        self.receiver = Receiver(settings=ReceiveSettings.of(config, self.daemon_id), outbox=outbox,
                                 peers=self.peers, metrics=metrics, tasks=self._tasks, wake=self._wake,
                                 timelines=timelines, joints=self.joints)
        metrics.watch_nixl_handles(self.nixl_handles)
        metrics.watch_tables(self.table_sizes)
        metrics.inflight_writes.set_function(self.writes_in_flight)
        if devmem is not None:
            metrics.watch_gpu(devmem.usage, self.receiver.landing.slot_counts)

    def _wake(self) -> None:
        self.wake()

    # ================================================================ workers

    def attach_worker(self, conn: WorkerLink, hello: wp.Hello) -> tuple[Rank, wp.Welcome]:
        """A worker said hello: give its rank a fresh agent (a previous one retires)."""
        # A worker may name the engine it expects, or leave it empty and take the
        # daemon's (the vLLM connector does: peers know the engine by the daemon's id).
        if hello.engine_id and hello.engine_id != self.config.engine_id:
            raise ProtocolError(f"worker engine id {hello.engine_id!r} != daemon engine id {self.config.engine_id!r}")
        if hello.rank >= hello.tp_size:
            raise ProtocolError(f"rank {hello.rank} is not below the TP size {hello.tp_size}")
        if hello.pp_rank >= hello.pp_size:
            raise ProtocolError(f"pipeline stage {hello.pp_rank} is not below the PP size {hello.pp_size}")
        if hello.pp_size > 1 and hello.role != "producer":
            raise ProtocolError(f"a {hello.role} worker of pipeline stage {hello.pp_rank} of {hello.pp_size}: "
                                "only a prefill (producer) engine may be pipeline-parallel (decode-side PP is "
                                "not supported)")
        slot = hello.pp_rank * hello.tp_size + hello.rank
        others = [r for r in self.ranks.current.values() if r.source != slot]
        if others and (others[0].tp_size, others[0].stages) != (hello.tp_size, hello.pp_size):
            o = others[0]
            raise ProtocolError(f"TP {hello.tp_size} x PP {hello.pp_size} differs from rank {o.number}'s TP "
                                f"{o.tp_size} x PP {o.stages}; one daemon serves one engine (run one daemon per "
                                "data-parallel rank)")
        old = self.ranks.current.get(slot)
        if old is not None and old.conn is not None:
            where = f"rank {hello.rank}" + (f" of stage {hello.pp_rank}" if hello.pp_size > 1 else "")
            raise ProtocolError(f"{where} already has a connected worker (pid {old.pid}); "
                                "data-parallel engines need one daemon per engine")
        if old is not None:
            self._retire(old, "worker replaced")
        self._generation += 1
        place = f"p{hello.pp_rank}r{hello.rank}" if hello.pp_size > 1 else f"r{hello.rank}"
        name = f"{self.config.engine_id}/{place}/{self.daemon_id[:8]}.{self._generation}"
        agent = self.engine.create_agent(name)
        # The kernel's word for the worker's pid (SO_PEERCRED), not the hello's: a process
        # that reconnects is recognised by it (``RankRegistry.successor``).
        remotes = RemoteAgents(agent, MAX_DESCRIPTORS, prepare=hello.role != "consumer", rank=hello.rank,
                               tp_size=hello.tp_size, stages=hello.pp_size)
        rank = Rank(hello.rank, hello.tp_size, hello.role, conn.pid, agent, remotes, conn=conn,
                    stage=hello.pp_rank, stages=hello.pp_size)
        self.ranks.current[slot] = rank
        self.metrics.agents.set(len(self.ranks.current))
        self.outbox.attached(rank)
        return rank, self.describe()

    def describe(self) -> wp.Welcome:
        return wp.Welcome(daemon_id=self.daemon_id, engine_id=self.config.engine_id,
                          side_channel_host=self.config.advertised_host, side_channel_port=self.peers.port,
                          max_frame=self.config.max_worker_frame)

    def detach_worker(self, rank: Rank) -> None:
        """The worker went away. Its staged P blocks are released; its D registrations
        are withdrawn, those P may be writing into held until P confirms. The rank
        retires: its agent and mapping stay until nothing of it is in flight (a late
        WRITE lands in live pages), and events of its requests reach the same worker
        process if it connects again."""
        if rank.conn is None:
            return
        rank.conn = None
        self.sender.worker_detached(rank)
        self.receiver.worker_detached(rank)
        if self.ranks.current.get(rank.source) is rank:
            self._retire(rank, "worker disconnected")

    def register_kv(self, rank: Rank, msg: wp.RegisterKV, fds: list[int]) -> wp.KVRegistered:
        if rank.memory is not None:
            raise ProtocolError("KV memory is already registered for this rank")
        rank.memory = memory = map_kv(msg, fds, agent=rank.agent, role=rank.role, devmem=self.devmem,
                                      settings=self._memory_settings)
        rank.remotes.layers = keys(r.layer_names for r in msg.regions)  # used by a pipeline stage's rank
        if rank.role == "producer" and self._host and memory.vram is not None and rank.stages == 1:
            # copies into same-host Ds' KV itself (a layer-wise request once its last layer is final)
            rank.remotes.ipc = IpcTargets(memory.vram, memory.layout, self._host, self.metrics.failures)
        slots = memory.landing.geometry.slots if memory.landing is not None else 0
        if slots:
            self.receiver.landing.attach(rank)
        log.info("kv_registered", rank=rank.number, agent=rank.agent.name, regions=len(msg.regions),
                 bytes=memory.nbytes, mem_type=memory.mem_type, landing_slots=slots)
        # Peers that already know us learn about the new agent; we learn theirs.
        built = self._rebuild_joints() if rank.role != "producer" else []
        self.peers.announce([rank.agent_info(), *(j.agent_info() for j in built)])
        for peer in list(self.peers.peers.values()):
            self._load_agents(peer, list(peer.agents.values()), [rank, *built])
        return wp.KVRegistered(agent_name=rank.agent.name, regions=len(msg.regions), bytes=memory.nbytes,
                               mem_type=memory.mem_type if rank.conn is None or rank.conn.minor >= 2 else "",
                               landing_slots=slots if rank.conn is None or rank.conn.minor >= 2 else 0)

    def on_worker_message(self, rank: Rank, msg: wp.WorkerMessage) -> None:
        self.metrics.worker_messages.labels(type(msg).__name__).inc()
        if isinstance(msg, wp.RegisterRecv):
            if rank.role == "producer":
                raise ProtocolError("a producer worker cannot register to receive KV")
            if self.draining:
                self._refuse(rank, wp.RecvFailed(request_id=msg.request_id, block_ids=[
                    b for g in msg.local_block_ids for b in g], reason="daemon shutting down"))
            else:
                self.receiver.on_register_recv(rank, msg, self._predecessors(rank))
        elif isinstance(msg, (wp.SendReady, wp.SendStart)):
            if rank.role == "consumer":
                raise ProtocolError("a consumer worker cannot send KV")
            if self.draining:
                self._refuse(rank, wp.SendFailed(request_id=msg.request_id, reason="daemon shutting down"))
            else:
                self.sender.on_send_ready(rank, msg)
        elif isinstance(msg, (wp.LayerSaved, wp.StepSaved)):
            if rank.role == "consumer":
                raise ProtocolError("a consumer worker cannot send KV")
            if isinstance(msg, wp.LayerSaved):
                self.sender.layerwise.layer_saved(rank, msg.step, msg.layer)
            else:
                self.sender.layerwise.step_saved(rank, msg.step)
        elif isinstance(msg, wp.Evict):
            ranks = [rank, *self._predecessors(rank)]
            for rid in msg.request_ids:
                for r in ranks:
                    self.sender.evict(r, rid)
                self.receiver.evict(ranks, rid)
        elif isinstance(msg, wp.Ping):
            if rank.conn is not None:
                rank.conn.send(wp.Pong(token=msg.token))
        elif isinstance(msg, wp.Reported):
            for r in [rank, *self.joints.containing(rank)]:  # a joint's requests are its members' too
                self.timelines.reported(r, msg)
            return  # nothing changed that the loop must act on
        else:
            raise ProtocolError(f"unexpected {type(msg).__name__}")
        self.wake()

    @staticmethod
    def _refuse(rank: Rank, event: wp.DaemonMessage) -> None:
        if rank.conn is not None:
            rank.conn.send(event)

    def _predecessors(self, rank: Rank) -> list[Rank]:
        """Retiring ranks of the same worker process (it reconnected): their requests
        are this worker's too."""
        return [r for r in self.ranks.retiring if r.source == rank.source and r.pid and r.pid == rank.pid]

    def _retire(self, rank: Rank, reason: str) -> None:
        log.info("rank_retired", rank=rank.number, agent=rank.agent.name, reason=reason)
        if self.ranks.current.get(rank.source) is rank:
            del self.ranks.current[rank.source]
        rank.conn = None
        if rank.memory is not None and rank.memory.ipc is not None:  # P daemons let go of its worker's KV
            for peer in self.peers.peers.values():
                if rank.agent.name in peer.ipc_ready:
                    peer.ipc_ready.discard(rank.agent.name)
                    self.peers.send(peer, pp.IpcWithdrawn(agent_name=rank.agent.name))
        # Registrations D sent to the old worker's agent will never be served: D
        # fails them now rather than at its watchdog.
        self.sender.refuse_registrations(rank, f"P worker restarted: {reason}")
        self.ranks.retiring.append(rank)
        self.metrics.agents.set(len(self.ranks.current))
        if rank.role != "producer":
            for joint in self.joints.rebuild(self.ranks)[1]:  # the joints it was a member of retire
                self.receiver.joint_retired(joint)
        self._close_settled()

    def _rebuild_joints(self) -> list[Rank]:
        """Joint agents over D's ranks (D TP above P's, ``joints.py``) for the ranks as
        they are now: the new ones (their peers learn them from the caller)."""
        built, retired = self.joints.rebuild(self.ranks)
        for joint in retired:
            self.receiver.joint_retired(joint)
        if retired:
            self._close_settled()
        return list(built)

    def _close_settled(self) -> None:
        for joint in [j for j in self.joints.retiring if self.receiver.settled(j)]:
            self.receiver.forget(joint)
            self.timelines.forget(joint)
            self.joints.close(joint)
        for rank in [r for r in self.ranks.retiring if self.sender.settled(r) and self.receiver.settled(r)
                     and not self.joints.uses(r)]:
            self.ranks.retiring.remove(rank)
            self._close(rank)

    def _close(self, rank: Rank) -> None:
        self.sender.forget(rank)
        self.receiver.forget(rank)
        self.timelines.forget(rank)
        rank.close()

    # ================================================================ peer events

    def agent_infos(self) -> list[pp.AgentInfo]:
        return [*(r.agent_info() for r in self.ranks.current.values() if r.ready),
                *(j.agent_info() for j in self.joints.current.values())]

    def peer_up(self, peer: Peer) -> None:
        self.sender.intake.peer_up(peer)
        self.receiver.peer_up(peer)

    def agents_announced(self, peer: Peer, agents: list[pp.AgentInfo]) -> None:
        self._load_agents(peer, agents, [*(r for r in self.ranks.all() if r.ready), *self.joints.all()])
        self.sender.intake.agents_known(peer, {a.agent_name for a in agents})

    def _load_agents(self, peer: Peer, agents: list[pp.AgentInfo], ranks: list[Rank]) -> None:
        # A rank loads only the peer's agents it pairs with: rank r with the peer's rank r
        # at equal TP; with P TP = k x D TP, D rank j with P ranks jk..jk+k-1; with D TP
        # above P's, P rank i with D's joint agent i, which stands at P's TP (``state/tp``).
        # A same-host D's worker KV is mapped only where its heartbeats keep P's fence open.
        map_kv = peer.heartbeat_interval_s <= IPC_FENCE_S / 2
        for rank in ranks:
            joint = isinstance(rank, Joint)
            for info in agents:
                if joint and info.tp_size != rank.tp_size:
                    continue
                if tp.pairs(rank.number, rank.tp_size, info.rank, info.tp_size) and tp.direct(
                        rank.role, rank.tp_size, info.tp_size, info.members) and rank.remotes.load(info, map_kv):
                    self.peers.send(peer, pp.IpcReady(agent_name=info.agent_name))  # D may now ask

    def peer_down(self, peer: Peer) -> None:
        self.receiver.peer_down(peer)
        busy = self.sender.peer_down(peer)
        for rank in [*self.ranks.all(), *self.joints.all()]:
            for name in set(peer.agents) - busy:
                rank.remotes.unload(name)  # the busy ones once their WRITEs settle (progress)

    def peer_gone(self, peer: Peer) -> None:
        self.receiver.peer_gone(peer)

    def _d_ranks(self, number: int) -> list[Rank]:
        """D's ranks a message from P about D rank ``number`` may be for: the ranks of
        that number and the joint agents of that number (each has its own requests)."""
        return [*self.ranks.numbered(number), *self.joints.numbered(number)]

    def push_failed(self, peer: Peer, msg: pp.PushFailed) -> None:
        self.receiver.push_failed(peer, msg, self._d_ranks(msg.rank))

    def cancel_push(self, peer: Peer, msg: pp.CancelPush) -> None:
        self.sender.cancel_push(peer, msg, self.ranks.numbered(pp.source_rank(msg)))  # the P rank's source id

    def push_cancelled(self, peer: Peer, msg: pp.PushCancelled) -> None:
        self.receiver.push_cancelled(peer, msg, self._d_ranks(msg.rank))

    def write_started(self, peer: Peer, msg: pp.WriteStarted) -> None:
        self.receiver.write_started(peer, msg, self._d_ranks(msg.rank))

    def reg_sent(self, peer: Peer, msg: pp.RegSent) -> None:
        """D sent a registration's PUSH_REGs: any of this engine's P ranks may hold the
        blocks it is for (P TP may differ from D's), so each is asked."""
        self.sender.reg_sent(peer, msg, list(self.ranks.current.values()))

    def ipc_ready(self, peer: Peer, msg: pp.IpcReady) -> None:
        """P mapped the worker KV of our agent ``msg.agent_name``: that rank's registrations
        with P may ask P to copy into it (``PushReg.ipc``). Only a current agent of ours that
        offered its KV counts; for any other P hears ``IpcWithdrawn`` at once (a rank that
        retired while P's word was on its way: P must not keep its worker's memory)."""
        if any(r.agent.name == msg.agent_name and r.memory is not None and r.memory.ipc is not None
               for r in self.ranks.current.values()):
            peer.ipc_ready.add(msg.agent_name)
            log.info("ipc_ready", peer=peer.engine_id, agent=msg.agent_name)
            return
        self.peers.send(peer, pp.IpcWithdrawn(agent_name=msg.agent_name))
        if not any(r.agent.name == msg.agent_name for r in self.ranks.retiring):
            self.metrics.malformed.labels("side_channel", "ipc_ready").inc()
            log.warning("malformed_input", source="side_channel", reason="ipc_ready", peer=peer.engine_id,
                        error=f"IpcReady for {msg.agent_name[:200]!r}, which offered no KV")

    def ipc_withdrawn(self, peer: Peer, msg: pp.IpcWithdrawn) -> None:
        """D retired its agent ``msg.agent_name``: its worker KV is unmapped once no copy
        into it is in flight (``progress``)."""
        if msg.agent_name not in peer.agents:  # only a peer's own agents
            self.metrics.malformed.labels("side_channel", "ipc_withdrawn").inc()
            return
        for rank in self.ranks.all():
            if rank.remotes.ipc is not None:
                rank.remotes.ipc.withdraw(msg.agent_name)
        log.info("ipc_withdrawn", peer=peer.engine_id, agent=msg.agent_name)

    # ================================================================ progress

    def progress(self, now: float) -> Pace:
        """One pass over every agent: notifications, WRITE states, timers. Returns how
        soon the next pass should run (see ``progress.Pace``)."""
        ranks = self.ranks.all()
        for rank in ranks:
            self.drain_notifs(rank)
            self.sender.poll(rank)
        joints = self.joints.all()
        for joint in joints:
            self.drain_notifs(joint)
        ranks = [*ranks, *joints]
        self.receiver.poll()
        for rank in ranks:
            busy = self.sender.writes_to(rank)
            if rank.remotes.ipc is not None:
                rank.remotes.ipc.reap(busy)
            for name in rank.remotes.names():
                if name not in busy and self.peers.find_agent(name) is None:
                    rank.remotes.unload(name)
        if self.ranks.retiring or self.joints.retiring:
            self._close_settled()
        if now >= self._next_expiry:
            self._next_expiry = now + _EXPIRY_PERIOD_S
            self.sender.expire(now)
            self.receiver.expire(now)
            self.outbox.expire(now)
        hot_max = self.config.poll_hot_max_s
        if any(self.sender.hot(r, now, hot_max) or self.receiver.hot(r, now, hot_max) for r in ranks):
            return Pace.HOT
        if self.ranks.retiring or self.joints.retiring or any(self.sender.busy(r) or self.receiver.busy(r)
                                                               for r in ranks):
            return Pace.BUSY
        return Pace.IDLE

    def drain_notifs(self, rank: Rank) -> None:
        try:
            batches = rank.agent.notifs()
        except TransferError as exc:
            log.error("notif_poll_failed", rank=rank.number, error=str(exc))
            return
        for sender, payloads in batches.items():
            for payload in payloads:
                if not notif.is_push_reg(payload):
                    self.receiver.on_completion(rank, sender, payload)
                elif isinstance(rank, Joint):  # nobody registers with D
                    self.metrics.malformed.labels("notification", "push_reg_to_joint").inc()
                else:
                    self.sender.intake.on_push_reg(rank, sender, payload)

    # ================================================================ views

    def nixl_handles(self) -> dict[str, int]:
        """Live NIXL handles over every agent, retiring ones included."""
        totals = {"registrations": 0, "dlists": 0, "xfers": 0, "remote_agents": 0}
        for rank in [*self.ranks.all(), *self.joints.all()]:
            for kind, n in rank.agent.handles().items():
                totals[kind] = totals.get(kind, 0) + n
        return totals

    def table_sizes(self) -> dict[str, int]:
        totals = dict.fromkeys(_TABLES, 0)
        for rank in [*self.ranks.all(), *self.joints.all()]:
            for k, v in {**self.sender.sizes(rank), **self.receiver.sizes(rank)}.items():
                totals[k] += v
        return totals

    def tracking(self) -> bool:
        """A request is tracked here (a registration, staged blocks, a WRITE, a D
        registration): what busy polling spins for."""
        return any(self.table_sizes().values())

    def writes_in_flight(self) -> int:
        return self.sender.writes_in_flight()

    def drained(self) -> bool:
        """Nothing may land in or leave our memory any more: no WRITE in flight on P,
        no registration on D that P may still write into."""
        return not self.sender.writes_in_flight() and not self.receiver.unsettled()

    async def close(self) -> None:
        # D learns now which of its registrations will never be written (their blocks
        # are free at once); those with a WRITE still in flight it holds for its grace.
        for rank in self.ranks.all():
            self.sender.refuse_registrations(rank, "P daemon shutting down")
        await self.peers.close()
        await self._tasks.cancel()
        for joint in self.joints.all():  # the members' events go to their workers, still attached
            joint.agent.close()
            self.receiver.joint_retired(joint, "daemon shutting down")
            self.receiver.abandon(joint, "daemon shutting down")
            self.receiver.forget(joint)
            self.joints.close(joint)
        self.joints.current.clear()
        for rank in self.ranks.all():
            rank.agent.close()  # from here on nothing can land in, or leave, its memory
            # ... so what is still tracked can be reported ended, not left to the
            # worker to guess at from a closed socket.
            self.sender.abandon(rank, "daemon shutting down")
            self.receiver.abandon(rank, "daemon shutting down")
            self._close(rank)
        self.ranks.current.clear()
        self.ranks.retiring.clear()

    def __repr__(self) -> str:
        return f"<PushService {self.config.engine_id} ranks={sorted(self.ranks.current)} {self.table_sizes()}>"

