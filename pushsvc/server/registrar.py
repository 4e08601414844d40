"""D's PUSH_REGs out: a registration (or a release) goes to P's agent of the same rank,
at once where P's daemon is known, else after a handshake in a task of its own so no other
request waits behind it. Part of D's side (``receiver.py``), which owns the tables."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog

from pushsvc.errors import HandshakeError, TransferError
from pushsvc.protocol import notif
from pushsvc.protocol import peer as pp
from pushsvc.server.landing import Landing
from pushsvc.server.peers import Peer, PeerLink
from pushsvc.server.ranks import Rank
from pushsvc.server.tasks import TaskSet
from pushsvc.server.timelines import Timelines
from pushsvc.state.consumer import ConsumerTable, PendingRecv
from pushsvc.state.timeline import RECV

log = structlog.get_logger("pushsvc.receiver")


@dataclass(frozen=True, slots=True)
class Identity:
    """What a PUSH_REG says of this daemon."""

    engine_id: str
    daemon_id: str
    advertised_host: str


class Registrar:
    def __init__(self, *, identity: Identity, peers: PeerLink, tasks: TaskSet, landing: Landing,
                 timelines: Timelines, table: Callable[[Rank], ConsumerTable],
                 fail: Callable[[Rank, str, str, str], None], wake: Callable[[], None]) -> None:
        self._identity = identity
        self._peers = peers
        self._tasks = tasks
        self._landing = landing
        self._timelines = timelines
        self._table = table  # the rank's registrations (the Receiver's)
        self._fail = fail  # (rank, request id, kind, reason): the registration failed
        self._wake = wake

    def dispatch(self, rank: Rank, entry: PendingRecv) -> None:
        """Send ``entry``'s PUSH_REG; its registration fails if it cannot go out."""
        peer = self._peers.find_engine(entry.remote.engine_id)
        if peer is not None:
            self._send(rank, entry, peer)
        else:
            self._tasks.spawn(self._after_handshake(rank, entry))

    def release(self, rank: Rank, entry: PendingRecv) -> None:
        """Fire and forget: tell P to free the blocks it holds for ``entry`` (no blocks)."""
        peer = self._peers.find_engine(entry.remote.engine_id)
        if peer is None:
            self._tasks.spawn(self._release_after_handshake(rank, entry))
            return
        try:
            self._push_reg(rank, entry, peer)
        except (HandshakeError, TransferError) as exc:  # P's lease frees its blocks instead
            log.info("release_unsent", request_id=entry.request_id, peer=entry.remote.engine_id, error=str(exc))

    async def _release_after_handshake(self, rank: Rank, entry: PendingRecv) -> None:
        r = entry.remote
        try:
            self._push_reg(rank, entry, await self._peers.ensure(r.host, r.port, r.engine_id))
        except (HandshakeError, TransferError) as exc:
            log.info("release_unsent", request_id=entry.request_id, peer=r.engine_id, error=str(exc))

    async def _after_handshake(self, rank: Rank, entry: PendingRecv) -> None:
        r = entry.remote
        try:
            peer = await self._peers.ensure(r.host, r.port, r.engine_id)
        except HandshakeError as exc:
            self._fail(rank, entry.request_id, "handshake_failed", str(exc))
            return
        if self._table(rank).pending.get(entry.request_id) is entry:  # not evicted meanwhile
            self._send(rank, entry, peer)

    def _send(self, rank: Rank, entry: PendingRecv, peer: Peer) -> None:
        try:
            agent = self._push_reg(rank, entry, peer)
        except TransferError as exc:
            self._fail(rank, entry.request_id, "push_reg_send_failed", str(exc))
            return
        except HandshakeError as exc:
            self._fail(rank, entry.request_id, "handshake_failed", str(exc))
            return
        self._table(rank).mark_sent(entry.request_id, peer.daemon_id, agent)
        self._timelines.mark(rank, RECV, entry.request_id, "push_reg_sent")
        self._wake()

    def _push_reg(self, rank: Rank, entry: PendingRecv, peer: Peer) -> str:
        """Send ``entry``'s PUSH_REG to ``peer``'s agent of this rank; return that agent."""
        target = peer.agent_for_rank(rank.number)
        if target is None:
            raise HandshakeError(f"peer {peer.engine_id} has no rank {rank.number}")
        me = self._identity
        # A landing rank's registration names its landing slots, which P WRITEs into.
        blocks = self._landing.slot_ids(rank, entry.request_id) if self._landing.tracks(
            rank, entry.request_id) else entry.block_ids
        reg = notif.PushReg(
            request_id=entry.request_id,
            decode_engine_id=me.engine_id,
            decode_host=me.advertised_host,
            decode_port=self._peers.port,
            decode_tp_size=rank.tp_size,
            local_block_ids=blocks,
            remote_engine_id=entry.remote.engine_id,
            remote_host=entry.remote.host,
            remote_port=entry.remote.port,
            remote_tp_size=entry.remote.tp_size,
            decode_rank=rank.number,
            decode_daemon_id=me.daemon_id,
            # An older P refuses a field it does not know: set it only where P's minor says.
            match_key=entry.match_key if peer.minor >= pp.MATCH_KEY_MINOR else "",
        )
        rank.agent.send_notif(target.agent_name, notif.encode_push_reg(reg))
        return target.agent_name
