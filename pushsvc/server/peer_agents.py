"""Which peer incarnation speaks for which NIXL agent, and which agents are gone.

Every ``PUSH_REG`` and every WRITE notification names an agent. ``AgentBook`` keeps, for
the side channel (``peers.py``), who announced each one: only that incarnation speaks
for it; a worker's new agent for a rank retires the old one (no registration or WRITE
may reach the old agent's memory any more); and an agent whose incarnation left
(*departed*) or went silent (*lost*, until it returns or a new incarnation does) sends
only late notifications, never a new request.

Bounded against a stranger on the side channel: agents per peer (``MAX_AGENTS_PER_PEER``),
departed agents and lost incarnations remembered. Agent names are never reused (they
carry the daemon id and a generation), so forgetting the oldest only bounds memory.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from pushsvc.errors import ProtocolError
from pushsvc.protocol import peer as pp

if TYPE_CHECKING:
    from pushsvc.server.peers import Peer

_DEPARTED_KEPT = 4096
_LOST_KEPT = 1024
MAX_AGENTS_PER_PEER = 1024


class AgentBook:
    def __init__(self) -> None:
        self._by_agent: dict[str, Peer] = {}
        self._departed: OrderedDict[str, None] = OrderedDict()  # agent names, oldest first
        self._lost: OrderedDict[str, Peer] = OrderedDict()  # engine id -> incarnation lost, not known dead
        self._lost_agents: dict[str, Peer] = {}  # the agents of those, until they return

    def owner(self, agent_name: str) -> Peer | None:
        return self._by_agent.get(agent_name)

    def refusal(self, peer: Peer | None, agents: list[pp.AgentInfo], replaced: Peer | None = None) -> str:
        """Why ``agents`` may not join ``peer``'s (None: a peer not known yet; ``replaced``:
        an incarnation the hello replaces), or ''. Asked before anything changes, so that a
        refused hello or update leaves nothing of itself behind."""
        held = dict(peer.agents) if peer is not None else {}
        for a in agents:
            if held.get(a.agent_name) == a:
                continue
            for name in _displaced(held, a):
                del held[name]
            if a.agent_name not in held and len(held) >= MAX_AGENTS_PER_PEER:
                return f"peer announces more than {MAX_AGENTS_PER_PEER} agents"
            owner = self._by_agent.get(a.agent_name)
            if owner is not None and owner is not peer and owner is not replaced:
                return f"agent {a.agent_name} belongs to another peer"
            held[a.agent_name] = a
        return ""

    def add(self, peer: Peer, agents: list[pp.AgentInfo]) -> list[pp.AgentInfo]:
        """Record what ``peer`` announced; the agents that are new to it. Raises
        ``ProtocolError`` (and records nothing) for what ``refusal`` refuses."""
        refusal = self.refusal(peer, agents)
        if refusal:
            raise ProtocolError(refusal)
        new = [a for a in agents if peer.agents.get(a.agent_name) != a]
        for a in new:
            for name in _displaced(peer.agents, a):
                del peer.agents[name]
                if self._by_agent.get(name) is peer:
                    del self._by_agent[name]
                self.retire(name)
            peer.agents[a.agent_name] = a
            self._by_agent[a.agent_name] = peer
        return new

    def departed(self, agent_name: str) -> bool:
        """``agent_name`` belonged to a peer incarnation or worker that is gone, or to a
        peer we lost (until it returns): a notification from it is late, never a new
        request. Its sender dropped what it had sent us when the session ended, and
        may already have handed the blocks back."""
        return agent_name in self._departed or agent_name in self._lost_agents

    def retire(self, agent_name: str) -> None:
        """``agent_name`` is gone for good: whatever still comes from it is late."""
        self._departed[agent_name] = None
        self._departed.move_to_end(agent_name)
        while len(self._departed) > _DEPARTED_KEPT:
            self._departed.popitem(last=False)

    def returned(self, engine_id: str) -> Peer | None:
        """A hello of ``engine_id`` came: the incarnation of it we had lost, if any, is no
        longer counted as lost (the caller decides whether it came back or was replaced)."""
        lost = self._lost.pop(engine_id, None)
        if lost is not None:
            for name in lost.agents:
                self._lost_agents.pop(name, None)
        return lost

    def forget(self, peer: Peer, lose: bool) -> None:
        """``peer`` has no session any more. Its agents speak for nobody; if it is known
        dead they are retired, else with ``lose`` it is remembered as lost, its agents
        late until it returns or a new incarnation does."""
        for name in peer.agents:
            if self._by_agent.get(name) is peer:
                del self._by_agent[name]
            if peer.gone:  # a peer that only went silent may come back with these agents
                self.retire(name)
        if peer.gone or not lose:
            return
        self._lost[peer.engine_id] = peer
        self._lost.move_to_end(peer.engine_id)
        for name in peer.agents:
            self._lost_agents[name] = peer
        while len(self._lost) > _LOST_KEPT:
            _, oldest = self._lost.popitem(last=False)
            for name in oldest.agents:  # forgotten as lost, still refused as late
                self._lost_agents.pop(name, None)
                self.retire(name)

    @property
    def lost(self) -> int:
        """Incarnations remembered as lost."""
        return len(self._lost)


def _displaced(agents: dict[str, pp.AgentInfo], new: pp.AgentInfo) -> list[str]:
    """The names in ``agents`` whose place ``new`` takes: the same rank of the same TP
    and pipeline stage (a worker restarted, or a joint agent was rebuilt over new
    members), under another name."""
    return [name for name, old in agents.items()
            if old.rank == new.rank and old.tp_size == new.tp_size and old.members == new.members
            and old.stage == new.stage and name != new.agent_name]
