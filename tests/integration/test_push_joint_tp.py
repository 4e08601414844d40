"""D TP = k x P TP with real daemons, real NIXL and worker processes of vLLM CPU's layout.

P's one rank holds every KV head of a block, D's two ranks half of them each, head-major
(``[blocks, heads, block_size, 2*head]``). D's daemon joins its two ranks' memory in one
NIXL agent (``server/joints.py``), which P pairs with as at equal TP: one registration
(sent once both D ranks registered the request), one WRITE of P's two head slices, one
completion, and each D rank hears ``RecvDone``. What must not happen: a request that
one D rank withdrew, or that the two D ranks registered differently, going out; a block
handed back while P may still write into it.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time

import pytest

from kvworker import pattern
from procs import joint_announced, tables_empty

pytestmark = pytest.mark.nixl

LAYERS = 2
P_BLOCKS = 16
D_BLOCKS = 24
P_BLOCK_LEN = 4096
HEADS = 4  # P's KV heads per block; each of D's 2 ranks holds 2


def _p_rank(spawn, P, **opts):
    opts = {"block_len": P_BLOCK_LEN, "heads": HEADS, **opts}
    w = spawn.worker(P, "producer", layers=LAYERS, blocks=P_BLOCKS, rank=0, tp_size=1, seed=10, **opts)
    assert w.hello["ok"], w.hello
    return w


def _d_ranks(spawn, D, tp=2, **opts):
    opts = {"block_len": P_BLOCK_LEN // tp, "heads": HEADS // tp, **opts}
    workers = []
    for rank in range(tp):
        w = spawn.worker(D, "consumer", layers=LAYERS, blocks=D_BLOCKS, rank=rank, tp_size=tp, seed=2 + rank, **opts)
        assert w.hello["ok"], w.hello
        workers.append(w)
    return workers


def _recv(dw, P, rid, blocks, **extra):
    dw.call("recv", request_id=rid, block_ids=[blocks], remote_engine_id=P.engine_id, remote_host="127.0.0.1",
            remote_port=P.side_port, remote_tp_size=1, **extra)


def _never_written(P, D, pw, rid) -> None:
    """P's blocks for ``rid``, ready now, are never written (D's ended the request) and
    are freed when P's worker withdraws them."""
    pw.call("ready", request_id=rid, block_ids=[[1, 2]])
    time.sleep(0.3)
    assert P.metric("pushsvc_transfers_total", result="done") == 0, "an ended registration is never written"
    pw.call("evict", request_ids=[rid])
    assert pw.wait(rid) == {"type": "SendFailed", "request_id": rid, "reason": "cancelled"}
    assert tables_empty(P, D)


@pytest.mark.parametrize("order", ["registration_first", "blocks_first"])
def test_one_p_rank_fills_two_d_ranks_by_head_in_one_write_and_verifies(spawn, order):
    P = spawn.daemon("prefill", "--verify")
    D = spawn.daemon("decode", "--verify")
    pw = _p_rank(spawn, P)
    ds = _d_ranks(spawn, D)
    assert [(j["rank"], j["tp_size"], j["members"]) for j in D.live_info()["joints"]] == [(0, 1, [0, 1])]
    status = subprocess.run([sys.executable, "-m", "pushsvc", "status", "--url", D.url], capture_output=True,
                            text=True, timeout=30)
    joint_rows = [line.split() for line in status.stdout.splitlines() if line.startswith("0/1 ")]
    assert status.returncode == 0 and [(r[2], r[3]) for r in joint_rows] == [("0,1", "0")], status.stdout
    p_blocks, d_blocks = [3, 7, 8, 15], [20, 2, 11, 5]
    rid = "cmpl-joint-0"
    if order == "blocks_first":
        pw.call("ready", request_id=rid, block_ids=[p_blocks])
        time.sleep(0.2)
    for d in ds:
        _recv(d, P, rid, d_blocks)
    if order == "registration_first":
        time.sleep(0.3)
        pw.call("ready", request_id=rid, block_ids=[p_blocks])
    for d in ds:
        assert d.wait(rid) == {"type": "RecvDone", "request_id": rid}, D.log()[-3000:]
    assert pw.wait(rid) == {"type": "SendDone", "request_id": rid}
    half = P_BLOCK_LEN // 2
    for j, d in enumerate(ds):
        rows = d.digests()
        for region in range(2 * LAYERS):
            got = [rows[region][b] for b in d_blocks]
            want = [hashlib.sha1(pattern(10, region, b, P_BLOCK_LEN)[j * half:(j + 1) * half]).hexdigest()
                    for b in p_blocks]
            assert got == want, f"D rank {j}, region {region}: not head slice {j} of P's blocks"
            untouched = [b for b in range(D_BLOCKS) if b not in d_blocks]
            assert [rows[region][b] for b in untouched] == [
                hashlib.sha1(pattern(2 + j, region, b, half)).hexdigest() for b in untouched]
    # One WRITE, one verification over both D ranks' blocks.
    assert P.metric("pushsvc_transfers_total", result="done") == 1
    assert P.metric("pushsvc_transfer_bytes_total") == len(p_blocks) * 2 * LAYERS * P_BLOCK_LEN
    assert D.metric("pushsvc_verify_total", result="identical") == 1
    assert D.metric("pushsvc_verify_blocks_total", result="identical") == 2 * len(d_blocks) * 2 * LAYERS
    assert D.metric("pushsvc_verify_blocks_total", result="mismatch") == 0
    assert tables_empty(P, D)


def test_replicated_kv_goes_whole_to_every_d_rank(spawn):
    """MLA: every TP rank holds the whole latent row, so P's one rank writes its whole
    row into each of D's two ranks (one WRITE through the joint)."""
    P = spawn.daemon("prefill", "--verify")
    D = spawn.daemon("decode", "--verify")
    pw = _p_rank(spawn, P, heads=0, replicated=1)
    ds = _d_ranks(spawn, D, block_len=P_BLOCK_LEN, heads=0, replicated=1)
    rid = "cmpl-joint-mla"
    for d in ds:
        _recv(d, P, rid, [9, 4])
    pw.call("ready", request_id=rid, block_ids=[[1, 2]])
    for d in ds:
        assert d.wait(rid) == {"type": "RecvDone", "request_id": rid}, D.log()[-3000:]
        rows = d.digests()
        for region in range(2 * LAYERS):
            assert [rows[region][9], rows[region][4]] == [
                hashlib.sha1(pattern(10, region, b, P_BLOCK_LEN)).hexdigest() for b in (1, 2)]
    assert pw.wait(rid) == {"type": "SendDone", "request_id": rid}
    assert P.metric("pushsvc_transfer_bytes_total") == 2 * 2 * 2 * LAYERS * P_BLOCK_LEN
    assert D.metric("pushsvc_verify_total", result="identical") == 1
    assert tables_empty(P, D)


def test_a_d_rank_that_withdraws_before_the_other_registered_ends_the_request_for_both(spawn):
    P = spawn.daemon("prefill")
    D = spawn.daemon("decode")
    pw = _p_rank(spawn, P)
    d0, d1 = _d_ranks(spawn, D)
    rid = "cmpl-joint-evict-early"
    _recv(d0, P, rid, [1, 2])
    time.sleep(0.2)
    assert D.live_info()["joints"][0]["gathering"] == 1
    d0.call("evict", request_ids=[rid])
    event = d0.wait(rid)
    assert event == {"type": "RecvFailed", "request_id": rid, "block_ids": [1, 2], "reason": "cancelled"}, event
    assert D.live_info()["joints"][0]["gathering"] == 0
    # D rank 1's registration, coming after, hears at once: there is nothing to join.
    _recv(d1, P, rid, [1, 2])
    assert d1.wait(rid, timeout=3) == {"type": "RecvFailed", "request_id": rid, "block_ids": [1, 2],
                                       "reason": "cancelled"}
    assert D.live_info()["joints"][0]["gathering"] == 0
    assert P.live_info()["tables"]["p_registrations"] == 0, "nothing went to P"
    _never_written(P, D, pw, rid)


def test_a_withdrawal_after_the_registration_went_out_frees_both_d_ranks_once_p_confirmed(spawn):
    P = spawn.daemon("prefill")
    D = spawn.daemon("decode")
    pw = _p_rank(spawn, P)
    ds = _d_ranks(spawn, D)
    rid = "cmpl-joint-evict-late"
    for d in ds:
        _recv(d, P, rid, [4, 5])
    deadline = time.monotonic() + 5
    while P.live_info()["tables"]["p_registrations"] != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert P.live_info()["tables"]["p_registrations"] == 1, "one registration for both D ranks"
    for d in ds:  # vLLM's scheduler withdraws it from every rank
        d.call("evict", request_ids=[rid])
    for d in ds:
        event = d.wait(rid)
        assert event is not None and event["type"] == "RecvFailed" and event["reason"] == "cancelled", event
        assert sorted(event["block_ids"]) == [4, 5]
        assert d.wait(rid, timeout=0.5) is None, "exactly one final event"
    assert P.live_info()["tables"]["p_registrations"] == 0
    _never_written(P, D, pw, rid)


def test_d_ranks_that_register_different_blocks_fail_without_a_push(spawn):
    P = spawn.daemon("prefill")
    D = spawn.daemon("decode")
    _p_rank(spawn, P)
    d0, d1 = _d_ranks(spawn, D)
    rid = "cmpl-joint-disagree"
    _recv(d0, P, rid, [1, 2])
    time.sleep(0.1)
    _recv(d1, P, rid, [1, 3])
    for d in (d0, d1):
        event = d.wait(rid)
        assert event is not None and event["type"] == "RecvFailed", event
        assert "different blocks" in event["reason"], event
    assert D.metric("pushsvc_failures_total", kind="joint_refused") == 1, "one request, one failure"
    assert P.live_info()["tables"]["p_registrations"] == 0
    assert tables_empty(P, D)


def test_a_d_rank_that_never_registers_fails_the_other_at_the_watchdog(spawn):
    P = spawn.daemon("prefill")
    D = spawn.daemon("decode", "--watchdog-s", "1")
    _p_rank(spawn, P)
    d0, d1 = _d_ranks(spawn, D)
    rid = "cmpl-joint-alone"
    _recv(d0, P, rid, [6])
    event = d0.wait(rid, timeout=5)
    assert event is not None and event["type"] == "RecvFailed", event
    assert event["reason"].startswith("watchdog: D ranks [0, 1] did not all register it"), event
    assert D.metric("pushsvc_failures_total", kind="watchdog") == 1
    _recv(d1, P, rid, [6])  # late: it hears the same at once, counted once
    late = d1.wait(rid, timeout=0.5)
    assert late is not None and late["reason"] == event["reason"], late
    assert D.metric("pushsvc_failures_total", kind="watchdog") == 1
    assert tables_empty(P, D)


def test_p_blocks_that_do_not_split_by_d_tp_fail_the_push_naming_it(spawn):
    """P's blocks are not head-major (NHD): its heads cannot be cut into D's ranks'
    slices, so P refuses the WRITE and both D ranks hear why."""
    P = spawn.daemon("prefill")
    D = spawn.daemon("decode")
    pw = _p_rank(spawn, P, heads=0)
    ds = _d_ranks(spawn, D)
    rid = "cmpl-joint-nhd"
    for d in ds:
        _recv(d, P, rid, [7, 8])
    pw.call("ready", request_id=rid, block_ids=[[1, 2]])
    assert pw.wait(rid)["type"] == "SendFailed"
    for d in ds:
        event = d.wait(rid)
        assert event is not None and event["type"] == "RecvFailed", event
        assert "push_failed_remote" in event["reason"] and "not head-major" in event["reason"], event
        assert "between 2 D ranks" in event["reason"], event
    assert tables_empty(P, D)


def _exchange(P, pw, ds, rid, d_block, p_block):
    for d in ds:
        _recv(d, P, rid, [d_block])
    pw.call("ready", request_id=rid, block_ids=[[p_block]])
    for d in ds:
        assert d.wait(rid) == {"type": "RecvDone", "request_id": rid}
    assert pw.wait(rid) == {"type": "SendDone", "request_id": rid}


def test_a_replaced_d_worker_gets_a_new_joint_that_serves_the_next_request(spawn):
    """D rank 1's worker restarts: the joint over the old one is withdrawn, a new one
    (a new agent) is built once the new worker registered KV, and P, already connected,
    learns it from D's ``AgentsUpdate`` and writes the next request through it."""
    P = spawn.daemon("prefill")
    D = spawn.daemon("decode")
    pw = _p_rank(spawn, P)
    d0, d1 = _d_ranks(spawn, D)
    _exchange(P, pw, [d0, d1], "cmpl-joint-before-restart", 2, 5)
    joint_announced(P, D)
    first = D.live_info()["joints"][0]["agent"]
    d1.close()
    deadline = time.monotonic() + 5
    while D.live_info()["joints"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert D.live_info()["joints"] == [], "a joint without all of its members is withdrawn"
    d1 = spawn.worker(D, "consumer", layers=LAYERS, blocks=D_BLOCKS, rank=1, tp_size=2, seed=3,
                      block_len=P_BLOCK_LEN // 2, heads=HEADS // 2)
    assert d1.hello["ok"], d1.hello
    joint_announced(P, D)
    assert D.live_info()["joints"][0]["agent"] != first
    assert first not in P.live_info()["peers"][0]["agents"], "P dropped the old joint agent"
    _exchange(P, pw, [d0, d1], "cmpl-joint-after-restart", 3, 4)
    assert D.live_info()["retiring_agents"] == [], "the old joint and D rank 1's old agent were closed"
    assert tables_empty(P, D)


def test_a_block_that_a_d_rank_holds_for_another_p_is_not_registered_through_the_joint(spawn):
    """D rank 0 holds block 5 for a request from a P of its own TP (equal TP, its own
    agent) while a request for P TP 1 names block 5 too: once both D ranks registered the
    latter it is refused for both (two WRITEs must never land in one block), and the
    former is untouched."""
    P = spawn.daemon("prefill")
    P2 = spawn.daemon("prefill-tp2")
    D = spawn.daemon("decode")
    _p_rank(spawn, P)
    for r in range(2):
        w = spawn.worker(P2, "producer", layers=LAYERS, blocks=P_BLOCKS, rank=r, tp_size=2, seed=30 + r,
                         block_len=P_BLOCK_LEN // 2, heads=HEADS // 2)
        assert w.hello["ok"], w.hello
    d0, d1 = _d_ranks(spawn, D)
    joint_rid, own_rid = "cmpl-joint-held", "cmpl-own-tp2"
    _recv(d0, P, joint_rid, [5, 6])  # gathering: holds nothing yet
    d0.call("recv", request_id=own_rid, block_ids=[[5]], remote_engine_id=P2.engine_id, remote_host="127.0.0.1",
            remote_port=P2.side_port, remote_tp_size=2)
    deadline = time.monotonic() + 5
    while P2.live_info()["tables"]["p_registrations"] != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert P2.live_info()["tables"]["p_registrations"] == 1, "D rank 0's own registration went to P2 rank 0"
    _recv(d1, P, joint_rid, [5, 6])
    for d in (d0, d1):
        event = d.wait(joint_rid)
        assert event is not None and event["type"] == "RecvFailed", event
        assert f"block 5 is held by live request {own_rid}" in event["reason"], event
    assert P.live_info()["tables"]["p_registrations"] == 0, "nothing went to P"
    assert d0.wait(own_rid, timeout=0.5) is None, "D rank 0's own request is still waiting for P2"
    d0.call("evict", request_ids=[own_rid])
    event = d0.wait(own_rid)
    assert event is not None and event["reason"] == "cancelled", event
