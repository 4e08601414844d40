"""Side-channel authentication: the pure MAC logic, the secret file, and two
``PeerManager``s (plus raw clients) on loopback in one event loop."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pushsvc.config import load_config, read_secret_file
from pushsvc.errors import ConfigError, HandshakeError
from pushsvc.protocol import peer as pp
from pushsvc.protocol.framing import PREAMBLE, check_preamble, encode_preamble, frame
from pushsvc.protocol.peer_auth import LABEL, MAC_LEN, NONCE_LEN, PeerAuth, Role, proof, transcript
from peer_fixtures import AGENT, Raw, eventually, manager, sample, started

SECRET = b"0123456789abcdef0123456789abcdef"
OTHER = b"fedcba9876543210fedcba9876543210"
D_NONCE = bytes(range(32))
A_NONCE = bytes(range(32, 64))

# ---------------------------------------------------------------- the MAC (pure)


def test_known_answer_vectors() -> None:
    # Pinned wire format: also checked with `openssl dgst -sha256 -hmac <secret>` over
    # the transcript bytes.
    assert proof(SECRET, Role.DIALER, D_NONCE, A_NONCE, "dialer-daemon", "acceptor-daemon").hex() == (
        "1669768b0a7e2ba23d571d54a7e27818f5b23427b7715792d181ca5aff4bf9c1")
    assert proof(SECRET, Role.ACCEPTOR, D_NONCE, A_NONCE, "dialer-daemon", "acceptor-daemon").hex() == (
        "8a1e961e0978febf0bf4f742104e9af535082f0b7f0610c396103467b1a1a4fa")


def test_transcript_is_length_prefixed_parts() -> None:
    def lp(x: bytes) -> bytes:
        return struct.pack(">I", len(x)) + x

    expected = lp(LABEL) + lp(b"acceptor") + lp(D_NONCE) + lp(A_NONCE) + lp(b"d") + lp(b"a")
    assert transcript(Role.ACCEPTOR, D_NONCE, A_NONCE, "d", "a") == expected
    # Moving a byte between adjacent parts changes the transcript.
    assert transcript(Role.ACCEPTOR, D_NONCE, A_NONCE, "da", "") != transcript(Role.ACCEPTOR, D_NONCE, A_NONCE, "d", "a")


def _pair(dialer_secret: bytes = SECRET, acceptor_secret: bytes = SECRET) -> tuple[PeerAuth, PeerAuth]:
    dialer = PeerAuth(dialer_secret, Role.DIALER, "dd", D_NONCE, "aa", A_NONCE)
    acceptor = PeerAuth(acceptor_secret, Role.ACCEPTOR, "aa", A_NONCE, "dd", D_NONCE)
    return dialer, acceptor


def test_same_secret_both_proofs_check() -> None:
    dialer, acceptor = _pair()
    assert len(dialer.my_proof()) == MAC_LEN
    assert dialer.check_peer(acceptor.my_proof())
    assert acceptor.check_peer(dialer.my_proof())
    assert dialer.my_proof() != acceptor.my_proof()


def test_reflected_proof_is_rejected() -> None:
    dialer, acceptor = _pair()
    assert not dialer.check_peer(dialer.my_proof())
    assert not acceptor.check_peer(acceptor.my_proof())
    # Reflecting our own challenge back (same nonce, our id) does not help either.
    mirror = PeerAuth(SECRET, Role.ACCEPTOR, "aa", A_NONCE, "aa", A_NONCE)
    assert not mirror.check_peer(mirror.my_proof())


def test_wrong_secret_is_rejected() -> None:
    dialer, acceptor = _pair(acceptor_secret=OTHER)
    assert not dialer.check_peer(acceptor.my_proof())
    assert not acceptor.check_peer(dialer.my_proof())


def test_wrong_nonce_or_id_is_rejected() -> None:
    dialer, _ = _pair()
    # A proof made for another connection (another nonce) or another daemon does not check.
    stale = PeerAuth(SECRET, Role.ACCEPTOR, "aa", bytes(32), "dd", D_NONCE)
    assert not dialer.check_peer(stale.my_proof())
    replay = PeerAuth(SECRET, Role.ACCEPTOR, "aa", A_NONCE, "dd", bytes(32))
    assert not dialer.check_peer(replay.my_proof())
    impostor = PeerAuth(SECRET, Role.ACCEPTOR, "zz", A_NONCE, "dd", D_NONCE)
    assert not dialer.check_peer(impostor.my_proof())
    assert not dialer.check_peer(b"")
    assert not dialer.check_peer(dialer.my_proof()[:-1])


def test_secret_not_in_repr() -> None:
    dialer, _ = _pair()
    assert SECRET.decode() not in repr(dialer)


# ---------------------------------------------------------------- messages


@pytest.mark.parametrize("raw", [
    pytest.param({"t": "auth_challenge", "nonce": bytes(NONCE_LEN - 1), "daemon_id": "d"}, id="nonce-short"),
    pytest.param({"t": "auth_challenge", "nonce": bytes(NONCE_LEN + 1), "daemon_id": "d"}, id="nonce-long"),
    pytest.param({"t": "auth_challenge", "nonce": "x" * NONCE_LEN, "daemon_id": "d"}, id="nonce-text"),
    pytest.param({"t": "auth_challenge", "nonce": bytes(NONCE_LEN)}, id="no-daemon-id"),
    pytest.param({"t": "auth_challenge", "nonce": bytes(NONCE_LEN), "daemon_id": "d", "x": 1}, id="unknown-field"),
    pytest.param({"t": "auth_proof", "mac": bytes(MAC_LEN - 1)}, id="mac-short"),
    pytest.param({"t": "auth_proof", "mac": bytes(MAC_LEN + 1)}, id="mac-long"),
    pytest.param({"t": "auth_proof"}, id="no-mac"),
])
def test_auth_messages_reject_invalid(raw: dict[str, Any]) -> None:
    with pytest.raises(msgspec.ValidationError):
        pp.peer_decoder.decode(msgspec.msgpack.encode(raw))


def test_minor_bumped_for_auth_messages() -> None:
    # 1.4: PeerHello.ucx_error_handling_mode (sent only when not "peer": no minor gate needed);
    # 1.5: RegionInfo.heads, source_rank (D registers with several P ranks only from 1.5 on);
    # 1.6: AgentInfo.members (D announces its joint agents only from 1.6 on);
    # 1.7: AgentInfo.stage/stages (P announces a pipeline-parallel engine's agents only from 1.7 on);
    # 1.8: AgentInfo.ipc, IpcReady, IpcWithdrawn (D offers its worker's KV only from 1.8 on);
    # 1.9: RegSent (D sends it only to a P at 1.9)
    assert (pp.MAJOR, pp.MINOR) == (1, 9) and pp.AUTH_MINOR == 1 and pp.MATCH_KEY_MINOR == 2 and pp.PARTS_MINOR == 3
    assert pp.HETERO_TP_MINOR == 5 and pp.JOINT_MINOR == 6 and pp.STAGES_MINOR == 7 and pp.IPC_MINOR == 8
    assert pp.REG_SENT_MINOR == 9


# ---------------------------------------------------------------- the secret file


def _secret_file(tmp_path: Path, data: bytes, mode: int = 0o600) -> str:
    path = tmp_path / "secret"
    path.write_bytes(data)
    path.chmod(mode)
    return str(path)


@pytest.mark.parametrize("data", [SECRET, SECRET + b"\n", SECRET + b"\r\n"])
def test_secret_file_read_without_trailing_newline(tmp_path: Path, data: bytes) -> None:
    assert read_secret_file(_secret_file(tmp_path, data)) == SECRET


def test_secret_file_mode_0400_is_fine(tmp_path: Path) -> None:
    assert read_secret_file(_secret_file(tmp_path, SECRET, 0o400)) == SECRET


@pytest.mark.parametrize(("data", "mode", "words"), [
    (SECRET, 0o640, "group or others"),
    (SECRET, 0o604, "group or others"),
    (SECRET, 0o620, "group or others"),
    (b"", 0o600, "empty"),
    (b"\n", 0o600, "empty"),
    (b"fifteen-bytes!!\n", 0o600, "shorter than 16"),
    (b"x" * 5000, 0o600, "larger than"),
])
def test_secret_file_refused(tmp_path: Path, data: bytes, mode: int, words: str) -> None:
    path = _secret_file(tmp_path, data, mode)
    with pytest.raises(ConfigError) as info:
        read_secret_file(path)
    assert info.value.field == "side_channel_secret_file"
    assert words in info.value.message
    if data.strip():
        assert data.strip().decode()[:16] not in str(info.value)


def test_secret_file_missing_directory_or_fifo(tmp_path: Path) -> None:
    for path in (tmp_path / "missing", tmp_path):
        with pytest.raises(ConfigError, match="side_channel_secret_file"):
            read_secret_file(str(path))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ConfigError, match="not a regular file"):
        read_secret_file(str(fifo))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_secret_file_unreadable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        read_secret_file(_secret_file(tmp_path, SECRET, 0o000))


def test_load_config_checks_the_secret_file(tmp_path: Path) -> None:
    good = _secret_file(tmp_path, SECRET)
    cfg = load_config(None, env={"PUSHSVC_SIDE_CHANNEL_SECRET_FILE": good},
                      overrides={"engine_id": "e", "runtime_dir": str(tmp_path)})
    assert cfg.side_channel_secret_file == good
    os.chmod(good, 0o644)
    with pytest.raises(ConfigError, match="side_channel_secret_file"):
        load_config(None, env={}, overrides={"engine_id": "e", "runtime_dir": str(tmp_path),
                                             "side_channel_secret_file": good})


# ---------------------------------------------------------------- two managers on loopback


@pytest.mark.asyncio
async def test_same_secret_handshake_succeeds() -> None:
    p, pm, pe = manager("prefill", SECRET)
    d, dm, de = manager("decode", SECRET)
    async with started(p, d):
        peer = await d.ensure("127.0.0.1", p.port, "prefill")
        assert peer.engine_id == "prefill" and peer.agents == {AGENT.agent_name: AGENT}
        await eventually(lambda: sample(pm, "pushsvc_handshakes_total", result="accepted") == 1, "P to accept D")
        assert p.find_engine("decode") is not None
        assert sample(dm, "pushsvc_handshakes_total", result="dialed") == 1
        assert pe.up == ["decode"] and de.up == ["prefill"]


@pytest.mark.asyncio
@pytest.mark.parametrize(("p_secret", "d_secret", "p_reason", "d_reason"), [
    pytest.param(SECRET, None, "auth_missing", "auth_required", id="dialer-without-secret"),
    pytest.param(None, SECRET, "auth_required", "auth_missing", id="acceptor-without-secret"),
    pytest.param(SECRET, OTHER, "auth_bad_proof", "auth_bad_proof", id="other-secret"),
])
async def test_mismatched_secrets_fail_both_sides(p_secret: bytes | None, d_secret: bytes | None,
                                                   p_reason: str, d_reason: str) -> None:
    p, pm, pe = manager("prefill", p_secret)
    d, dm, de = manager("decode", d_secret)
    async with started(p, d):
        with pytest.raises(HandshakeError):
            await d.ensure("127.0.0.1", p.port, "prefill")
        await eventually(lambda: sample(pm, "pushsvc_handshakes_total", result=p_reason) == 1, "P's rejection")
        assert sample(dm, "pushsvc_handshakes_total", result=d_reason) == 1
        assert sample(pm, "pushsvc_rejected_connections_total", listener="side_channel", reason=p_reason) == 1
        assert sample(dm, "pushsvc_handshakes_total", result="dialed") == 0
        assert sample(pm, "pushsvc_handshakes_total", result="accepted") == 0
        assert not p.peers and not d.peers and pe.up == [] and de.up == []


@pytest.mark.asyncio
async def test_auth_required_error_names_the_cause() -> None:
    p, _, _ = manager("prefill", SECRET)
    d, _, _ = manager("decode", None)
    async with started(p, d):
        with pytest.raises(HandshakeError, match="peer requires side-channel authentication"):
            await d.ensure("127.0.0.1", p.port, "prefill")


# ---------------------------------------------------------------- raw clients


def _hello(daemon_id: str = "intruder-daemon") -> pp.PeerHello:
    return pp.PeerHello(daemon_id=daemon_id, engine_id="intruder", side_channel_host="127.0.0.1",
                        side_channel_port=1, agents=[])


@pytest.mark.asyncio
async def test_raw_hello_without_auth_gets_only_a_challenge() -> None:
    p, pm, _ = manager("prefill", SECRET)
    async with started(p):
        raw = await Raw.connect(p.port)
        raw.writer.write(encode_preamble(pp.MAGIC, pp.MAJOR, pp.MINOR) + frame(pp.encode(_hello())))
        assert check_preamble(await raw.reader.readexactly(PREAMBLE.size), pp.MAGIC, pp.MAJOR) == pp.MINOR
        challenge = await raw.read_msg()
        assert isinstance(challenge, pp.AuthChallenge) and challenge.daemon_id == p.daemon_id
        assert await raw.rest() == b""  # closed, nothing more: no hello, no metadata
        raw.close()
        assert sample(pm, "pushsvc_rejected_connections_total", listener="side_channel", reason="auth_missing") == 1
        assert not p.peers


@pytest.mark.asyncio
async def test_old_minor_peer_is_refused_as_unauthenticated() -> None:
    p, pm, _ = manager("prefill", SECRET)
    async with started(p):
        raw = await Raw.connect(p.port)
        raw.writer.write(encode_preamble(pp.MAGIC, pp.MAJOR, 0) + frame(pp.encode(_hello())))
        await raw.reader.readexactly(PREAMBLE.size)
        assert isinstance(await raw.read_msg(), pp.AuthChallenge)
        assert await raw.rest() == b""
        raw.close()
        assert sample(pm, "pushsvc_handshakes_total", result="auth_missing") == 1


@pytest.mark.asyncio
async def test_reflected_proof_is_refused_on_the_wire() -> None:
    # The attacker gets the daemon to prove itself (as acceptor) over the attacker's own
    # nonce, then hands that proof back as its own: it must not pass as a dialer's.
    p, pm, _ = manager("prefill", SECRET)
    async with started(p):
        raw = await Raw.connect(p.port)
        raw.writer.write(encode_preamble(pp.MAGIC, pp.MAJOR, pp.MINOR))
        await raw.reader.readexactly(PREAMBLE.size)
        theirs = await raw.read_msg()
        assert isinstance(theirs, pp.AuthChallenge)
        raw.send(pp.AuthChallenge(nonce=theirs.nonce, daemon_id="evil"))  # their own nonce, reflected
        their_proof = await raw.read_msg()
        assert isinstance(their_proof, pp.AuthProof)
        raw.send(their_proof)
        assert await raw.rest() == b""
        raw.close()
        assert sample(pm, "pushsvc_rejected_connections_total", listener="side_channel", reason="auth_bad_proof") == 1
        assert not p.peers


@pytest.mark.asyncio
async def test_authenticated_client_must_say_hello_as_itself() -> None:
    # A client with the secret proves itself as "honest" and then sends a hello for
    # another daemon id: refused, the authenticated identity is bound to the hello.
    p, pm, _ = manager("prefill", SECRET)
    async with started(p):
        raw = await Raw.connect(p.port)
        nonce = os.urandom(NONCE_LEN)
        raw.writer.write(encode_preamble(pp.MAGIC, pp.MAJOR, pp.MINOR)
                         + frame(pp.encode(pp.AuthChallenge(nonce=nonce, daemon_id="honest"))))
        await raw.reader.readexactly(PREAMBLE.size)
        theirs = await raw.read_msg()
        mine = PeerAuth(SECRET, Role.DIALER, "honest", nonce, theirs.daemon_id, theirs.nonce)
        raw.send(pp.AuthProof(mac=mine.my_proof()))
        their_proof = await raw.read_msg()
        assert mine.check_peer(their_proof.mac)
        hello = await raw.read_msg()  # authenticated: the daemon's hello with its agents
        assert isinstance(hello, pp.PeerHello) and hello.agents == [AGENT]
        raw.send(_hello("someone-else"))
        assert await raw.rest() == b""
        raw.close()
        assert sample(pm, "pushsvc_rejected_connections_total", listener="side_channel", reason="ProtocolError") == 1
        assert not p.peers


@pytest.mark.asyncio
async def test_silent_client_is_dropped_at_the_handshake_timeout() -> None:
    p, pm, _ = manager("prefill", SECRET, handshake_timeout_s=0.3)
    async with started(p):
        raw = await Raw.connect(p.port)
        await raw.reader.readexactly(PREAMBLE.size)
        assert isinstance(await raw.read_msg(), pp.AuthChallenge)
        assert await raw.rest() == b""  # closed by the daemon, well before WAIT_S
        raw.close()
        assert sample(pm, "pushsvc_rejected_connections_total", listener="side_channel", reason="TimeoutError") == 1
