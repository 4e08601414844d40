"""A PUSH_REG that names blocks out of range or twice, or that its sender does not own,
causes no WRITE (real daemons, real NIXL, a hostile peer from ``rogue_peer.py``).

The rogue peer's agent has real registered memory laid out like D's, so P could write
into it: the first test shows P does, for a valid PUSH_REG (the control), and then
that every bad one leaves its memory, D's memory and P's ``done`` count unchanged,
is counted in ``pushsvc_malformed_inputs``, and does not keep P's staged blocks from
reaching the legitimate registration afterwards.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvworker import pattern

pytestmark = pytest.mark.nixl

HERE = Path(__file__).parent
LAYERS = 3
P_BLOCKS = 24
D_BLOCKS = 40
BLOCK_LEN = 2048


class Rogue:
    def __init__(self, P, known: bool, engine_id: str = "rogue") -> None:
        cmd = [sys.executable, str(HERE / "rogue_peer.py"), "--port", str(P.side_port), "--engine-id", engine_id,
               "--layers", str(LAYERS), "--blocks", str(D_BLOCKS), "--block-len", str(BLOCK_LEN)]
        self.proc = subprocess.Popen([*cmd, *(["--known"] if known else [])], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        hello = self._read()
        self.agent = hello["agent"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"rogue peer exited with {self.proc.wait()}"
        reply = json.loads(line)
        assert reply["ok"], reply
        return reply

    def call(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def push_reg(self, request_id: str, blocks: list[list[int]], *, engine: str = "rogue", rank: int = 0,
                 tp: int = 1, remote_port: int = 0, raw: bool = False) -> None:
        self.call("push_reg", raw=raw, request_id=request_id, decode_engine_id=engine, decode_host="127.0.0.1",
                  decode_port=1, decode_tp_size=tp, local_block_ids=blocks, remote_engine_id="prefill",
                  remote_host="127.0.0.1", remote_port=remote_port, remote_tp_size=1, decode_rank=rank)

    def digest(self) -> str:
        return self.call("digest")["digest"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(20)
        self.proc.stdout.close()


@pytest.fixture
def rogues():
    started: list[Rogue] = []
    yield started
    for r in started:
        if r.proc.poll() is None:
            r.close()


def _pair(spawn):
    P = spawn.daemon("prefill", "--lease-s", "60")
    D = spawn.daemon("decode", "--watchdog-s", "60")
    pw = spawn.worker(P, "producer", layers=LAYERS, blocks=P_BLOCKS, block_len=BLOCK_LEN, seed=1)
    dw = spawn.worker(D, "consumer", layers=LAYERS, blocks=D_BLOCKS, block_len=BLOCK_LEN, seed=2)
    assert pw.hello["ok"] and dw.hello["ok"]
    return P, D, pw, dw


def _recv(dw, P, request_id, blocks):
    dw.call("recv", request_id=request_id, block_ids=[blocks], remote_engine_id=P.engine_id,
            remote_host="127.0.0.1", remote_port=P.side_port)


def _wait_metric(daemon, name: str, want: float, timeout: float = 20.0, **labels) -> None:
    deadline = time.monotonic() + timeout
    while daemon.metric(name, **labels) < want:
        assert time.monotonic() < deadline, (name, labels, daemon.metric(name, **labels))
        time.sleep(0.05)


def _d_holds(dw, mapping: dict[int, int]) -> None:
    """D's blocks in ``mapping`` hold P's blocks; every other block D's own pattern."""
    digests = dw.digests()
    for r in range(2 * LAYERS):
        for b in range(D_BLOCKS):
            data = pattern(1, r, mapping[b], BLOCK_LEN) if b in mapping else pattern(2, r, b, BLOCK_LEN)
            assert digests[r][b] == hashlib.sha1(data).hexdigest(), (r, b)


BAD = [
    # (case, PUSH_REG overrides, malformed reason)
    ("block_beyond_layout", dict(blocks=[[3, D_BLOCKS + 7]]), "push_reg_blocks"),
    ("same_block_twice", dict(blocks=[[5, 5]]), "push_reg_blocks"),
    ("negative_block", dict(blocks=[[-1, 2]], raw=True), "push_reg"),
    ("other_engine", dict(blocks=[[1, 2]], engine="decode"), "push_reg_sender_mismatch"),
    ("other_rank", dict(blocks=[[1, 2]], rank=1), "push_reg_sender_mismatch"),
    ("other_tp", dict(blocks=[[1, 2]], tp=2), "push_reg_sender_mismatch"),
]


def test_bad_push_regs_from_a_known_peer_cause_no_write(spawn, rogues):
    P, D, pw, dw = _pair(spawn)
    rogue = Rogue(P, known=True)
    rogues.append(rogue)
    # Control: a valid PUSH_REG from this peer is written into its memory.
    before = rogue.digest()
    pw.call("ready", request_id="control", block_ids=[[0, 1]])
    rogue.push_reg("control", [[1, 2]])
    assert pw.wait("control")["type"] == "SendDone"
    assert rogue.digest() != before
    assert P.metric("pushsvc_transfers_total", result="done") == 1

    # P's blocks for the legitimate request wait while every bad PUSH_REG names it.
    pw.call("ready", request_id="victim", block_ids=[[4, 5, 6]])
    rogue_memory = rogue.digest()
    for n, (case, kw, reason) in enumerate(BAD, start=1):
        seen = P.metric("pushsvc_malformed_inputs_total", source="notification", reason=reason)
        rogue.push_reg("victim", **kw)
        _wait_metric(P, "pushsvc_malformed_inputs_total", seen + 1, source="notification", reason=reason)
        assert P.metric("pushsvc_transfers_total", result="done") == 1, case
        assert pw.wait("victim", timeout=0.2) is None, case  # P's request is untouched
    rogue.call("pump", s=0.3)
    assert rogue.digest() == rogue_memory
    _d_holds(dw, {})
    assert P.live_info()["tables"]["p_registrations"] == 0, "no bad PUSH_REG was kept"
    # The legitimate registration gets P's staged blocks, exactly.
    _recv(dw, P, "victim", [30, 31, 32])
    assert dw.wait("victim")["type"] == "RecvDone"
    assert pw.wait("victim")["type"] == "SendDone"
    _d_holds(dw, {30: 4, 31: 5, 32: 6})
    assert P.metric("pushsvc_transfers_total", result="done") == 2
    assert rogue.digest() == rogue_memory


def test_push_reg_from_an_unknown_agent_naming_the_real_d_causes_no_write(spawn, rogues):
    P, D, pw, dw = _pair(spawn)
    _recv(dw, P, "warm", [1])  # P and D know each other
    pw.call("ready", request_id="warm", block_ids=[[2]])
    assert dw.wait("warm")["type"] == "RecvDone"
    rogue = Rogue(P, known=False)  # its agent is in no hello P received
    rogues.append(rogue)
    # A request id only the stranger registers: P's blocks for it are never written.
    rogue.push_reg("forged", [[10, 11]], engine="decode", remote_port=P.side_port)
    _wait_metric(P, "pushsvc_notifications_total", 1 + 1, kind="push_reg")
    pw.call("ready", request_id="forged", block_ids=[[7, 8]])
    # Kept unverified: never matched, and P's request is not failed for it.
    assert pw.call("wait", request_id="forged", timeout=1.0)["event"] is None
    assert P.metric("pushsvc_notifications_total", kind="push_reg_unverified") == 1
    assert P.metric("pushsvc_transfers_total", result="done") == 1
    pw.call("evict", request_ids=["forged"])
    assert pw.wait("forged")["reason"] == "cancelled"
    # The stranger registers first under a real request's id: D's own PUSH_REG still
    # takes the request, and P's blocks land in D's blocks.
    rogue.push_reg("real", [[12, 13]], engine="decode", remote_port=P.side_port)
    _wait_metric(P, "pushsvc_notifications_total", 3, kind="push_reg")
    _recv(dw, P, "real", [20, 21])
    _wait_metric(P, "pushsvc_notifications_total", 4, kind="push_reg")
    pw.call("ready", request_id="real", block_ids=[[3, 9]])
    assert dw.wait("real")["type"] == "RecvDone"
    assert pw.wait("real")["type"] == "SendDone"
    _d_holds(dw, {1: 2, 20: 3, 21: 9})
    assert P.metric("pushsvc_transfers_total", result="done") == 2
    # The stranger's unverified registrations go at their TTL (the handshake timeout).
    deadline = time.monotonic() + 10
    while any(P.live_info()["tables"].values()) or any(D.live_info()["tables"].values()):
        assert time.monotonic() < deadline, (P.live_info()["tables"], D.live_info()["tables"])
        time.sleep(0.05)
