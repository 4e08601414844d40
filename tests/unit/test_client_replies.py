"""The client's blocking waits (``Welcome``, ``KVRegistered``) keep every event that
arrives with the reply: a daemon that hands a reconnected worker its kept final events
right after the welcome may put them in the same read, and those events are the only
news of how the requests ended."""

from __future__ import annotations

import os
import socket
import tempfile
import threading

from pushsvc.client import DaemonClient
from pushsvc.protocol import worker as wp
from pushsvc.protocol.framing import HEADER, PREAMBLE, encode_preamble, frame, read_exact

WELCOME = wp.Welcome(daemon_id="d1", engine_id="e", side_channel_host="127.0.0.1", side_channel_port=1,
                     max_frame=1 << 20)
LATER = [wp.RecvFailed(request_id="waiting", block_ids=[7], reason="cancelled"), wp.SendFailed(request_id="sent",
                                                                                                reason="cancelled")]


def _scripted_daemon(path: str, replies: list[list[wp.DaemonMessage]]) -> threading.Thread:
    """Accept one worker; answer each frame it sends with the next batch, written at once."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def run() -> None:
        conn, _ = server.accept()
        with conn, server:
            read_exact(conn, PREAMBLE.size)
            conn.sendall(encode_preamble(wp.MAGIC, wp.MAJOR, wp.MINOR))
            for batch in replies:
                (length,) = HEADER.unpack(read_exact(conn, HEADER.size))
                read_exact(conn, length)
                conn.sendall(b"".join(frame(wp.encode(m)) for m in batch))
            conn.recv(1)  # until the client closes

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _client(path: str) -> DaemonClient:
    return DaemonClient(path, engine_id="e", rank=0, tp_size=1, role="both", timeout_s=5.0)


def test_events_in_the_same_read_as_the_welcome_are_kept() -> None:
    path = os.path.join(tempfile.mkdtemp(prefix="psc"), "d.sock")
    thread = _scripted_daemon(path, [[WELCOME, *LATER]])
    client = _client(path)
    try:
        assert client.connect() == WELCOME
        assert client.poll() == LATER
    finally:
        client.close()
        thread.join(5)


def test_events_in_the_same_read_as_kv_registered_are_kept_in_order() -> None:
    path = os.path.join(tempfile.mkdtemp(prefix="psc"), "d.sock")
    registered = wp.KVRegistered(agent_name="a", regions=1, bytes=4096)
    early = wp.RecvDone(request_id="early")
    thread = _scripted_daemon(path, [[WELCOME], [early, registered, *LATER]])
    client = _client(path)
    try:
        client.connect()
        fd = os.memfd_create("kv")
        try:
            assert client.register_kv([fd], [wp.Region(buffer=0, offset=0, block_len=4096, num_blocks=1)]) == registered
        finally:
            os.close(fd)
        assert client.poll() == [early, *LATER]  # before and after the reply, in the order they came
    finally:
        client.close()
        thread.join(5)
