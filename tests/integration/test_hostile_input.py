"""Hostile bytes against a real ``pushsvc serve``: lying length prefixes on the worker
socket and on the side channel are refused before anything is allocated for them,
nesting far past the recursion limit and unknown fields are refused as malformed, every
refusal is counted in ``/metrics``, and the daemon goes on serving a well-behaved worker.

The daemon's memory is read from ``/proc/<pid>/smaps_rollup`` (Rss). Each probe runs
once with a small oversized prefix first, so the code path is warm and what is compared
is a 2 GiB prefix against nothing.
"""

from __future__ import annotations

import socket
import time

import msgspec
import pytest

from pushsvc.protocol import peer as pp
from pushsvc.protocol import worker as wp
from pushsvc.protocol.framing import HEADER, PREAMBLE, FrameBuffer, check_preamble, encode_preamble, frame

pytestmark = pytest.mark.nixl

GIB2 = 2**31
RSS_SLACK_KIB = 1024  # "under 1 MB"
WAIT_S = 30.0  # liveness bound
WORKER_CAP = 16 << 20  # default max_worker_frame
PEER_CAP = 64 << 20  # default max_peer_frame


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Rss:"):
                return int(line.split()[1])
    raise AssertionError("no Rss in smaps_rollup")


def _recv_all(sock: socket.socket) -> bytes:
    """Everything the daemon sends until it closes the connection."""
    sock.settimeout(WAIT_S)
    out = b""
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def _worker_conn(D) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(WAIT_S)
    sock.connect(D.socket)
    check_preamble(sock.recv(PREAMBLE.size, socket.MSG_WAITALL), wp.MAGIC, wp.MAJOR)
    sock.sendall(encode_preamble(wp.MAGIC, wp.MAJOR, wp.MINOR))
    return sock


def _side_conn(D) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", D.side_port), timeout=WAIT_S)
    sock.sendall(encode_preamble(pp.MAGIC, pp.MAJOR, pp.MINOR))
    return sock


def _messages(data: bytes) -> list:
    return [wp.daemon_decoder.decode(p) for p in FrameBuffer(1 << 24).feed(data)]


def _worker_prefix(D, length: int) -> list:
    """A worker that, after a valid preamble, announces ``length`` bytes and sends 64 KiB."""
    sock = _worker_conn(D)
    try:
        try:
            sock.sendall(HEADER.pack(length) + b"\x00" * (64 << 10))
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused and closed while we were still sending
        return _messages(_recv_all(sock))
    finally:
        sock.close()


def _side_prefix(D, length: int) -> bytes:
    """A peer that, after a valid preamble, announces ``length`` bytes and sends 64 KiB."""
    sock = _side_conn(D)
    try:
        try:
            sock.sendall(HEADER.pack(length) + b"\x00" * (64 << 10))
        except (BrokenPipeError, ConnectionResetError):
            pass
        return _recv_all(sock)  # the daemon's own preamble and hello, then EOF
    finally:
        sock.close()


def _malformed(D, source: str, reason: str) -> float:
    return D.metric("pushsvc_malformed_inputs_total", source=source, reason=reason)


def _settle(pid: int) -> int:
    time.sleep(0.3)  # let the loop finish with the closed connections
    return rss_kib(pid)


def test_two_gib_length_prefixes_are_refused_before_allocation(spawn):
    D = spawn.daemon("hostile")
    pid = D.proc.pid
    # Warm the exact paths with a prefix just over each cap.
    replies = _worker_prefix(D, WORKER_CAP + 1)
    assert [type(m) for m in replies] == [wp.Error] and replies[0].code == "frame", replies
    _side_prefix(D, PEER_CAP + 1)
    D.get("/metrics")
    before = _settle(pid)

    replies = _worker_prefix(D, GIB2)
    side = _side_prefix(D, GIB2)
    after = _settle(pid)

    # Refused and closed: the worker heard why, the side channel was hung up on.
    assert [type(m) for m in replies] == [wp.Error] and replies[0].code == "frame", replies
    assert "exceeds cap" in replies[0].message
    assert side.startswith(encode_preamble(pp.MAGIC, pp.MAJOR, pp.MINOR)[:4])  # then EOF (_recv_all returned)
    growth = after - before
    print(f"\n2 GiB length prefixes (worker socket + side channel): daemon RSS {before} KiB -> {after} KiB "
          f"({growth:+d} KiB)")
    assert growth < RSS_SLACK_KIB, (before, after)
    assert _malformed(D, "worker", "frame") == 2
    assert _malformed(D, "side_channel", "too_large") == 2

    # The daemon still serves a well-behaved worker.
    w = spawn.worker(D, "consumer", layers=1, blocks=4, block_len=256)
    assert w.hello["ok"], w.hello
    assert D.get("/healthz")[0] == 200


def test_lying_prefix_under_the_cap_buffers_only_what_arrives(spawn):
    D = spawn.daemon("hostile")
    pid = D.proc.pid
    # Two rounds: the first warms the paths up, the second is the one measured.
    for _ in range(2):
        socks = []
        before = _settle(pid)
        # Announce a full-cap frame and send 1 KiB of it, on 20 connections of each kind.
        for _ in range(20):
            w = _worker_conn(D)
            w.sendall(HEADER.pack(WORKER_CAP) + b"\x00" * 1024)
            s = _side_conn(D)
            s.sendall(HEADER.pack(PEER_CAP) + b"\x00" * 1024)
            socks += [w, s]
        during = _settle(pid)
        for s in socks:
            s.close()
    growth = during - before
    print(f"\n20 + 20 connections announcing full-cap frames (16 MiB, 64 MiB) with 1 KiB sent: "
          f"daemon RSS {before} KiB -> {during} KiB ({growth:+d} KiB)")
    # 20 x 16 MiB + 20 x 64 MiB announced: 1.6 GB if the prefix were trusted.
    assert growth < RSS_SLACK_KIB, (before, during)
    w = spawn.worker(D, "consumer", layers=1, blocks=4, block_len=256)
    assert w.hello["ok"], w.hello


def _deep(depth: int, kind: str) -> bytes:
    return (b"\x91" if kind == "array" else b"\x81\xa1k") * depth + b"\x01"


def _unknown_first(tag: str, value: bytes) -> bytes:
    enc = msgspec.msgpack.encode
    return b"\x82" + enc("zz") + value + enc("t") + enc(tag)


def test_deep_nesting_and_unknown_fields_are_refused_and_counted(spawn):
    D = spawn.daemon("hostile")
    sock = _worker_conn(D)
    try:
        sock.sendall(frame(wp.encode(wp.Hello(engine_id="", rank=3, tp_size=4, role="both"))))
        bad = [
            _unknown_first("ping", _deep(100_000, "array")),  # msgspec walks it: RecursionError
            _unknown_first("ping", _deep(100_000, "map")),
            msgspec.msgpack.encode({"t": "evict", "request_ids": msgspec.Raw(_deep(100_000, "array"))}),
            msgspec.msgpack.encode({"t": "ping", "token": 1, "extra": 1}),  # unknown field
        ]
        sock.sendall(b"".join(frame(p) for p in bad) + frame(wp.encode(wp.Ping(token=77))))
        buf, got = FrameBuffer(1 << 24), []
        sock.settimeout(WAIT_S)
        while not any(isinstance(m, wp.Pong) for m in got):
            chunk = sock.recv(1 << 16)
            assert chunk, f"connection closed; got {got}"
            got += [wp.daemon_decoder.decode(p) for p in buf.feed(chunk)]
    finally:
        sock.close()
    assert isinstance(got[0], wp.Welcome)
    errors = got[1:-1]
    assert [e.code for e in errors] == ["decode"] * len(bad), errors  # one Error each; the connection lives
    assert got[-1] == wp.Pong(token=77)
    assert _malformed(D, "worker", "decode") == len(bad)

    # The side channel: a deep frame after the preamble is refused, counted and hung up on.
    side = _side_conn(D)
    try:
        side.sendall(frame(_unknown_first("hb", _deep(100_000, "array"))))
        _recv_all(side)
    finally:
        side.close()
    deadline = time.monotonic() + WAIT_S
    while _malformed(D, "side_channel", "decode") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _malformed(D, "side_channel", "decode") == 1
    w = spawn.worker(D, "consumer", layers=1, blocks=4, block_len=256)
    assert w.hello["ok"], w.hello


def test_strangers_cannot_make_an_authenticating_daemon_buffer_before_they_proved_anything(spawn, base_dir):
    """16 connections that each announce 60 MiB where the challenge belongs and send 24 MiB
    of it. Before frames ahead of authentication were capped at 1 KiB this grew the daemon
    by 384 MiB; now each is hung up on at the header."""
    secret = base_dir / "secret"
    secret.write_bytes(b"0123456789abcdef0123456789abcdef")
    secret.chmod(0o600)
    D = spawn.daemon("hostile", "--side-channel-secret-file", str(secret))
    pid = D.proc.pid
    _side_prefix(D, 60 << 20)  # warm the path
    before = _settle(pid)
    socks = []
    for _ in range(16):
        s = _side_conn(D)
        try:
            s.sendall(HEADER.pack(60 << 20) + b"\x00" * (24 << 20))
        except (BrokenPipeError, ConnectionResetError):
            pass  # hung up on while we were still sending: the point
        socks.append(s)
    during = _settle(pid)
    for s in socks:
        s.close()
    growth = during - before
    print(f"\n16 strangers announcing 60 MiB before authenticating, 24 MiB sent each: daemon RSS "
          f"{before} KiB -> {during} KiB ({growth:+d} KiB)")
    # asyncio's transport reads ahead of the 4-byte header, up to twice the stream limit
    # (2 x 64 KiB) per connection, before the refusal closes it: 2 MiB for 16, not 384.
    assert growth < RSS_SLACK_KIB + 16 * 128, (before, during)
    assert D.metric("pushsvc_rejected_connections_total", listener="side_channel", reason="auth_missing") == 17
