"""D's PUSH_REGs out: a registration (or a release) goes to P's agents that write into
this rank (the same rank at equal TP; with P TP = k x D TP, the k ranks ``state/tp.py``
names, one PUSH_REG each; replicated KV, MLA's, only to the first of them and a release
to the others; a joint agent of D's ranks, ``joints.py``, stands at P's TP and sends to
the one P rank it takes KV from; a pipeline-parallel P's ranks of every stage, after checking
that the stages hold every layer of this rank once, ``state/stages.py``), at once where P's
daemon is known and announced those agents, else after a handshake (and the announcement) in
a task of its own so no other request waits behind it. Part of D's side (``receiver.py``),
which owns the tables."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec

import structlog

from pushsvc.errors import HandshakeError, TransferError
from pushsvc.protocol import notif
from pushsvc.protocol import peer as pp
from pushsvc.server.joints import Joint
from pushsvc.server.landing import Landing
from pushsvc.server.peers import Peer, PeerLink
from pushsvc.server.ranks import Rank
from pushsvc.server.tasks import TaskSet
from pushsvc.server.timelines import Timelines
from pushsvc.state import tp
from pushsvc.state.consumer import ConsumerTable, PendingRecv
from pushsvc.state.layout import replicated
from pushsvc.state.stages import coverage, keys
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
                 fail: Callable[[Rank, str, str, str], None], withdraw: Callable[[Rank, str, str], None],
                 wake: Callable[[], None]) -> None:
        self._identity = identity
        self._peers = peers
        self._tasks = tasks
        self._landing = landing
        self._timelines = timelines
        self._table = table  # the rank's registrations (the Receiver's)
        self._fail = fail  # (rank, request id, kind, reason): the registration failed
        self._withdraw = withdraw  # (rank, request id, reason): it failed after some of P's ranks got it
        self._wake = wake

    def dispatch(self, rank: Rank, entry: PendingRecv) -> None:
        """Send ``entry``'s PUSH_REG; its registration fails if it cannot go out."""
        peer = self._peers.find_engine(entry.remote.engine_id)
        if peer is not None and not self._unannounced(rank, entry, peer):
            self._send(rank, entry, peer)
        else:
            self._tasks.spawn(self._after_handshake(rank, entry))

    def release(self, rank: Rank, entry: PendingRecv) -> None:
        """Fire and forget: tell P to free the blocks it holds for ``entry`` (no blocks)."""
        peer = self._peers.find_engine(entry.remote.engine_id)
        if peer is None or self._unannounced(rank, entry, peer):
            self._tasks.spawn(self._release_after_handshake(rank, entry))
            return
        try:
            self._push_reg(rank, entry, peer)
        except (HandshakeError, TransferError) as exc:  # P's lease frees its blocks instead
            log.info("release_unsent", request_id=entry.request_id, peer=entry.remote.engine_id, error=str(exc))

    async def _release_after_handshake(self, rank: Rank, entry: PendingRecv) -> None:
        try:
            self._push_reg(rank, entry, await self._peer(rank, entry))
        except (HandshakeError, TransferError) as exc:
            log.info("release_unsent", request_id=entry.request_id, peer=entry.remote.engine_id, error=str(exc))

    async def _after_handshake(self, rank: Rank, entry: PendingRecv) -> None:
        try:
            peer = await self._peer(rank, entry)
        except HandshakeError as exc:
            self._fail(rank, entry.request_id, "handshake_failed", str(exc))
            return
        if self._table(rank).pending.get(entry.request_id) is entry:  # not evicted meanwhile
            self._send(rank, entry, peer)

    async def _peer(self, rank: Rank, entry: PendingRecv) -> Peer:
        """P's daemon, once it announced the agents ``entry`` goes to: a daemon that just
        started says hello before its workers registered, and announces them moments
        later (waited for as long as a handshake may take)."""
        r = entry.remote
        peer = await self._peers.ensure(r.host, r.port, r.engine_id)
        if not await self._peers.announced(peer, lambda p: not self._unannounced(rank, entry, p)):
            if not peer.alive:
                raise HandshakeError(f"peer {r.engine_id} was lost before it announced the agents of its workers")
            # What is still missing is named by _push_reg.
        return peer

    def _unannounced(self, rank: Rank, entry: PendingRecv, peer: Peer) -> list[tuple[int, int]]:
        """(stage, rank) of P's ranks that write into ``rank`` for ``entry`` and ``peer`` has
        not announced (at P's TP); none where the TPs do not pair (``_push_reg`` says why)."""
        ranks = _sources(rank, entry)
        return _missing(ranks, entry.remote.tp_size, peer) if ranks is not None else []

    def _send(self, rank: Rank, entry: PendingRecv, peer: Peer) -> None:
        sent: dict[str, int] = {}
        layers: dict[str, tuple[tuple[str, ...], ...]] = {}
        try:
            self._push_reg(rank, entry, peer, sent, layers)
        except (TransferError, HandshakeError) as exc:
            kind = "push_reg_send_failed" if isinstance(exc, TransferError) else "handshake_failed"
            if not sent:
                self._fail(rank, entry.request_id, kind, str(exc))
                return
            # Some of P's ranks have it and may write: withdrawn from them, never dropped.
            self._table(rank).mark_sent(entry.request_id, peer.daemon_id, sent)
            self._withdraw(rank, entry.request_id, f"{kind}: {exc}")
            return
        self._table(rank).mark_sent(entry.request_id, peer.daemon_id, sent, layers)
        self._timelines.mark(rank, RECV, entry.request_id, "push_reg_sent")
        if peer.minor >= pp.REG_SENT_MINOR:  # P looks at once (blocks staged there may wait for it)
            self._peers.send(peer, pp.RegSent(request_id=entry.request_id, rank=rank.number,
                                              match_key=entry.match_key))
        self._wake()

    def _push_reg(self, rank: Rank, entry: PendingRecv, peer: Peer, sent: dict[str, int] | None = None,
                  layers: dict[str, tuple[tuple[str, ...], ...]] | None = None) -> None:
        """Send ``entry``'s PUSH_REG to each of ``peer``'s agents that write into this
        rank; ``sent`` collects them (agent -> P rank's source id) as they go out, and
        ``layers``, for a pipeline-parallel P, each one's regions' layers."""
        p_tp = entry.remote.tp_size
        ranks = _sources(rank, entry)
        if ranks is None:
            raise HandshakeError(tp.refusal(p_tp, rank.tp_size))
        if isinstance(rank, Joint) and peer.minor < pp.JOINT_MINOR:
            raise HandshakeError(f"P daemon {peer.engine_id} speaks side channel 1.{peer.minor}; P TP {p_tp} -> "
                                 f"D TP {rank.members[0].tp_size} needs 1.{pp.JOINT_MINOR}")
        if len(ranks) > 1 and peer.minor < pp.HETERO_TP_MINOR:
            raise HandshakeError(f"P daemon {peer.engine_id} speaks side channel 1.{peer.minor}; P TP {p_tp} -> "
                                 f"D TP {rank.tp_size} needs 1.{pp.HETERO_TP_MINOR}")
        missing = _missing(ranks, p_tp, peer)
        if missing:
            stage, r = missing[0]
            raise HandshakeError(f"peer {peer.engine_id} has no rank {r} of TP {p_tp}"
                                 + (f" in pipeline stage {stage}" if stage else ""))
        stages = [[peer.agent_for(r, p_tp, s) for r in ranks] for s in range(_stages(ranks, p_tp, peer))]
        if len(stages) > 1:
            if self._landing.tracks(rank, entry.request_id):
                # Its parts are counted per request, not per source: a second stage's WRITE would
                # count as the first's again, and the first's completion copy the whole buffer.
                raise HandshakeError(f"P {peer.engine_id} runs {len(stages)} pipeline stages: a GPU landing "
                                     "buffer takes KV from one P rank only")
            assert rank.memory is not None
            why = coverage(keys(r.layer_names for r in rank.memory.regions),
                           [keys(r.layer_names for r in s[0].regions) for s in stages if s[0] is not None])
            if why:
                raise HandshakeError(f"P {peer.engine_id} runs {len(stages)} pipeline stages: {why}")
        if entry.ipc and peer.minor < pp.IPC_MINOR:  # the blocks are the worker's, not landing slots
            raise HandshakeError(f"P daemon {peer.engine_id} speaks side channel 1.{peer.minor}: it cannot copy into "
                                 "this rank's KV itself, as the registration asks")
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
            ipc=entry.ipc,
        )
        payload = notif.encode_push_reg(reg)
        # Replicated KV (MLA) is written whole by the first source of each stage; the others
        # hear a release (no blocks), which frees the blocks they hold for the exchange.
        whole = len(ranks) > 1 and rank.memory is not None and replicated(rank.memory.layout)
        release = notif.encode_push_reg(msgspec.structs.replace(reg, local_block_ids=[]))
        for stage in stages:
            for i, target in enumerate(stage):
                assert target is not None
                writes = i == 0 or not whole
                rank.agent.send_notif(target.agent_name, payload if writes else release)
                if sent is not None and writes:
                    sent[target.agent_name] = target.source
                if layers is not None and writes and len(stages) > 1:
                    layers[target.agent_name] = keys(r.layer_names for r in target.regions)


def _sources(rank: Rank, entry: PendingRecv) -> range | None:
    """The ranks of P that write into ``rank`` for ``entry``, or None where the TPs do
    not pair (``tp.refusal`` says why)."""
    p_tp = entry.remote.tp_size
    return None if tp.refusal(p_tp, rank.tp_size) else tp.sources(rank.number, rank.tp_size, p_tp)


def _stages(ranks: range, p_tp: int, peer: Peer) -> int:
    """P's pipeline stages, as its first rank of ``ranks`` in stage 0 announced them (1
    before it is announced)."""
    first = peer.agent_for(ranks[0], p_tp)
    return first.stages if first is not None else 1


def _missing(ranks: range, p_tp: int, peer: Peer) -> list[tuple[int, int]]:
    """(stage, rank) of those of ``ranks``, in each of P's stages, that ``peer`` has not
    announced an agent of TP ``p_tp`` for (an agent of another stage count is a former
    worker's, not counted)."""
    stages = _stages(ranks, p_tp, peer)
    return [(s, r) for s in range(stages) for r in ranks
            if (a := peer.agent_for(r, p_tp, s)) is None or a.stages != stages]
