"""One side-channel TCP connection to a peer daemon, and its heartbeats.

A ``Session`` reads typed frames (size-capped before a payload byte is read, counted by
its ``CountingDecoder``) and writes without blocking. Writes are bounded: a peer that
stops reading makes the transport's buffer grow, and past ``max_buffered`` bytes the
session is closed (the peer then counts as lost) instead of the daemon's memory growing
without end. Heartbeats wait for the buffer to drain before queueing the next one.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING

import msgspec
import structlog

from pushsvc.protocol import peer as pp
from pushsvc.protocol.framing import HEADER, CountingDecoder, frame

if TYPE_CHECKING:
    from pushsvc.server.peers import Peer

log = structlog.get_logger("pushsvc.session")


class Session:
    _ids = itertools.count(1)

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, dialed: bool,
                 frames: CountingDecoder, max_buffered: int) -> None:
        self.id = next(self._ids)
        # When the connection was made (the loop's clock), before its handshake began.
        self.opened_at = asyncio.get_running_loop().time()
        self.reader = reader
        self.writer = writer
        self.dialed = dialed
        self.frames = frames
        self.max_buffered = max_buffered
        self.minor = 0  # the peer's side-channel minor, from its preamble
        self.authenticated = False
        self.peer: Peer | None = None
        self.overflowed = False
        # The local agents our hello on this session announced: a worker that registers
        # between our hello and the peer's is announced once the session is adopted.
        self.announced: list[pp.AgentInfo] = []

    async def read(self, timeout: float | None = None) -> pp.PeerMessage:
        # The cap is checked before a payload byte is read; both refusals are counted
        # by the decoder (source "side_channel").
        header = await asyncio.wait_for(self.reader.readexactly(HEADER.size), timeout)
        length = self.frames.frame_length(header)
        payload = await asyncio.wait_for(self.reader.readexactly(length), timeout)
        return self.frames.decode(payload)

    def write(self, data: bytes) -> bool:
        """Queue raw bytes; False (and the session closed) if the peer is not reading."""
        if self.writer.is_closing():
            return False
        if self.writer.transport.get_write_buffer_size() + len(data) > self.max_buffered:
            self.overflowed = True
            log.warning("peer_not_reading", session=self.id, peer=self.peer_name,
                        buffered=self.writer.transport.get_write_buffer_size())
            self.close()
            return False
        self.writer.write(data)
        return True

    def send(self, msg: msgspec.Struct) -> bool:
        return self.write(frame(pp.encode(msg)))

    async def heartbeats(self, interval: float) -> None:
        for seq in itertools.count():
            await asyncio.sleep(interval)
            if self.writer.is_closing():
                return
            try:
                await self.writer.drain()  # a peer that stops reading gets no pile of beats
            except (ConnectionError, OSError):
                return
            self.send(pp.Heartbeat(seq=seq))

    def close(self) -> None:
        if not self.writer.is_closing():
            self.writer.close()

    @property
    def closing(self) -> bool:
        return self.writer.is_closing()

    @property
    def peer_name(self) -> str:
        if self.peer is not None:
            return self.peer.engine_id
        addr = self.writer.get_extra_info("peername")
        return f"{addr[0]}:{addr[1]}" if addr else "?"

    def __repr__(self) -> str:
        return f"<Session #{self.id} peer={self.peer_name} dialed={self.dialed} minor={self.minor}>"
