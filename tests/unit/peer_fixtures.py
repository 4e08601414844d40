"""Helpers for tests that drive ``PeerManager``s (and hand-written clients) on loopback
in one event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from pushsvc.metrics import Metrics
from pushsvc.protocol import peer as pp
from pushsvc.protocol.framing import HEADER, frame
from pushsvc.server.peers import PeerManager, PeerSettings

WAIT_S = 5.0


class Events:
    """Records the peers that came up; every other event is unexpected in these tests."""

    def __init__(self) -> None:
        self.up: list[str] = []
        self.other: list[str] = []

    def peer_up(self, peer: Any) -> None:
        self.up.append(peer.engine_id)

    def agents_announced(self, peer: Any, agents: list[pp.AgentInfo]) -> None:
        pass

    def peer_down(self, peer: Any) -> None:
        pass  # every test ends by closing both managers

    def peer_gone(self, peer: Any) -> None:
        self.other.append("peer_gone")

    def push_failed(self, peer: Any, msg: Any) -> None:
        self.other.append("push_failed")

    def cancel_push(self, peer: Any, msg: Any) -> None:
        self.other.append("cancel_push")

    def push_cancelled(self, peer: Any, msg: Any) -> None:
        self.other.append("push_cancelled")

    def write_started(self, peer: Any, msg: Any) -> None:
        self.other.append("write_started")

    def reg_sent(self, peer: Any, msg: Any) -> None:
        self.other.append("reg_sent")

    def ipc_ready(self, peer: Any, msg: Any) -> None:
        self.other.append("ipc_ready")

    def ipc_withdrawn(self, peer: Any, msg: Any) -> None:
        self.other.append("ipc_withdrawn")


AGENT = pp.AgentInfo(rank=0, tp_size=1, agent_name="x/r0", metadata=b"NIXL-METADATA" * 8,
                     regions=[pp.RegionInfo(base=0x7F0000000000, block_len=4096, num_blocks=16)])


def manager(engine_id: str, secret: bytes | None, **overrides: Any) -> tuple[PeerManager, Metrics, Events]:
    metrics, events = Metrics(), Events()
    opts: dict[str, Any] = dict(max_frame=1 << 20, handshake_timeout_s=WAIT_S, heartbeat_interval_s=1.0,
                                peer_timeout_s=5.0)
    opts.update(overrides)
    mgr = PeerManager(daemon_id=f"{engine_id}-daemon-id", engine_id=engine_id, advertised_host="127.0.0.1",
                      local_agents=lambda: [AGENT], events=events, metrics=metrics, secret=secret,
                      settings=PeerSettings(**opts))
    return mgr, metrics, events


@contextlib.asynccontextmanager
async def started(*mgrs: PeerManager) -> AsyncIterator[None]:
    try:
        for m in mgrs:
            await m.start("127.0.0.1", 0)
        yield
    finally:
        for m in mgrs:
            await m.close()


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def eventually(predicate: Any, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.005)


class Raw:
    """A hand-driven side-channel client."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, port: int) -> Raw:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    def send(self, msg: msgspec.Struct) -> None:
        self.writer.write(frame(pp.encode(msg)))

    async def read_msg(self) -> pp.PeerMessage:
        (length,) = HEADER.unpack(await asyncio.wait_for(self.reader.readexactly(HEADER.size), WAIT_S))
        return pp.peer_decoder.decode(await asyncio.wait_for(self.reader.readexactly(length), WAIT_S))

    async def rest(self) -> bytes:
        """Everything else the daemon sends until it closes the connection."""
        return await asyncio.wait_for(self.reader.read(), WAIT_S)

    def close(self) -> None:
        self.writer.close()
