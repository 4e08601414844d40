"""Daemon <-> daemon side channel: TCP sessions, handshakes, liveness.

A session starts with the preamble exchange (``PSVP`` + version, checked before any
message is decoded), then, with a shared secret configured, the authentication
exchange (``_authenticate``), then both sides send a ``PeerHello`` with their NIXL
agents and KV layouts. Sessions stay open: heartbeats prove liveness both ways, and P uses the
session D opened to tell D at once when it cannot WRITE a registration.

``PeerManager.ensure`` is the handshake cache: concurrent callers for one address share
one attempt; a live session answers at once; a peer that restarted (new ``daemon_id``
under the same engine id) replaces the old one, whose agents are dropped.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import msgspec
import structlog

from pushsvc.errors import AuthError, HandshakeError, MalformedInput, ProtocolError
from pushsvc.metrics import Metrics
from pushsvc.protocol import peer as pp
from pushsvc.protocol.peer_auth import PeerAuth, Role, new_nonce
from pushsvc.protocol.framing import HEADER, PREAMBLE, CountingDecoder, check_preamble, encode_preamble, frame

log = structlog.get_logger("pushsvc.peers")

# Agent names of departed peers remembered to refuse their late notifications; agent
# names are never reused (they carry the daemon id and a generation), so this only
# bounds memory.
_DEPARTED_KEPT = 4096


@dataclass
class Peer:
    """A remote daemon incarnation and what it told us."""

    daemon_id: str
    engine_id: str
    host: str
    port: int
    agents: dict[str, pp.AgentInfo] = field(default_factory=dict)  # by agent name
    sessions: set[Session] = field(default_factory=set)
    heartbeat_interval_s: float = 1.0
    # Known dead: a new incarnation of its engine said hello. A peer that only went
    # silent or closed its sessions may still have WRITEs on the way.
    gone: bool = False

    def agent_for_rank(self, rank: int) -> pp.AgentInfo | None:
        for info in self.agents.values():
            if info.rank == rank:
                return info
        return None

    @property
    def alive(self) -> bool:
        return bool(self.sessions)

    def __repr__(self) -> str:
        return f"<Peer {self.engine_id} id={self.daemon_id[:8]} {self.host}:{self.port} agents={len(self.agents)} sessions={len(self.sessions)}>"


class Session:
    """One TCP connection to a peer daemon, after a successful hello exchange."""

    _ids = itertools.count(1)

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, dialed: bool) -> None:
        self.id = next(self._ids)
        self.reader = reader
        self.writer = writer
        self.dialed = dialed
        self.peer: Peer | None = None
        self.task: asyncio.Task | None = None

    def send(self, msg: msgspec.Struct) -> None:
        if not self.writer.is_closing():
            self.writer.write(frame(pp.encode(msg)))

    def close(self) -> None:
        if not self.writer.is_closing():
            self.writer.close()

    def __repr__(self) -> str:
        peer = self.peer.engine_id if self.peer else "?"
        return f"<Session #{self.id} peer={peer} dialed={self.dialed}>"


class PeerEvents:
    """What the push service wants to hear about; the manager calls these."""

    def peer_up(self, peer: Peer, new_agents: list[pp.AgentInfo]) -> None: ...
    def peer_down(self, peer: Peer) -> None: ...
    def peer_gone(self, peer: Peer) -> None:
        """A peer lost earlier is known dead now (a new incarnation said hello)."""
    def push_failed(self, peer: Peer, msg: pp.PushFailed) -> None: ...
    def cancel_push(self, peer: Peer, msg: pp.CancelPush) -> None: ...
    def push_cancelled(self, peer: Peer, msg: pp.PushCancelled) -> None: ...
    def write_started(self, peer: Peer, msg: pp.WriteStarted) -> None: ...


class PeerManager:
    def __init__(
        self,
        *,
        daemon_id: str,
        engine_id: str,
        advertised_host: str,
        local_agents: Callable[[], list[pp.AgentInfo]],
        events: PeerEvents,
        metrics: Metrics,
        max_frame: int,
        handshake_timeout_s: float,
        heartbeat_interval_s: float,
        peer_timeout_s: float,
        secret: bytes | None = None,
    ) -> None:
        self.daemon_id = daemon_id
        self.engine_id = engine_id
        self.advertised_host = advertised_host
        self.port = 0
        self._local_agents = local_agents
        self._events = events
        self._metrics = metrics
        self._frames = CountingDecoder(pp.peer_decoder, source="side_channel", max_frame=max_frame,
                                       malformed=metrics.malformed)
        self._hs_timeout = handshake_timeout_s
        self._hb = heartbeat_interval_s
        self._peer_timeout = peer_timeout_s
        # With a secret, no hello (no metadata) goes out before the peer proved it knows it.
        self._secret = secret or None
        self.peers: dict[str, Peer] = {}  # by daemon_id
        self._by_engine: dict[str, Peer] = {}
        self._by_agent: dict[str, Peer] = {}
        self._departed: OrderedDict[str, None] = OrderedDict()  # agent names, oldest first
        self._lost: dict[str, Peer] = {}  # engine id -> last incarnation lost without being known dead
        self._dialing: dict[tuple[str, int], asyncio.Future[Peer]] = {}
        self._tasks: set[asyncio.Task] = set()
        self._server: asyncio.AbstractServer | None = None
        self._closing = False

    # ------------------------------------------------------------------ listening

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._accept, host, port, limit=1 << 16)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        self._closing = True
        if self._server is not None:
            self._server.close()
        for peer in list(self.peers.values()):
            for s in list(peer.sessions):
                s.send(pp.Goodbye(reason="shutdown"))
                s.close()
        for fut in self._dialing.values():
            fut.cancel()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closing:
            writer.close()
            return
        session = Session(reader, writer, dialed=False)
        try:
            await asyncio.wait_for(self._hello(session), self._hs_timeout)
        except (ProtocolError, HandshakeError, OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            reason = exc.reason if isinstance(exc, AuthError) else type(exc).__name__
            if isinstance(exc, AuthError):
                self._metrics.handshakes.labels(exc.reason).inc()
            self._metrics.rejected_connections.labels("side_channel", reason).inc()
            log.warning("peer_handshake_rejected", phase="accept", reason=reason, error=str(exc), peer=_addr(writer))
            writer.close()
            return
        self._metrics.handshakes.labels("accepted").inc()
        await self._run_session(session)

    # ------------------------------------------------------------------ dialing

    def find_engine(self, engine_id: str) -> Peer | None:
        peer = self._by_engine.get(engine_id)
        return peer if peer is not None and peer.alive else None

    def find_agent(self, agent_name: str) -> Peer | None:
        return self._by_agent.get(agent_name)

    async def ensure(self, host: str, port: int, engine_id: str = "") -> Peer:
        """A live peer at host:port (and with ``engine_id``, when given); dial if needed."""
        if engine_id:
            peer = self.find_engine(engine_id)
            if peer is not None:
                return peer
        for peer in self.peers.values():
            if peer.alive and (peer.host, peer.port) == (host, port):
                if engine_id and peer.engine_id != engine_id:
                    raise HandshakeError(f"{host}:{port} is engine {peer.engine_id}, expected {engine_id}")
                return peer
        key = (host, port)
        fut = self._dialing.get(key)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._dialing[key] = fut
            self._spawn(self._dial(host, port, fut))
        peer = await asyncio.shield(fut)
        if engine_id and peer.engine_id != engine_id:
            raise HandshakeError(f"{host}:{port} is engine {peer.engine_id}, expected {engine_id}")
        return peer

    async def _dial(self, host: str, port: int, fut: asyncio.Future[Peer]) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        session: Session | None = None
        try:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(host, port, limit=1 << 16), self._hs_timeout
                )
                session = Session(reader, writer, dialed=True)
                peer = await asyncio.wait_for(self._hello(session), self._hs_timeout)
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
        await self._run_session(session)

    # ------------------------------------------------------------------ session

    async def _read(self, session: Session, timeout: float | None = None) -> pp.PeerMessage:
        # The cap is checked before a payload byte is read, during the handshake too;
        # both refusals are counted by the decoder (source "side_channel").
        header = await asyncio.wait_for(session.reader.readexactly(HEADER.size), timeout)
        length = self._frames.frame_length(header)
        payload = await asyncio.wait_for(session.reader.readexactly(length), timeout)
        return self._frames.decode(payload)

    def _my_hello(self) -> pp.PeerHello:
        return pp.PeerHello(
            daemon_id=self.daemon_id,
            engine_id=self.engine_id,
            side_channel_host=self.advertised_host,
            side_channel_port=self.port,
            agents=self._local_agents(),
            heartbeat_interval_s=self._hb,
        )

    async def _hello(self, session: Session) -> Peer:
        preamble = encode_preamble(pp.MAGIC, pp.MAJOR, pp.MINOR)
        nonce = new_nonce() if self._secret is not None else b""
        if self._secret is None:
            session.writer.write(preamble + frame(pp.encode(self._my_hello())))
        else:
            session.writer.write(preamble + frame(pp.encode(pp.AuthChallenge(nonce=nonce, daemon_id=self.daemon_id))))
        minor = check_preamble(await session.reader.readexactly(PREAMBLE.size), pp.MAGIC, pp.MAJOR)
        msg = await self._read(session)
        authenticated = ""
        if self._secret is not None:
            authenticated = await self._authenticate(session, nonce, minor, msg)
            session.send(self._my_hello())
            msg = await self._read(session)
        elif isinstance(msg, pp.AuthChallenge):
            raise AuthError("auth_required", "peer requires side-channel authentication "
                                             "(set side_channel_secret_file to the deployment's secret)")
        if not isinstance(msg, pp.PeerHello):
            raise ProtocolError(f"expected hello, got {type(msg).__name__}")
        if msg.daemon_id == self.daemon_id:
            raise HandshakeError("connected to ourselves")
        if authenticated and msg.daemon_id != authenticated:
            raise ProtocolError("hello names another daemon than the one that authenticated")
        return self._adopt(session, msg)

    async def _authenticate(self, session: Session, my_nonce: bytes, minor: int, msg: pp.PeerMessage) -> str:
        """Run the proof exchange after the peer's challenge ``msg``; return the peer's
        daemon id once its proof checks. Our proof goes out before we check theirs, so
        a wrong secret fails on both sides at once, each with a clear reason."""
        assert self._secret is not None
        if not isinstance(msg, pp.AuthChallenge):
            why = f"speaks side-channel 1.{minor}, without authentication" if minor < pp.AUTH_MINOR \
                else f"sent {type(msg).__name__}"
            raise AuthError("auth_missing", f"peer did not authenticate: it {why}")
        if msg.daemon_id == self.daemon_id:
            raise HandshakeError("connected to ourselves")
        auth = PeerAuth(self._secret, Role.DIALER if session.dialed else Role.ACCEPTOR,
                        self.daemon_id, my_nonce, msg.daemon_id, msg.nonce)
        session.send(pp.AuthProof(mac=auth.my_proof()))
        reply = await self._read(session)
        if not isinstance(reply, pp.AuthProof):
            raise AuthError("auth_missing", f"peer did not authenticate: it sent {type(reply).__name__}")
        if not auth.check_peer(reply.mac):
            raise AuthError("auth_bad_proof", "peer failed side-channel authentication (another secret?)")
        return msg.daemon_id

    def _adopt(self, session: Session, hello: pp.PeerHello) -> Peer:
        old = self._by_engine.get(hello.engine_id)
        if old is not None and old.daemon_id != hello.daemon_id:
            # Same engine, new incarnation: the old one's agents and sessions are stale.
            log.info("peer_restarted", peer=hello.engine_id, old=old.daemon_id[:8], new=hello.daemon_id[:8])
            old.gone = True
            self._forget(old)
        lost = self._lost.pop(hello.engine_id, None)
        if lost is not None and lost.daemon_id != hello.daemon_id:
            # The incarnation we lost earlier is dead, not just silent: nothing it sent
            # is still on the way, and a late notification from its agents is refused.
            log.info("peer_restarted", peer=hello.engine_id, old=lost.daemon_id[:8], new=hello.daemon_id[:8])
            lost.gone = True
            for name in lost.agents:
                self._remember_departed(name)
            self._events.peer_gone(lost)
        peer = self.peers.get(hello.daemon_id)
        if peer is None:
            peer = Peer(hello.daemon_id, hello.engine_id, hello.side_channel_host, hello.side_channel_port)
            self.peers[peer.daemon_id] = peer
            self._by_engine[peer.engine_id] = peer
        peer.heartbeat_interval_s = hello.heartbeat_interval_s
        session.peer = peer
        peer.sessions.add(session)
        self._metrics.peers.set(sum(1 for p in self.peers.values() if p.alive))
        self._add_agents(peer, hello.agents)
        log.info("peer_up", peer=peer.engine_id, daemon=peer.daemon_id[:8], agents=len(peer.agents), session=session.id)
        return peer

    def _add_agents(self, peer: Peer, agents: list[pp.AgentInfo]) -> None:
        new = [a for a in agents if peer.agents.get(a.agent_name) != a]
        for a in new:
            # A new agent for a rank replaces the old one (its worker restarted): no
            # registration or WRITE may go to the old agent's memory any more.
            for name in [n for n, old in peer.agents.items() if old.rank == a.rank and n != a.agent_name]:
                del peer.agents[name]
                if self._by_agent.get(name) is peer:
                    del self._by_agent[name]
                self._remember_departed(name)
            peer.agents[a.agent_name] = a
            self._by_agent[a.agent_name] = peer
        self._events.peer_up(peer, new)

    async def _run_session(self, session: Session) -> None:
        peer = session.peer
        assert peer is not None
        hb = self._spawn(self._heartbeats(session))
        # A peer is silent once neither a heartbeat nor anything else arrived for our
        # timeout, stretched to three of the peer's own heartbeat intervals.
        timeout = max(self._peer_timeout, 3 * peer.heartbeat_interval_s)
        try:
            while True:
                msg = await self._read(session, timeout)
                if isinstance(msg, pp.Heartbeat):
                    continue
                if isinstance(msg, pp.PushFailed):
                    self._events.push_failed(peer, msg)
                elif isinstance(msg, pp.CancelPush):
                    self._events.cancel_push(peer, msg)
                elif isinstance(msg, pp.PushCancelled):
                    self._events.push_cancelled(peer, msg)
                elif isinstance(msg, pp.WriteStarted):
                    self._events.write_started(peer, msg)
                elif isinstance(msg, pp.AgentsUpdate):
                    self._add_agents(peer, msg.agents)
                elif isinstance(msg, pp.Goodbye):
                    log.info("peer_goodbye", peer=peer.engine_id, reason=msg.reason)
                    break
                else:
                    raise ProtocolError(f"unexpected {type(msg).__name__} after hello")
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

    async def _heartbeats(self, session: Session) -> None:
        for seq in itertools.count():
            await asyncio.sleep(self._hb)
            if session.writer.is_closing():
                return
            session.send(pp.Heartbeat(seq=seq))

    def _drop_session(self, session: Session) -> None:
        peer = session.peer
        if peer is None:
            return
        peer.sessions.discard(session)
        if not peer.sessions and self.peers.get(peer.daemon_id) is peer:
            self._forget(peer)

    def _forget(self, peer: Peer) -> None:
        self.peers.pop(peer.daemon_id, None)
        if self._by_engine.get(peer.engine_id) is peer:
            del self._by_engine[peer.engine_id]
        for name in peer.agents:
            if self._by_agent.get(name) is peer:
                del self._by_agent[name]
            if peer.gone:  # a peer that only went silent may come back with these agents
                self._remember_departed(name)
        if not peer.gone and not self._closing:
            self._lost[peer.engine_id] = peer  # until it returns or a new incarnation does
        for s in list(peer.sessions):
            s.close()
        peer.sessions.clear()
        self._metrics.peers.set(sum(1 for p in self.peers.values() if p.alive))
        log.info("peer_down", peer=peer.engine_id, daemon=peer.daemon_id[:8])
        self._events.peer_down(peer)

    def departed(self, agent_name: str) -> bool:
        """``agent_name`` belonged to a peer incarnation or worker that is gone: a
        notification from it is late, never a new request."""
        return agent_name in self._departed

    def _remember_departed(self, agent_name: str) -> None:
        self._departed[agent_name] = None
        self._departed.move_to_end(agent_name)
        while len(self._departed) > _DEPARTED_KEPT:
            self._departed.popitem(last=False)

    # ------------------------------------------------------------------ sending

    def broadcast(self, msg: msgspec.Struct) -> None:
        for peer in self.peers.values():
            for s in peer.sessions:
                s.send(msg)
                break

    def send(self, peer: Peer, msg: msgspec.Struct) -> bool:
        for s in peer.sessions:
            s.send(msg)
            return True
        return False

    def __repr__(self) -> str:
        return f"<PeerManager {self.engine_id} port={self.port} peers={len(self.peers)} dialing={len(self._dialing)}>"


def _addr(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if peer else "?"
