"""A side-channel session opened by hand, as a peer without a secret: the helpers that
play a foreign NIXL agent (``intruder.py``, ``late_push_reg.py``, ``rogue_peer.py``, the
storm's notifier) learn the daemon's agents this way, like any peer would."""

from __future__ import annotations

import socket

from pushsvc.protocol import peer as pp
from pushsvc.protocol.framing import PREAMBLE, encode_preamble, frame, read_exact, read_frame

MAX_HELLO = 64 << 20  # the daemon's default max_peer_frame


def open_session(host: str, port: int, hello: pp.PeerHello, timeout: float = 10.0) -> tuple[socket.socket, pp.PeerHello]:
    """Connect, exchange preambles and hellos; the daemon's hello comes back with its agents."""
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.sendall(encode_preamble(pp.MAGIC, pp.MAJOR, pp.MINOR) + frame(pp.encode(hello)))
    read_exact(sock, PREAMBLE.size)
    theirs = pp.peer_decoder.decode(read_frame(sock, MAX_HELLO))
    assert isinstance(theirs, pp.PeerHello), theirs
    return sock, theirs


def stranger_hello(name: str, agents: list[pp.AgentInfo] | None = None, heartbeat_interval_s: float = 1.0) -> pp.PeerHello:
    return pp.PeerHello(daemon_id=f"{name}-daemon", engine_id=name, side_channel_host="127.0.0.1",
                        side_channel_port=1, agents=agents or [], heartbeat_interval_s=heartbeat_interval_s)
