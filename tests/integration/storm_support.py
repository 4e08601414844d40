"""The abort storm's bookkeeping (requests, pairs, block pools) and its foreign notifier;
the driver is ``storm.py``."""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass, field

from plain_peer import open_session, stranger_hello

from pushsvc.engine.nixl import NixlEngine
from pushsvc.protocol import notif

POISON = 0xA5
MAX_BLOCKS = 4  # per request
FINAL = {"SendDone", "SendFailed", "RecvDone", "RecvFailed"}


# ---------------------------------------------------------------- bookkeeping


@dataclass
class Req:
    side: str  # "p" or "d"
    rid: str
    pair: int
    blocks: list[int]
    owned: bool = True  # False: the daemon must refuse it; its blocks belong to others
    expect_reject: bool = False
    started_at: float = 0.0
    evicted: bool = False
    layerwise: bool = False  # P: started with SendStart; its layers become final one by one
    final: str = ""
    reason: str = ""
    ended_at: float = 0.0


@dataclass
class Pair:
    n: int
    p_rid: str
    d_rid: str
    p: Req | None = None
    d: Req | None = None
    # (side, ping token): the other side starts only once that side's daemon answered
    # the ping, i.e. read everything sent before it (a duplicate must reach the daemon
    # while the request is live for the daemon too, not after it ended).
    fence: tuple[str, int] | None = None


@dataclass
class Pool:
    """Free blocks of one side; a block has at most one live owner."""

    size: int
    free: list[int] = field(default_factory=list)
    owner: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.free = list(range(self.size))

    def take(self, rng: random.Random, k: int, rid: str) -> list[int] | None:
        if len(self.free) < k:
            return None
        picked = rng.sample(self.free, k)
        for b in picked:
            assert b not in self.owner, f"block {b} handed out twice"
            self.owner[b] = rid
            self.free.remove(b)
        return picked

    def give_back(self, blocks: list[int], rid: str) -> None:
        for b in blocks:
            assert self.owner.get(b) == rid, f"block {b} freed by {rid}, owned by {self.owner.get(b)}"
            del self.owner[b]
            self.free.append(b)


def tag_bytes(n: int, region: int, pos: int, length: int) -> bytes:
    """What P's block ``pos`` of request ``n`` holds in ``region``: cheap and unique."""
    unit = struct.pack("<IHHQ", n, region, pos, 0x5EED5EED5EED5EED)
    return unit * (length // len(unit)) + unit[: length % len(unit)]


# ---------------------------------------------------------------- a foreign notifier


class Notifier:
    """A NIXL agent that learned D's and P's agents through their side channels (like
    any peer would) and sends notifications nobody asked for: completions to D, late
    ones for finished requests and foreign ones for live requests of another P, and
    to P late copies of PUSH_REGs that D withdrew or that were already served."""

    def __init__(self, d_port: int, p_port: int) -> None:
        self.agent = NixlEngine(["UCX"]).create_agent(f"storm-notifier/r0/{random.getrandbits(32):08x}")
        self.d_target = self.agent.add_remote(self._learn(d_port))
        self.p_target = self.agent.add_remote(self._learn(p_port))
        self.sent = 0

    @staticmethod
    def _learn(port: int) -> bytes:
        sock, theirs = open_session("127.0.0.1", port, stranger_hello(f"storm-{random.getrandbits(32):08x}"))
        sock.close()
        return theirs.agents[0].metadata

    def complete(self, rid: str) -> None:
        self.agent.send_notif(self.d_target, notif.encode_completion(rid, 1))
        self.sent += 1

    def push_reg(self, reg: notif.PushReg) -> None:
        self.agent.send_notif(self.p_target, notif.encode_push_reg(reg))
        self.sent += 1

    def progress(self) -> None:
        self.agent.notifs()

    def close(self) -> None:
        self.agent.close()
