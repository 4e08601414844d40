"""Side-channel authentication between real ``pushsvc serve`` daemons, real NIXL.

Daemons get the secret through a TOML config file (``side_channel_secret_file``);
raw TCP clients play peers that do not know it.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvworker import pattern
from procs import tables_empty
from pushsvc.protocol import peer as pp
from pushsvc.protocol.framing import HEADER, PREAMBLE, check_preamble, encode_preamble, frame

pytestmark = pytest.mark.nixl

LAYERS = 2
BLOCKS = 16
BLOCK_LEN = 2048
SECRET = b"a-deployment-secret-of-32-bytes!"
OTHER = b"another-deployment-secret-32byte"


def _secret_config(base: Path, name: str, secret: bytes, mode: int = 0o600) -> str:
    secret_path = base / f"{name}.secret"
    secret_path.write_bytes(secret + b"\n")
    secret_path.chmod(mode)
    config = base / f"{name}.toml"
    config.write_text(f'side_channel_secret_file = "{secret_path}"\n')
    return str(config)


def _daemon(spawn, base: Path, engine_id: str, secret: bytes | None, *extra: str):
    args = ("--config", _secret_config(base, engine_id, secret)) if secret else ()
    return spawn.daemon(engine_id, *args, *extra)


def _workers(spawn, P, D):
    pw = spawn.worker(P, "producer", layers=LAYERS, blocks=BLOCKS, block_len=BLOCK_LEN, seed=1)
    dw = spawn.worker(D, "consumer", layers=LAYERS, blocks=BLOCKS, block_len=BLOCK_LEN, seed=2)
    assert pw.hello["ok"] and dw.hello["ok"], (pw.hello, dw.hello)
    return pw, dw


def _recv(dw, P, request_id, blocks):
    dw.call("recv", request_id=request_id, block_ids=[blocks], remote_engine_id=P.engine_id,
            remote_host="127.0.0.1", remote_port=P.side_port)


def _d_digests(mapping: dict[int, int]) -> list[list[str]]:
    return [[hashlib.sha1(pattern(1, r, mapping[b], BLOCK_LEN) if b in mapping else pattern(2, r, b, BLOCK_LEN))
             .hexdigest() for b in range(BLOCKS)] for r in range(2 * LAYERS)]


def _eventually(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)



def _raw_peer(port: int, until_closed: bool = True) -> list[pp.PeerMessage]:
    """Connect like a peer without the secret (preamble + hello) and return the frames
    the daemon sends after its preamble: all of them until it closes the connection, or
    only the first (a daemon without a secret keeps the session open)."""
    hello = pp.PeerHello(daemon_id="intruder-daemon", engine_id="intruder", side_channel_host="127.0.0.1",
                         side_channel_port=1, agents=[])
    out: list[pp.PeerMessage] = []
    with socket.create_connection(("127.0.0.1", port), timeout=15) as sock, sock.makefile("rb") as f:
        sock.sendall(encode_preamble(pp.MAGIC, pp.MAJOR, pp.MINOR) + frame(pp.encode(hello)))
        check_preamble(f.read(PREAMBLE.size), pp.MAGIC, pp.MAJOR)
        while header := f.read(HEADER.size):
            (length,) = HEADER.unpack(header)
            out.append(pp.peer_decoder.decode(f.read(length)))
            if not until_closed:
                break
    return out


def test_same_secret_pushes_work(spawn, base_dir):
    P = _daemon(spawn, base_dir, "prefill", SECRET)
    D = _daemon(spawn, base_dir, "decode", SECRET)
    pw, dw = _workers(spawn, P, D)
    _recv(dw, P, "auth-ok", [3, 4])
    pw.call("ready", request_id="auth-ok", block_ids=[[7, 9]])
    assert dw.wait("auth-ok") == {"type": "RecvDone", "request_id": "auth-ok"}
    assert pw.wait("auth-ok") == {"type": "SendDone", "request_id": "auth-ok"}
    assert dw.digests() == _d_digests({3: 7, 4: 9})
    assert P.metric("pushsvc_transfers_total", result="done") == 1
    assert D.metric("pushsvc_handshakes_total", result="dialed") == 1
    assert P.metric("pushsvc_handshakes_total", result="accepted") == 1
    assert tables_empty(P, D)
    for d in (P, D):
        assert SECRET.decode() not in d.log()


@pytest.mark.parametrize(("d_secret", "p_reason", "d_reason"), [
    pytest.param(None, "auth_missing", "auth_required", id="D-without-secret"),
    pytest.param(OTHER, "auth_bad_proof", "auth_bad_proof", id="D-with-another-secret"),
])
def test_mismatched_secret_fails_cleanly_and_writes_nothing(spawn, base_dir, d_secret, p_reason, d_reason):
    P = _daemon(spawn, base_dir, "prefill", SECRET, "--lease-s", "2")
    D = _daemon(spawn, base_dir, "decode", d_secret, "--watchdog-s", "60")
    pw, dw = _workers(spawn, P, D)
    pw.call("ready", request_id="denied", block_ids=[[5, 6]])
    t0 = time.monotonic()
    _recv(dw, P, "denied", [1, 2])
    event = dw.wait("denied", timeout=20)
    elapsed = time.monotonic() - t0
    print(f"D's worker got {event and event['type']} {elapsed * 1e3:.1f} ms after its RegisterRecv")
    # From the failed handshake, not from D's watchdog a minute away.
    assert event is not None and elapsed < 30
    assert event["type"] == "RecvFailed" and "handshake_failed" in event["reason"], event
    assert event["block_ids"] == [1, 2]
    if d_secret is None:
        assert "peer requires side-channel authentication" in event["reason"]
    # P never heard a registration: its lease frees the blocks.
    p_event = pw.wait("denied", timeout=20)
    assert p_event["type"] == "SendFailed" and "lease" in p_event["reason"], p_event
    # No WRITE: nothing completed, D's blocks hold D's own bytes.
    assert P.metric("pushsvc_transfers_total", result="done") == 0
    assert P.metric("pushsvc_inflight_writes") == 0
    assert dw.digests() == _d_digests({})
    _eventually(lambda: P.metric("pushsvc_handshakes_total", result=p_reason) >= 1, P.get("/metrics")[1])
    assert P.metric("pushsvc_rejected_connections_total", listener="side_channel", reason=p_reason) >= 1
    assert D.metric("pushsvc_handshakes_total", result=d_reason) >= 1
    assert P.metric("pushsvc_handshakes_total", result="accepted") == 0
    assert D.metric("pushsvc_handshakes_total", result="dialed") == 0
    # Neither side loaded the other's agent metadata.
    for d in (P, D):
        info = d.live_info()
        assert info["peers"] == [] and info["nixl_handles"]["remote_agents"] == 0, info
    assert "peer_handshake_rejected" in P.log() and p_reason in P.log()
    assert SECRET.decode() not in P.log() and OTHER.decode() not in D.log()
    assert tables_empty(P, D)


def test_peer_without_secret_gets_only_a_challenge(spawn, base_dir):
    P = _daemon(spawn, base_dir, "prefill", SECRET)
    pw = spawn.worker(P, "producer", layers=LAYERS, blocks=BLOCKS, block_len=BLOCK_LEN, seed=1)
    assert pw.hello["ok"]
    frames = _raw_peer(P.side_port)
    # One frame, a challenge: no hello, no agent metadata, no engine id.
    assert [type(f) for f in frames] == [pp.AuthChallenge], frames
    assert frames[0].daemon_id == P.info["daemon_id"] and len(frames[0].nonce) == 32
    assert P.metric("pushsvc_rejected_connections_total", listener="side_channel", reason="auth_missing") == 1
    assert P.metric("pushsvc_peers") == 0 and P.live_info()["peers"] == []
    # The control: the same client against a daemon without a secret does get the metadata.
    Q = spawn.daemon("open")
    qw = spawn.worker(Q, "producer", layers=LAYERS, blocks=BLOCKS, block_len=BLOCK_LEN, seed=1)
    assert qw.hello["ok"]
    (first,) = _raw_peer(Q.side_port, until_closed=False)
    assert isinstance(first, pp.PeerHello) and first.agents and first.agents[0].metadata


@pytest.mark.parametrize(("content", "mode", "words"), [
    (SECRET, 0o644, "accessible by group or others"),
    (b"tiny-secret", 0o600, "shorter than 16"),
])
def test_bad_secret_file_refuses_to_start(base_dir, content, mode, words):
    config = _secret_config(base_dir, "bad", content, mode)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PUSHSVC_")}
    out = subprocess.run([sys.executable, "-m", "pushsvc", "serve", "--config", config, "--engine-id", "bad",
                          "--runtime-dir", str(base_dir / "rt")], capture_output=True, text=True, timeout=60,
                         env=env)
    assert out.returncode == 2, out
    assert "side_channel_secret_file" in out.stderr and words in out.stderr
    assert content.decode() not in out.stderr + out.stdout
