"""Daemon <-> daemon side channel: who the peers are, their sessions, their liveness.

``PeerManager`` is the handshake cache and the registry of peer incarnations (a peer is
one start of a remote daemon: a new ``daemon_id`` is a new incarnation). Concurrent
callers of ``ensure`` for one address share one dial; a live session answers at once.
Sessions stay open: heartbeats prove liveness both ways, and P uses the session D
opened to tell D at once when it cannot WRITE a registration. Handshake details are in
``handshake.py``, one connection's I/O in ``session.py``.

What a stranger can make it hold is bounded: concurrent handshakes and sessions, and (in
``peer_agents.py``, which says who speaks for which agent) agents per peer, remembered
departed agents and lost incarnations. Without authentication a
hello proves nothing, so an unauthenticated newcomer cannot displace a live peer of the
same engine id, and never makes a lost one count as dead.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import structlog

from pushsvc.errors import AuthError, HandshakeError, MalformedInput, ProtocolError
from pushsvc.metrics import Metrics
from pushsvc.peer_hosts import PeerHostPolicy
from pushsvc.protocol import peer as pp
from pushsvc.protocol.framing import CountingDecoder
from pushsvc.server.handshake import PeerIntro, handshake
from pushsvc.server.peer_agents import AgentBook
from pushsvc.server.remotes import layout_of_agent
from pushsvc.server.session import Session
from pushsvc.server.tasks import TaskSet
from pushsvc.state.layout import Layout

log = structlog.get_logger("pushsvc.peers")

# Handshakes in progress at once, each way, and sessions held: far above what a
# deployment needs (one or two sessions per peer daemon), low enough that a connect
# flood costs a bounded amount of memory.
MAX_HANDSHAKES = 64
MAX_SESSIONS = 1024


@dataclass(eq=False)
class Peer:
    """A remote daemon incarnation and what it told us."""

    daemon_id: str
    engine_id: str
    host: str
    port: int
    minor: int = 0  # its side-channel minor: which fields we may send it
    authenticated: bool = False
    agents: dict[str, pp.AgentInfo] = field(default_factory=dict)  # by agent name
    sessions: set[Session] = field(default_factory=set)
    heartbeat_interval_s: float = 1.0
    # Known dead: an authenticated new incarnation of its engine said hello. A peer that
    # only went silent or closed its sessions may still have WRITEs on the way.
    gone: bool = False
    # Woken when it announces agents or loses its last session (``PeerManager.announced``).
    waiters: list[asyncio.Future[None]] = field(default_factory=list)
    heard_at: float = 0.0  # time.monotonic() when a session last read a frame of it
    # Our agents whose worker KV it mapped to copy into itself (same-host push, ``IpcReady``).
    ipc_ready: set[str] = field(default_factory=set)
    # Agent name -> (the announcement, its layout): made once per announcement.
    _described: dict[str, tuple[pp.AgentInfo, Layout]] = field(default_factory=dict, repr=False)

    def described(self, name: str) -> Layout:
        """The layout agent ``name`` announced (every ``PUSH_REG`` of it is checked against
        it), made once per announcement; those of agents no longer announced are dropped."""
        info = self.agents[name]
        kept = self._described.get(name)
        if kept is None or kept[0] is not info:
            if len(self._described) >= len(self.agents):
                self._described = {n: k for n, k in self._described.items() if self.agents.get(n) is k[0]}
            kept = self._described[name] = (info, layout_of_agent(info))
        return kept[1]

    def agent_for(self, rank: int, tp_size: int, stage: int = 0) -> pp.AgentInfo | None:
        """The agent it announced for TP rank ``rank`` of ``tp_size`` in pipeline ``stage``."""
        for info in self.agents.values():
            if info.rank == rank and info.tp_size == tp_size and info.stage == stage:
                return info
        return None

    @property
    def alive(self) -> bool:
        return bool(self.sessions)

    def __repr__(self) -> str:
        return (f"<Peer {self.engine_id} id={self.daemon_id[:8]} {self.host}:{self.port} 1.{self.minor} "
                f"agents={len(self.agents)} sessions={len(self.sessions)}>")


class PeerEvents(Protocol):
    """What the push service hears from the side channel. Every handler is required:
    a misspelled one is an error, not a silent no-op."""

    def peer_up(self, peer: Peer) -> None:
        """A session with this incarnation began (its first, or one after it was lost)."""
    def agents_announced(self, peer: Peer, agents: list[pp.AgentInfo]) -> None:
        """Agents the peer announced (in its hello or later), new or changed."""
    def peer_down(self, peer: Peer) -> None:
        """The peer's last session ended: lost, or (``peer.gone``) known dead."""
    def peer_gone(self, peer: Peer) -> None: ...
    def push_failed(self, peer: Peer, msg: pp.PushFailed) -> None: ...
    def cancel_push(self, peer: Peer, msg: pp.CancelPush) -> None: ...
    def push_cancelled(self, peer: Peer, msg: pp.PushCancelled) -> None: ...
    def write_started(self, peer: Peer, msg: pp.WriteStarted) -> None: ...
    def reg_sent(self, peer: Peer, msg: pp.RegSent) -> None: ...
    def ipc_ready(self, peer: Peer, msg: pp.IpcReady) -> None: ...
    def ipc_withdrawn(self, peer: Peer, msg: pp.IpcWithdrawn) -> None: ...


class PeerLink(Protocol):
    """What the sending and receiving sides use of the side channel."""

    @property
    def port(self) -> int: ...
    def find_agent(self, agent_name: str) -> Peer | None: ...
    def find_engine(self, engine_id: str) -> Peer | None: ...
    async def ensure(self, host: str, port: int, engine_id: str) -> Peer: ...
    async def announced(self, peer: Peer, ready: Callable[[Peer], bool]) -> bool: ...
    def send(self, peer: Peer, msg: msgspec.Struct) -> bool: ...
    def departed(self, agent_name: str) -> bool: ...
    def live_daemons(self) -> Container[str]: ...


# Whether a host name, resolved to these addresses, may be dialed (``peer_hosts``).
HostPolicy = Callable[[str, Sequence[str]], bool]
LOOPBACK_ONLY: HostPolicy = PeerHostPolicy.build([]).allows


@dataclass(frozen=True, slots=True)
class PeerSettings:
    max_frame: int
    handshake_timeout_s: float
    heartbeat_interval_s: float
    peer_timeout_s: float
    ucx_error_handling_mode: str = "peer"  # sent in the hello; a peer of another mode is refused


class PeerManager:
    def __init__(self, *, daemon_id: str, engine_id: str, advertised_host: str,
                 local_agents: Callable[[], list[pp.AgentInfo]], events: PeerEvents, metrics: Metrics,
                 settings: PeerSettings, secret: bytes | None = None,
                 allowed_host: HostPolicy = LOOPBACK_ONLY) -> None:
        self.daemon_id = daemon_id
        self.engine_id = engine_id
        self.advertised_host = advertised_host
        self._port = 0
        self._local_agents = local_agents
        self._events = events
        self._metrics = metrics
        self._settings = settings
        self._frames = CountingDecoder(pp.peer_decoder, source="side_channel", max_frame=settings.max_frame,
                                       malformed=metrics.malformed)
        # With a secret, no hello (no metadata) goes out before the peer proved it knows it.
        self._secret = secret or None
        self._allowed_host = allowed_host
        self.peers: dict[str, Peer] = {}  # by daemon_id
        self._by_engine: dict[str, Peer] = {}
        self.agents = AgentBook()
        self._dialing: dict[tuple[str, int], asyncio.Future[Peer]] = {}
        self._accepting: set[Session] = set()  # accepted, handshake in progress
        self._sessions = 0
        self._tasks = TaskSet("peers")
        self._server: asyncio.AbstractServer | None = None
        self._closing = False

    @property
    def port(self) -> int:
        return self._port

    # ------------------------------------------------------------------ listening

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._accept, host, port, limit=1 << 16)
        self._port = self._server.sockets[0].getsockname()[1]
        return self._port

    async def close(self) -> None:
        self._closing = True
        if self._server is not None:
            self._server.close()
        for peer in list(self.peers.values()):
            for s in list(peer.sessions):
                s.send(pp.Goodbye(reason="shutdown"))
                s.close()
        for session in list(self._accepting):
            session.close()  # their handshakes end at once (the server does not track them)
        for fut in self._dialing.values():
            fut.cancel()
        await self._tasks.cancel()
        if self._server is not None:
            await self._server.wait_closed()

    def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, dialed: bool) -> Session:
        # A session may have to buffer one of our hellos (every agent's metadata) and then
        # some messages; beyond that, its peer is not reading.
        return Session(reader, writer, dialed=dialed, frames=self._frames, max_buffered=2 * self._settings.max_frame)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        refusal = ("closing" if self._closing else "too_many_handshakes" if len(self._accepting) >= MAX_HANDSHAKES
                   else "too_many_sessions" if self._sessions >= MAX_SESSIONS else "")
        if refusal:
            self._metrics.rejected_connections.labels("side_channel", refusal).inc()
            writer.close()
            return
        session = self._session(reader, writer, dialed=False)
        self._accepting.add(session)
        try:
            intro = await asyncio.wait_for(self._introduce(session), self._settings.handshake_timeout_s)
            peer = self._adopt(session, intro)
        except (ProtocolError, HandshakeError, OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            reason = exc.reason if isinstance(exc, AuthError) else type(exc).__name__
            if isinstance(exc, AuthError):
                self._metrics.handshakes.labels(exc.reason).inc()
            self._metrics.rejected_connections.labels("side_channel", reason).inc()
            log.warning("peer_handshake_rejected", phase="accept", reason=reason, error=str(exc),
                        peer=session.peer_name)
            session.close()
            return
        finally:
            self._accepting.discard(session)
        self._metrics.handshakes.labels("accepted").inc()
        await self._run_session(session, peer)

    async def _introduce(self, session: Session, expect_engine: str = "") -> PeerIntro:
        def hello() -> pp.PeerHello:
            # Sent before the peer's preamble may be read: joint agents (1.6) follow in an
            # AgentsUpdate once the peer's minor is known.
            mine = self._my_hello()
            mine = msgspec.structs.replace(mine, agents=pp.announceable(mine.agents, 0))
            session.announced = list(mine.agents)
            return mine

        return await handshake(session, daemon_id=self.daemon_id, my_hello=hello, secret=self._secret,
                               expect_engine=expect_engine)

    # ------------------------------------------------------------------ dialing

    def find_engine(self, engine_id: str) -> Peer | None:
        peer = self._by_engine.get(engine_id)
        return peer if peer is not None and peer.alive else None

    def find_agent(self, agent_name: str) -> Peer | None:
        return self.agents.owner(agent_name)

    def live_daemons(self) -> set[str]:
        return {d for d, p in self.peers.items() if p.alive}

    async def ensure(self, host: str, port: int, engine_id: str) -> Peer:
        """A live peer of ``engine_id`` at host:port; dial if needed."""
        peer = self.find_engine(engine_id)
        if peer is not None:
            return peer
        key = (host, port)
        fut = self._dialing.get(key)
        if fut is None:
            if len(self._dialing) >= MAX_HANDSHAKES:
                raise HandshakeError(f"{len(self._dialing)} handshakes already in progress")
            fut = asyncio.get_running_loop().create_future()
            self._dialing[key] = fut
            self._tasks.spawn(self._dial(host, port, engine_id, fut))
        peer = await asyncio.shield(fut)
        if peer.engine_id != engine_id:
            raise HandshakeError(f"{host}:{port} is engine {peer.engine_id}, expected {engine_id}")
        return peer

    async def announced(self, peer: Peer, ready: Callable[[Peer], bool]) -> bool:
        """Whether ``ready(peer)`` holds, waiting for it as long as a handshake may take.

        A daemon that just started says hello before its workers registered: the agents
        come in an ``AgentsUpdate`` moments later. What needs one of them waits for it
        here; it stops waiting when the peer loses its last session."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._settings.handshake_timeout_s
        while not ready(peer):
            left = deadline - loop.time()
            if left <= 0 or not peer.alive:
                return False
            woken: asyncio.Future[None] = loop.create_future()
            peer.waiters.append(woken)
            try:
                await asyncio.wait_for(woken, left)
            except TimeoutError:
                pass
            finally:
                if woken in peer.waiters:
                    peer.waiters.remove(woken)
        return True

    @staticmethod
    def _wake(peer: Peer) -> None:
        waiters, peer.waiters = peer.waiters, []
        for woken in waiters:
            if not woken.done():
                woken.set_result(None)

    async def _resolve(self, host: str, port: int) -> str:
        """The address to connect to, once the host passed ``allowed_host``: checked on
        every address the name resolves to, and the connection goes to one of those
        (no second lookup that could answer differently)."""
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise HandshakeError(f"cannot resolve peer host {host!r}: {exc}") from None
        addresses = sorted({str(info[4][0]) for info in infos})
        if not self._allowed_host(host, addresses):
            self._metrics.handshakes.labels("host_refused").inc()
            raise HandshakeError(f"peer host {host!r} ({', '.join(addresses) or 'no address'}) is not allowed: "
                                 "list it in allowed_peer_hosts")
        return addresses[0]

    async def _dial(self, host: str, port: int, engine_id: str, fut: asyncio.Future[Peer]) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        session: Session | None = None
        try:
            try:
                address = await self._resolve(host, port)
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(address, port, limit=1 << 16), self._settings.handshake_timeout_s)
                session = self._session(reader, writer, dialed=True)
                intro = await asyncio.wait_for(self._introduce(session, engine_id), self._settings.handshake_timeout_s)
                peer = self._adopt(session, intro)
            except (OSError, TimeoutError, asyncio.IncompleteReadError, ProtocolError) as exc:
                raise HandshakeError(f"handshake with {host}:{port} failed: {exc or type(exc).__name__}") from None
        except asyncio.CancelledError:
            if session is not None:
                session.close()
            raise
        except HandshakeError as exc:
            reason = exc.reason if isinstance(exc, AuthError) else "failed"
            self._metrics.handshakes.labels(reason).inc()
            log.warning("peer_handshake_failed", peer=f"{host}:{port}", reason=reason, error=str(exc))
            if session is not None:
                session.close()
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()  # retrieved here; waiters re-raise their own copy
            return
        finally:
            self._dialing.pop((host, port), None)
        self._metrics.handshakes.labels("dialed").inc()
        self._metrics.handshake_seconds.observe(loop.time() - start)
        if not fut.done():
            fut.set_result(peer)
        await self._run_session(session, peer)

    def _my_hello(self) -> pp.PeerHello:
        return pp.PeerHello(
            daemon_id=self.daemon_id,
            engine_id=self.engine_id,
            side_channel_host=self.advertised_host,
            side_channel_port=self._port,
            agents=self._local_agents(),
            heartbeat_interval_s=self._settings.heartbeat_interval_s,
            ucx_error_handling_mode=self._settings.ucx_error_handling_mode,  # type: ignore[arg-type]
        )

    # ------------------------------------------------------------------ incarnations

    def _adopt(self, session: Session, intro: PeerIntro) -> Peer:
        hello = intro.hello
        mine = self._settings.ucx_error_handling_mode
        if hello.ucx_error_handling_mode != mine:
            raise HandshakeError(f"peer {hello.engine_id} runs ucx_error_handling_mode={hello.ucx_error_handling_mode}"
                                 f", this daemon {mine}: WRITEs between the two never complete; give every daemon "
                                 "of the deployment the same mode")
        old = self._by_engine.get(hello.engine_id)
        if old is not None and old.daemon_id != hello.daemon_id and not intro.authenticated and old.alive:
            # Anyone can claim an engine id without a secret: a live peer is not
            # displaced by a claim. A real restart shows up once the old sessions end.
            self._metrics.handshakes.labels("engine_claimed").inc()
            raise HandshakeError(f"engine {hello.engine_id} is held by a live peer "
                                 f"({old.daemon_id[:8]}); unauthenticated hello refused")
        # Refused before anything changes: a refused hello leaves no peer, no session and
        # no agent behind (a ghost would hold the engine id and the session count for good).
        replaced = old if old is not None and old.daemon_id != hello.daemon_id else None
        refusal = self.agents.refusal(self.peers.get(hello.daemon_id), hello.agents, replaced)
        if refusal:
            raise ProtocolError(refusal)
        if replaced is not None:
            # Same engine, new incarnation: the old one's agents and sessions are stale.
            log.info("peer_restarted", peer=hello.engine_id, old=old.daemon_id[:8], new=hello.daemon_id[:8])
            old.gone = intro.authenticated
            self._forget(old)
        lost = self.agents.returned(hello.engine_id)
        if lost is not None and lost.daemon_id != hello.daemon_id:
            # A new incarnation: a late notification from the old one's agents is refused.
            for name in lost.agents:
                self.agents.retire(name)
            if intro.authenticated:
                # ... and the old one is dead, not just silent: nothing it sent is still
                # on the way. Only an authenticated hello can say so.
                log.info("peer_restarted", peer=hello.engine_id, old=lost.daemon_id[:8], new=hello.daemon_id[:8])
                lost.gone = True
                self._events.peer_gone(lost)
        peer = self.peers.get(hello.daemon_id)
        if peer is None:
            peer = Peer(hello.daemon_id, hello.engine_id, hello.side_channel_host, hello.side_channel_port)
            self.peers[peer.daemon_id] = peer
            self._by_engine[peer.engine_id] = peer
        peer.heartbeat_interval_s = hello.heartbeat_interval_s
        peer.heard_at = time.monotonic()
        peer.minor = intro.minor
        peer.authenticated = peer.authenticated or intro.authenticated
        session.peer = peer
        peer.sessions.add(session)
        self._sessions += 1
        self._metrics.peers.set(sum(1 for p in self.peers.values() if p.alive))
        if len(peer.sessions) == 1:
            self._events.peer_up(peer)
        self._add_agents(peer, hello.agents)
        # Agents registered after our hello went out, while the peer's was on its way:
        # the announcement of them did not reach this session yet.
        late = [a for a in pp.announceable(self._local_agents(), intro.minor) if a not in session.announced]
        if late:
            session.send(pp.AgentsUpdate(agents=late))
        log.info("peer_up", peer=peer.engine_id, daemon=peer.daemon_id[:8], agents=len(peer.agents),
                 session=session.id, minor=intro.minor, authenticated=intro.authenticated, announced_late=len(late))
        return peer

    def _add_agents(self, peer: Peer, agents: list[pp.AgentInfo]) -> None:
        # A new agent for a rank replaces the old one (its worker restarted): no
        # registration or WRITE may go to the old agent's memory any more.
        new = self.agents.add(peer, agents)
        if new:
            self._events.agents_announced(peer, new)
            self._wake(peer)

    # ------------------------------------------------------------------ session

    async def _run_session(self, session: Session, peer: Peer) -> None:
        hb = self._tasks.spawn(session.heartbeats(self._settings.heartbeat_interval_s))
        # A peer is silent once neither a heartbeat nor anything else arrived for our
        # timeout, stretched to three of the peer's own heartbeat intervals.
        timeout = max(self._settings.peer_timeout_s, 3 * peer.heartbeat_interval_s)
        try:
            while True:
                msg = await session.read(timeout)
                peer.heard_at = time.monotonic()
                if isinstance(msg, pp.Heartbeat):
                    continue
                if isinstance(msg, pp.Goodbye):
                    log.info("peer_goodbye", peer=peer.engine_id, reason=msg.reason)
                    break
                self._dispatch(peer, msg)
        except TimeoutError:
            log.warning("peer_silent", peer=peer.engine_id, timeout_s=timeout)
        except MalformedInput as exc:  # counted by the decoder
            log.warning("peer_protocol_error", peer=peer.engine_id, error=str(exc))
        except ProtocolError as exc:
            self._metrics.malformed.labels("side_channel", "unexpected").inc()
            log.warning("peer_protocol_error", peer=peer.engine_id, error=str(exc))
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            hb.cancel()
            session.close()
            self._drop_session(session)

    def _dispatch(self, peer: Peer, msg: pp.PeerMessage) -> None:
        if isinstance(msg, pp.PushFailed):
            self._events.push_failed(peer, msg)
        elif isinstance(msg, pp.CancelPush):
            self._events.cancel_push(peer, msg)
        elif isinstance(msg, pp.PushCancelled):
            self._events.push_cancelled(peer, msg)
        elif isinstance(msg, pp.WriteStarted):
            self._events.write_started(peer, msg)
        elif isinstance(msg, pp.RegSent):
            self._events.reg_sent(peer, msg)
        elif isinstance(msg, pp.AgentsUpdate):
            self._add_agents(peer, msg.agents)
        elif isinstance(msg, pp.IpcReady):
            self._events.ipc_ready(peer, msg)
        elif isinstance(msg, pp.IpcWithdrawn):
            self._events.ipc_withdrawn(peer, msg)
        else:
            raise ProtocolError(f"unexpected {type(msg).__name__} after hello")

    def _drop_session(self, session: Session) -> None:
        peer = session.peer
        if peer is None or session not in peer.sessions:
            return
        peer.sessions.discard(session)
        self._sessions -= 1
        if not peer.sessions and self.peers.get(peer.daemon_id) is peer:
            self._forget(peer)

    def _forget(self, peer: Peer) -> None:
        self.peers.pop(peer.daemon_id, None)
        if self._by_engine.get(peer.engine_id) is peer:
            del self._by_engine[peer.engine_id]
        self.agents.forget(peer, lose=not self._closing)
        self._sessions -= len(peer.sessions)
        for s in list(peer.sessions):
            s.close()
        peer.sessions.clear()
        self._wake(peer)  # what waited for its agents stops waiting
        self._metrics.peers.set(sum(1 for p in self.peers.values() if p.alive))
        log.info("peer_down", peer=peer.engine_id, daemon=peer.daemon_id[:8])
        self._events.peer_down(peer)

    def departed(self, agent_name: str) -> bool:
        return self.agents.departed(agent_name)

    # ------------------------------------------------------------------ sending

    def announce(self, agents: list[pp.AgentInfo]) -> None:
        """Tell every peer of local agents that are new: each those its minor knows of."""
        for peer in self.peers.values():
            mine = pp.announceable(agents, peer.minor)
            if mine:
                self.send(peer, pp.AgentsUpdate(agents=mine))

    def send(self, peer: Peer, msg: msgspec.Struct) -> bool:
        for s in list(peer.sessions):
            if s.send(msg):
                return True
        return False

    def __repr__(self) -> str:
        return (f"<PeerManager {self.engine_id} port={self._port} peers={len(self.peers)} "
                f"sessions={self._sessions} dialing={len(self._dialing)}>")
