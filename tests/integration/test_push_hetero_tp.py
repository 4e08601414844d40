"""P TP = k x D TP with real daemons, real NIXL and worker processes of vLLM CPU's layout.

Each P rank holds half of the KV heads of every block (vLLM shards KV heads by rank in
order), D's one rank all of them, head-major (``[blocks, heads, block_size, 2*head]``):
P rank ``s`` writes its whole block into head slice ``s`` of D's block. D's request is
done only when both P ranks landed; one P rank that cannot write fails it, and D's
blocks are given back only once neither P rank can still write into them.
"""

from __future__ import annotations

import hashlib
import time

import pytest

from kvworker import pattern
from procs import tables_empty

pytestmark = pytest.mark.nixl

LAYERS = 2
P_BLOCKS = 16
D_BLOCKS = 24
D_BLOCK_LEN = 4096
HEADS = 4  # D's KV heads per block; each of 2 P ranks holds 2


def _p_ranks(spawn, P, tp=2, block_len=None, **opts):
    workers = []
    for rank in range(tp):
        w = spawn.worker(P, "producer", layers=LAYERS, blocks=P_BLOCKS, rank=rank, tp_size=tp,
                         block_len=block_len or D_BLOCK_LEN // tp, heads=HEADS // tp, seed=10 + rank, **opts)
        assert w.hello["ok"], w.hello
        workers.append(w)
    return workers


def _d_rank(spawn, D, heads=HEADS, rank=0, tp=1):
    w = spawn.worker(D, "consumer", layers=LAYERS, blocks=D_BLOCKS, block_len=D_BLOCK_LEN, heads=heads, seed=2,
                     rank=rank, tp_size=tp)
    assert w.hello["ok"], w.hello
    return w


def _recv(dw, P, rid, blocks, p_tp=2, **extra):
    dw.call("recv", request_id=rid, block_ids=[blocks], remote_engine_id=P.engine_id, remote_host="127.0.0.1",
            remote_port=P.side_port, remote_tp_size=p_tp, **extra)


def _expected(mapping: dict[int, int], p_tp=2) -> list[list[str]]:
    """D's digests: each mapped block the P ranks' halves in rank order, D's own elsewhere."""
    out = []
    for r in range(2 * LAYERS):
        row = []
        for b in range(D_BLOCKS):
            if b in mapping:
                data = b"".join(pattern(10 + s, r, mapping[b], D_BLOCK_LEN // p_tp) for s in range(p_tp))
            else:
                data = pattern(2, r, b, D_BLOCK_LEN)
            row.append(hashlib.sha1(data).hexdigest())
        out.append(row)
    return out



@pytest.mark.parametrize("order", ["registration_first", "blocks_first"])
def test_two_p_ranks_fill_one_d_rank_by_head_and_verify(spawn, order):
    P = spawn.daemon("prefill", "--verify")
    D = spawn.daemon("decode", "--verify")
    p0, p1 = _p_ranks(spawn, P)
    dw = _d_rank(spawn, D)
    p_blocks, d_blocks = [3, 7, 8, 15], [20, 2, 11, 5]
    rid = "cmpl-hetero-0"
    if order == "registration_first":
        _recv(dw, P, rid, d_blocks)
        time.sleep(0.3)
    for w in (p0, p1):
        w.call("ready", request_id=rid, block_ids=[p_blocks])
        if order == "blocks_first":
            time.sleep(0.2)  # one P rank's blocks wait staged, the other's come later
    if order == "blocks_first":
        _recv(dw, P, rid, d_blocks)
    assert dw.wait(rid) == {"type": "RecvDone", "request_id": rid}, D.log()[-3000:]
    assert p0.wait(rid) == {"type": "SendDone", "request_id": rid}
    assert p1.wait(rid) == {"type": "SendDone", "request_id": rid}
    assert dw.digests() == _expected(dict(zip(d_blocks, p_blocks)))
    # Each P rank's digests checked against its own head slice of D's blocks.
    assert D.metric("pushsvc_verify_total", result="identical") == 1
    assert D.metric("pushsvc_verify_blocks_total", result="identical") == 2 * len(d_blocks) * 2 * LAYERS
    assert D.metric("pushsvc_verify_blocks_total", result="mismatch") == 0
    assert P.metric("pushsvc_transfer_bytes_total") == len(p_blocks) * 2 * LAYERS * D_BLOCK_LEN
    assert tables_empty(P, D)


def test_d_blocks_stay_held_until_every_p_rank_settled(spawn):
    """Only P rank 0's blocks are ready when D withdraws: P rank 1 still holds the
    registration, so D's blocks are given back only after P rank 1 confirmed too."""
    P = spawn.daemon("prefill")
    D = spawn.daemon("decode")
    p0, p1 = _p_ranks(spawn, P)
    dw = _d_rank(spawn, D)
    rid = "cmpl-hetero-1"
    _recv(dw, P, rid, [4, 5])
    time.sleep(0.3)
    p0.call("ready", request_id=rid, block_ids=[[1, 2]])
    assert p0.wait(rid) == {"type": "SendDone", "request_id": rid}
    assert dw.wait(rid, timeout=0.5) is None, "one P rank landed: the request is not done"
    dw.call("evict", request_ids=[rid])
    event = dw.wait(rid)
    assert event is not None and event["type"] == "RecvFailed" and event["reason"] == "cancelled", event
    assert sorted(event["block_ids"]) == [4, 5]
    assert dw.wait(rid, timeout=0.5) is None, "exactly one final event"
    assert P.live_info()["tables"]["p_registrations"] == 0, "P rank 1 dropped the registration before D's answer"
    # P rank 1's registration was cancelled (and tombstoned): its blocks, ready now, are
    # never written into D's blocks, which D may already have reused.
    p1.call("ready", request_id=rid, block_ids=[[1, 2]])
    time.sleep(0.3)
    assert P.live_info()["tables"] == {**P.live_info()["tables"], "p_staged": 1, "p_writing": 0}
    p1.call("evict", request_ids=[rid])
    assert p1.wait(rid) == {"type": "SendFailed", "request_id": rid, "reason": "cancelled"}
    assert tables_empty(P, D)


@pytest.mark.parametrize("failing", [1, 2], ids=["after_the_other_landed", "before_the_other_wrote"])
def test_a_p_rank_that_cannot_write_fails_the_request_cleanly(spawn, failing):
    """A P rank whose blocks are not the size of D's head slice refuses to write
    (layout_mismatch) and tells D. ``after_the_other_landed``: P rank 0 wrote first, P
    rank 1 fails: nothing can write any more, D fails the request at once.
    ``before_the_other_wrote``: P rank 0 fails first while P rank 1 still holds the
    registration: D withdraws it from P rank 1 and fails the request once P rank 1
    confirmed. Either way one final event, never done, one failure counted."""
    P = spawn.daemon("prefill")
    D = spawn.daemon("decode")
    bad = {"block_len": D_BLOCK_LEN // 4, "heads": 1}
    good = {"block_len": D_BLOCK_LEN // 2, "heads": HEADS // 2}
    p0 = spawn.worker(P, "producer", layers=LAYERS, blocks=P_BLOCKS, rank=0, tp_size=2, seed=10,
                      **(good if failing == 1 else bad))
    p1 = spawn.worker(P, "producer", layers=LAYERS, blocks=P_BLOCKS, rank=1, tp_size=2, seed=11,
                      **(bad if failing == 1 else good))
    dw = _d_rank(spawn, D)
    rid = "cmpl-hetero-2"
    _recv(dw, P, rid, [6, 7])
    time.sleep(0.3)
    p0.call("ready", request_id=rid, block_ids=[[1, 2]])
    if failing == 1:
        assert p0.wait(rid) == {"type": "SendDone", "request_id": rid}
        assert dw.wait(rid, timeout=0.5) is None, "one P rank landed: not done yet"
        p1.call("ready", request_id=rid, block_ids=[[1, 2]])
        assert p1.wait(rid)["type"] == "SendFailed"
    else:
        assert p0.wait(rid)["type"] == "SendFailed"
    event = dw.wait(rid)
    assert event is not None and event["type"] == "RecvFailed", event
    assert "push_failed_remote" in event["reason"] and "block length differs" in event["reason"], event
    assert sorted(event["block_ids"]) == [6, 7]
    assert dw.wait(rid, timeout=1.0) is None, "exactly one final event"
    assert D.metric("pushsvc_failures_total", kind="push_failed_remote") == 1
    if failing == 2:  # P rank 1 confirmed the cancel: its blocks, ready now, are never written
        assert P.live_info()["tables"]["p_registrations"] == 0
        p1.call("ready", request_id=rid, block_ids=[[1, 2]])
        p1.call("evict", request_ids=[rid])
        assert p1.wait(rid) == {"type": "SendFailed", "request_id": rid, "reason": "cancelled"}
    assert tables_empty(P, D)


def test_replicated_kv_is_written_by_one_p_rank_and_released_by_the_other(spawn):
    """MLA: every TP rank holds the whole latent row. P rank 0 writes all of it into D's
    blocks; P rank 1 gets a release (no blocks), frees its blocks and writes nothing. The
    exchange has a match key (the proxy's or P's connector's ``transfer_id``): a release
    that comes before P rank 1's blocks frees them on arrival by it."""
    P = spawn.daemon("prefill", "--verify")
    D = spawn.daemon("decode", "--verify")
    ps = [spawn.worker(P, "producer", layers=LAYERS, blocks=P_BLOCKS, rank=r, tp_size=2, block_len=D_BLOCK_LEN,
                       replicated=1, seed=10 + r) for r in range(2)]
    dw = spawn.worker(D, "consumer", layers=LAYERS, blocks=D_BLOCKS, block_len=D_BLOCK_LEN, replicated=1, seed=2)
    rid, key = "cmpl-mla-tp2", "xfer-mla-1"
    _recv(dw, P, rid, [9, 4], match_key=key)
    time.sleep(0.3)
    for p in ps:
        p.call("ready", request_id=rid, block_ids=[[1, 2]], match_key=key)
    assert dw.wait(rid) == {"type": "RecvDone", "request_id": rid}
    for p in ps:
        assert p.wait(rid) == {"type": "SendDone", "request_id": rid}
    rows = dw.digests()
    for region in range(2 * LAYERS):
        assert [rows[region][9], rows[region][4]] == [
            hashlib.sha1(pattern(10, region, b, D_BLOCK_LEN)).hexdigest() for b in (1, 2)], "P rank 0's bytes"
    assert P.metric("pushsvc_transfers_total", result="done") == 1
    assert P.metric("pushsvc_transfers_total", result="released") == 1
    assert D.metric("pushsvc_verify_total", result="identical") == 1
    assert tables_empty(P, D)


def test_equal_tp_two_ranks_pair_rank_by_rank(spawn):
    """P TP 2 -> D TP 2: each D rank takes its KV from the P rank of its number only."""
    P = spawn.daemon("prefill")
    D = spawn.daemon("decode")
    ps = [spawn.worker(P, "producer", layers=LAYERS, blocks=P_BLOCKS, rank=r, tp_size=2, block_len=D_BLOCK_LEN,
                       heads=HEADS, seed=10 + r) for r in range(2)]
    ds = [_d_rank(spawn, D, rank=r, tp=2) for r in range(2)]
    rid = "cmpl-equal-tp2"
    for d in ds:
        _recv(d, P, rid, [1, 9])
    for p in ps:
        p.call("ready", request_id=rid, block_ids=[[5, 6]])
    for r, (p, d) in enumerate(zip(ps, ds)):
        assert d.wait(rid) == {"type": "RecvDone", "request_id": rid}
        assert p.wait(rid) == {"type": "SendDone", "request_id": rid}
        rows = d.digests()
        for region in range(2 * LAYERS):
            assert rows[region][1] == hashlib.sha1(pattern(10 + r, region, 5, D_BLOCK_LEN)).hexdigest()
            assert rows[region][9] == hashlib.sha1(pattern(10 + r, region, 6, D_BLOCK_LEN)).hexdigest()
    assert tables_empty(P, D)


@pytest.mark.parametrize(("p_tp", "d_tp", "heads", "words"), [
    (1, 2, HEADS, "D ranks [0, 1] have not all registered KV"),  # only rank 0 here: no joint agent
    (2, 3, HEADS, "D TP must be a multiple of P TP"),
    (3, 2, HEADS, "P TP must be a multiple of D TP"),
    (2, 1, 0, "not head-major"),
    (4, 1, 2, "do not split between 4 P ranks"),
])
def test_unsupported_tp_pairs_are_refused_naming_them(spawn, p_tp, d_tp, heads, words):
    P = spawn.daemon("prefill")
    D = spawn.daemon("decode")
    dw = _d_rank(spawn, D, heads=heads, rank=0, tp=d_tp)
    rid = f"cmpl-refused-{p_tp}-{d_tp}-{heads}"
    _recv(dw, P, rid, [3], p_tp=p_tp)
    event = dw.wait(rid)
    assert event is not None and event["type"] == "RecvFailed", event
    assert words in event["reason"] and f"P TP {p_tp} -> D TP {d_tp}" in event["reason"], event
    assert D.metric("pushsvc_malformed_inputs_total", source="worker", reason="registration") == 1
