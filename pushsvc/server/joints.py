"""D's joint agents: one NIXL agent over several of D's ranks, for a P of lower TP.

With D TP = k x P TP, P rank ``i``'s KV heads are those of D ranks ``ik .. ik+k-1``, its
*members* (``state/tp.py``). This daemon maps every rank's KV in one process, so it
registers the members' memory with one more agent, the *joint*, and announces it to P
(side channel 1.6, ``AgentInfo.members``) as rank ``i`` of TP ``p_tp`` with the members'
regions one member after the other. P pairs with it as at equal TP: one registration,
one WRITE of its ``k`` head slices (``layout.joint_source``), one completion.

A joint is a ``Rank`` without a worker of its own: the Receiver keeps its registrations
in a table like any rank's, and the events of those go to every member's worker
(``FanOut``). What is joint-specific lives here:

* **Building.** Joints exist for every P TP below D's that divides it, once every member
  registered KV; a joint is rebuilt (a new agent) when a member's worker is replaced. A
  joint is not built where its members' KV is in a GPU landing buffer (P's slices would
  land in one member's slots) or on different devices (an agent advertises one): a
  request for it then fails, naming why.
* **Gathering.** Every member's worker registers the request (vLLM's one scheduler gives
  them the same block ids in the same step); the joint's registration goes out once all
  ``k`` did, with the same blocks and the same P. A member withdrawing it first, members
  that disagree, or a member that never comes within the watchdog ends the gathering,
  and every member that registered hears it failed; one that registers it later hears
  it at once (``Joint.ended``), not at its watchdog.
* **Lifetime.** A joint whose member retired retires too: it is closed once nothing can
  land in it, and the retired member's mapping stays until then (``uses``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np
import structlog

from pushsvc.engine.base import Engine
from pushsvc.errors import LayoutError, TransferError
from pushsvc.protocol import peer as pp
from pushsvc.protocol import worker as wp
from pushsvc.server.ranks import Rank, RankMemory, RankRegistry
from pushsvc.server.remotes import RemoteAgents
from pushsvc.state import tp
from pushsvc.state.layout import MAX_DESCRIPTORS, joined

log = structlog.get_logger("pushsvc.joints")

Tell = Callable[[Rank, wp.DaemonMessage], None]
MAX_ENDED = 4096  # ended gatherings a joint remembers for the members still to register them


@dataclass(eq=False)
class FanOut:
    """The joint's worker link: what is told to the joint is told to each member."""

    members: list[Rank]
    tell: Tell
    pid: int = 0
    minor: int = wp.MINOR

    def send(self, msg: wp.DaemonMessage) -> None:
        for member in self.members:
            self.tell(member, msg)


@dataclass
class Gather:
    """One request's registrations from the members, until every member's is here."""

    started_at: float
    parts: dict[int, wp.RegisterRecv] = field(default_factory=dict)  # member index -> its registration

    def disagreement(self, msg: wp.RegisterRecv) -> str:
        """Why ``msg`` cannot join the registrations gathered so far, or ''."""
        first = next(iter(self.parts.values()), None)
        if first is None:
            return ""
        same = (first.local_block_ids == msg.local_block_ids and first.remote_engine_id == msg.remote_engine_id
                and first.remote_host == msg.remote_host and first.remote_port == msg.remote_port
                and first.remote_tp_size == msg.remote_tp_size and first.match_key == msg.match_key)
        return "" if same else "D's ranks registered it with different blocks or a different P"


@dataclass(eq=False, repr=False)
class Joint(Rank):
    """A joint agent, as a rank of TP ``p_tp`` numbered as the P rank it takes KV from."""

    members: list[Rank] = field(default_factory=list)
    gathering: dict[str, Gather] = field(default_factory=dict)  # request id -> what the members sent
    # Gatherings that ended before every member registered: request id -> (when, why, the
    # members told), so a member registering it later hears at once (bounded, MAX_ENDED).
    ended: OrderedDict[str, tuple[float, str, set[int]]] = field(default_factory=OrderedDict)

    def end(self, rid: str, now: float, reason: str, told: set[int]) -> None:
        """``rid``'s gathering ended for ``reason``; the members ``told`` heard it."""
        if len(told) < len(self.members):
            self.ended[rid] = (now, reason, set(told))
            self.ended.move_to_end(rid)
            while len(self.ended) > MAX_ENDED:
                self.ended.popitem(last=False)

    def late(self, rid: str, index: int, now: float, keep_s: float) -> str:
        """Why member ``index``'s registration of ``rid`` ends at once (its gathering ended
        before it came), or ''. Forgotten once every member heard, or after ``keep_s``."""
        for old in [r for r, (at, _, _) in self.ended.items() if now - at >= keep_s]:
            del self.ended[old]
        kept = self.ended.get(rid)
        if kept is None or index in kept[2]:
            return ""
        kept[2].add(index)
        if len(kept[2]) == len(self.members):
            del self.ended[rid]
        return kept[1]

    def agent_info(self) -> pp.AgentInfo:
        return msgspec.structs.replace(super().agent_info(), members=len(self.members))

    def index_of(self, member: Rank) -> int:
        return self.members.index(member)

    def __repr__(self) -> str:
        return (f"<Joint r{self.number}/{self.tp_size} agent={self.agent.name} "
                f"members={[m.number for m in self.members]}>")


class Joints:
    def __init__(self, *, engine: Engine, engine_id: str, daemon_id: str, tell: Tell) -> None:
        self._engine = engine
        self._engine_id = engine_id
        self._daemon_id = daemon_id
        self._tell = tell
        self._generation = 0
        self.current: dict[tuple[int, int], Joint] = {}  # (P TP, joint number) -> joint
        self.retiring: list[Joint] = []
        self._why_not: dict[tuple[int, int], str] = {}  # (P TP, joint number) -> why none is built

    def all(self) -> list[Joint]:
        return [*self.current.values(), *self.retiring]

    def for_rank(self, rank: Rank, p_tp: int) -> tuple[Joint | None, str]:
        """The current joint that ``rank`` is a member of for a P of TP ``p_tp``, or why
        there is none."""
        why = tp.joint_refusal(p_tp, rank.tp_size)
        if why:
            return None, why
        number, index = tp.joint_of(rank.number, rank.tp_size, p_tp)
        joint = self.current.get((p_tp, number))
        if joint is not None and joint.members[index] is rank:
            return joint, ""
        return None, self._why_not.get((p_tp, number)) or (
            f"P TP {p_tp} -> D TP {rank.tp_size}: D ranks {list(tp.members(number, rank.tp_size, p_tp))} "
            "have not all registered KV")

    def containing(self, rank: Rank) -> list[Joint]:
        """Every joint (current or retiring) ``rank`` is a member of."""
        return [j for j in self.all() if any(m is rank for m in j.members)]

    def numbered(self, number: int) -> list[Joint]:
        return [j for j in self.all() if j.number == number]

    def uses(self, rank: Rank) -> bool:
        """A joint still registers ``rank``'s memory: it may not be unmapped yet."""
        return bool(self.containing(rank))

    # ------------------------------------------------------------------ building

    def rebuild(self, ranks: RankRegistry) -> tuple[list[Joint], list[Joint]]:
        """Bring the joints in line with the current ranks: (built, retired)."""
        built: list[Joint] = []
        retired: list[Joint] = []
        current = [r for r in ranks.current.values() if r.role != "producer"]
        d_tp = current[0].tp_size if current else 0
        wanted: set[tuple[int, int]] = set()
        for p_tp in tp.joint_sizes(d_tp):
            for number in range(p_tp):
                key = (p_tp, number)
                members = [ranks.current.get(r) for r in tp.members(number, d_tp, p_tp)]
                if any(m is None or not m.ready or m.role == "producer" for m in members):
                    continue
                ready = [m for m in members if m is not None]
                why = _unjoinable(ready, p_tp)
                self._why_not[key] = why
                if why:
                    continue
                wanted.add(key)
                old = self.current.get(key)
                if old is not None and all(a is b for a, b in zip(old.members, ready)):
                    continue
                joint = self._build(number, p_tp, ready)
                if joint is None:
                    continue
                if old is not None:
                    retired.append(self._retire(old))
                self.current[key] = joint
                built.append(joint)
        for key in [k for k in self.current if k not in wanted]:
            retired.append(self._retire(self.current[key]))
        return built, retired

    def _build(self, number: int, p_tp: int, members: list[Rank]) -> Joint | None:
        self._generation += 1
        name = f"{self._engine_id}/j{number}of{p_tp}/{self._daemon_id[:8]}.{self._generation}"
        mems = [m.memory for m in members]
        assert all(m is not None for m in mems)
        memories = [m for m in mems if m is not None]
        first = memories[0]
        agent = self._engine.create_agent(name)
        try:
            layout = joined([m.layout for m in memories])
            device = first.device.ordinal if first.device is not None else 0
            agent.register([(b.address, b.size) for m in memories for b in m.buffers], first.mem_type, device)
        except (LayoutError, TransferError) as exc:
            agent.close()
            key = (p_tp, number)
            self._why_not[key] = f"P TP {p_tp} -> D TP {members[0].tp_size}: no joint agent: {exc}"
            log.error("joint_build_failed", joint=number, p_tp=p_tp, error=str(exc))
            return None
        memory = RankMemory(buffers=[], regions=[r for m in memories for r in m.regions], layout=layout,
                            descs=np.concatenate([m.descs for m in memories]), dlist=None,
                            mem_type=first.mem_type, device=first.device)
        joint = Joint(number, p_tp, "consumer", 0, agent, RemoteAgents(agent, MAX_DESCRIPTORS, prepare=False,
                                                                        rank=number, tp_size=p_tp),
                      memory=memory, members=list(members))
        joint.conn = FanOut(joint.members, self._tell)
        log.info("joint_built", joint=number, p_tp=p_tp, agent=name, members=[m.number for m in members],
                 regions=len(layout.regions))
        return joint

    def _retire(self, joint: Joint) -> Joint:
        key = (joint.tp_size, joint.number)
        if self.current.get(key) is joint:
            del self.current[key]
        self.retiring.append(joint)
        log.info("joint_retired", joint=joint.number, p_tp=joint.tp_size, agent=joint.agent.name)
        return joint

    def close(self, joint: Joint) -> None:
        """A retiring joint nothing can land in any more: its agent goes."""
        if joint in self.retiring:
            self.retiring.remove(joint)
        joint.close()

    def __repr__(self) -> str:
        return f"<Joints current={sorted(self.current)} retiring={len(self.retiring)}>"


def _unjoinable(members: list[Rank], p_tp: int) -> str:
    """Why ``members``' KV cannot be registered with one agent, or ''."""
    mems = [m.memory for m in members if m.memory is not None]
    what = f"P TP {p_tp} -> D TP {members[0].tp_size}"
    if any(m.landing is not None for m in mems):
        return f"{what}: D's KV lands in GPU landing buffers, which take one P rank's KV each"
    if len({(m.mem_type, m.device.ordinal if m.device is not None else 0) for m in mems}) > 1:
        return f"{what}: D's ranks hold KV on different devices, and a joint agent advertises one"
    return ""
