"""A pipeline-parallel P (PP 2) into a D of one stage, with real daemons, real NIXL and
worker processes of vLLM CPU's layout.

Each P stage's workers hold only their stage's layers (stage 0 layers 0-1, stage 1
layers 2-3); D's rank holds all four. Each stage writes its layers into D's regions of
the same layer names, and D's request is done only once every stage (and, at P TP 2,
every TP rank of it) landed. A layer no stage holds fails D's registration naming it;
a stage whose layer D lacks fails the push; a decoding worker of a pipeline stage is
refused at its hello. Packed MLA rows (one page per layer in each block's row) pair the
same way, page by page.
"""

from __future__ import annotations

import hashlib
import time

import pytest

from kvworker import pattern
from procs import tables_empty

pytestmark = pytest.mark.nixl

STAGE_LAYERS = 2  # layers per P stage
STAGES = 2
P_BLOCKS = 16
D_BLOCKS = 24
BLOCK_LEN = 4096  # D's block; each of P TP ranks holds BLOCK_LEN / p_tp of it
HEADS = 4


def _stage_workers(spawn, P, p_tp=1, stages=STAGES, layers=STAGE_LAYERS, **opts):
    """Every (stage, TP rank) worker of P, seeded ``10 + 2*stage + rank``."""
    workers = {}
    for stage in range(stages):
        for rank in range(p_tp):
            w = spawn.worker(P, "producer", layers=layers, first_layer=stage * STAGE_LAYERS, pp_rank=stage,
                             pp_size=stages, rank=rank, tp_size=p_tp, blocks=P_BLOCKS, block_len=BLOCK_LEN // p_tp,
                             heads=HEADS // p_tp, seed=10 + 2 * stage + rank, **opts)
            assert w.hello["ok"], w.hello
            workers[stage, rank] = w
    return workers


def _d_rank(spawn, D, layers=STAGES * STAGE_LAYERS):
    w = spawn.worker(D, "consumer", layers=layers, blocks=D_BLOCKS, block_len=BLOCK_LEN, heads=HEADS, seed=2)
    assert w.hello["ok"], w.hello
    return w


def _recv(dw, P, rid, blocks, p_tp=1, match_key=""):
    dw.call("recv", request_id=rid, block_ids=[blocks], remote_engine_id=P.engine_id, remote_host="127.0.0.1",
            remote_port=P.side_port, remote_tp_size=p_tp, match_key=match_key)


def _expected(mapping: dict[int, int], p_tp: int) -> list[list[str]]:
    """D's digests: region ``r`` (layer ``r // 2``) of each mapped block from the stage that
    holds the layer, its TP ranks' head slices in rank order; D's own bytes elsewhere."""
    out = []
    for r in range(2 * STAGES * STAGE_LAYERS):
        stage, local = divmod(r, 2 * STAGE_LAYERS)
        row = []
        for b in range(D_BLOCKS):
            if b in mapping:
                data = b"".join(pattern(10 + 2 * stage + s, local, mapping[b], BLOCK_LEN // p_tp) for s in range(p_tp))
            else:
                data = pattern(2, r, b, BLOCK_LEN)
            row.append(hashlib.sha1(data).hexdigest())
        out.append(row)
    return out


@pytest.mark.parametrize("p_tp", [1, 2], ids=["pp2-tp1", "pp2-tp2"])
def test_every_stage_writes_its_layers_by_name_and_d_verifies_each(spawn, p_tp):
    P = spawn.daemon("prefill", "--verify")
    D = spawn.daemon("decode", "--verify")
    workers = _stage_workers(spawn, P, p_tp)
    dw = _d_rank(spawn, D)
    p_blocks, d_blocks = [3, 7, 8], [20, 2, 11]
    rid = f"cmpl-pp-{p_tp}"
    _recv(dw, P, rid, d_blocks, p_tp)
    time.sleep(0.3)
    last = workers[STAGES - 1, p_tp - 1]
    for key, w in workers.items():
        if w is not last:
            w.call("ready", request_id=rid, block_ids=[p_blocks])
    for key, w in workers.items():
        if w is not last:
            assert w.wait(rid) == {"type": "SendDone", "request_id": rid}, key
    assert dw.wait(rid, timeout=0.5) is None, "the last stage's rank has not written: not done"
    last.call("ready", request_id=rid, block_ids=[p_blocks])
    assert last.wait(rid) == {"type": "SendDone", "request_id": rid}
    assert dw.wait(rid) == {"type": "RecvDone", "request_id": rid}, D.log()[-3000:]
    assert dw.digests() == _expected(dict(zip(d_blocks, p_blocks)), p_tp)
    # Each source's digests against the regions of its stage's layers (its head slice).
    assert D.metric("pushsvc_verify_total", result="identical") == 1
    assert D.metric("pushsvc_verify_blocks_total", result="identical") == len(d_blocks) * 2 * STAGES * STAGE_LAYERS * p_tp
    assert D.metric("pushsvc_verify_blocks_total", result="mismatch") == 0
    assert P.metric("pushsvc_transfer_bytes_total") == len(p_blocks) * 2 * STAGES * STAGE_LAYERS * BLOCK_LEN
    agents = {(a["rank"], a.get("stage", 0)) for a in P.live_info()["agents"]}
    assert agents == {(r, s) for s in range(STAGES) for r in range(p_tp)}
    assert tables_empty(P, D)


MLA_PAGE = 1152  # one layer's latent page of a 16-token block, bytes (vLLM CPU's 576-wide MLA rows, bf16)


@pytest.mark.parametrize("p_tp", [1, 2], ids=["pp2-tp1", "pp2-tp2"])
def test_packed_mla_rows_each_stage_writes_its_pages_into_the_slots_of_ds_rows(spawn, p_tp):
    """Packed MLA caches: block ``b``'s row holds one latent page per layer. D's rows hold
    four layers, each P stage's rows its two, so a layer's page sits at another offset and
    another row stride on each side (and the block counts differ). Each stage writes its
    pages into the slots of D's rows named by the same layer, one descriptor per page; the
    latent is replicated, so only each stage's first TP rank writes (the others are
    released: the exchange's match key lets a release that comes before a rank's blocks
    free them on arrival). Verify mode compares each source's pages with D's."""
    P = spawn.daemon("prefill", "--verify")
    D = spawn.daemon("decode", "--verify")
    workers = {}
    for stage in range(STAGES):
        for rank in range(p_tp):
            w = spawn.worker(P, "producer", layers=STAGE_LAYERS, first_layer=stage * STAGE_LAYERS, pp_rank=stage,
                             pp_size=STAGES, rank=rank, tp_size=p_tp, blocks=P_BLOCKS, block_len=MLA_PAGE, packed=1,
                             replicated=1, seed=10 + 2 * stage + rank)
            assert w.hello["ok"], w.hello
            workers[stage, rank] = w
    dw = spawn.worker(D, "consumer", layers=STAGES * STAGE_LAYERS, blocks=D_BLOCKS, block_len=MLA_PAGE, packed=1,
                      replicated=1, seed=2)
    assert dw.hello["ok"], dw.hello
    p_blocks, d_blocks = [3, 7, 15], [23, 0, 11]
    rid, key = f"cmpl-pp-packed-{p_tp}", f"xfer-pp-packed-{p_tp}"
    _recv(dw, P, rid, d_blocks, p_tp, match_key=key)
    time.sleep(0.3)
    for w in workers.values():
        w.call("ready", request_id=rid, block_ids=[p_blocks], match_key=key)
    for key, w in workers.items():
        assert w.wait(rid) == {"type": "SendDone", "request_id": rid}, key
    assert dw.wait(rid) == {"type": "RecvDone", "request_id": rid}, D.log()[-3000:]
    mapping = dict(zip(d_blocks, p_blocks))
    expected = [[hashlib.sha1(pattern(10 + 2 * (layer // STAGE_LAYERS), layer % STAGE_LAYERS, mapping[b], MLA_PAGE)
                              if b in mapping else pattern(2, layer, b, MLA_PAGE)).hexdigest()
                 for b in range(D_BLOCKS)] for layer in range(STAGES * STAGE_LAYERS)]
    assert dw.digests() == expected
    assert D.metric("pushsvc_verify_total", result="identical") == 1
    assert D.metric("pushsvc_verify_blocks_total", result="identical") == len(d_blocks) * STAGES * STAGE_LAYERS
    assert D.metric("pushsvc_verify_blocks_total", result="mismatch") == 0
    assert P.metric("pushsvc_transfer_bytes_total") == len(p_blocks) * STAGES * STAGE_LAYERS * MLA_PAGE
    assert P.metric("pushsvc_transfers_total", result="done") == STAGES
    assert P.metric("pushsvc_transfers_total", result="released") == STAGES * (p_tp - 1)
    assert tables_empty(P, D)


def test_a_layer_no_stage_holds_fails_the_registration_naming_it(spawn):
    """D has a fifth layer P's stages do not hold: its KV would stay stale, so D fails the
    registration before anything is sent, and its blocks are never written."""
    P = spawn.daemon("prefill")
    D = spawn.daemon("decode")
    workers = _stage_workers(spawn, P)
    dw = _d_rank(spawn, D, layers=STAGES * STAGE_LAYERS + 1)
    before = dw.digests()
    rid = "cmpl-pp-missing"
    _recv(dw, P, rid, [5, 6])
    event = dw.wait(rid)
    assert event is not None and event["type"] == "RecvFailed", event
    assert "handshake_failed" in event["reason"], event
    assert "layer model.layers.4.self_attn is held by none of P's 2 pipeline stages" in event["reason"], event
    assert sorted(event["block_ids"]) == [5, 6]
    assert D.metric("pushsvc_failures_total", kind="handshake_failed") == 1
    assert P.live_info()["tables"]["p_registrations"] == 0, "nothing went to P"
    for w in workers.values():  # P's blocks stay staged until the worker gives them back
        w.call("ready", request_id=rid, block_ids=[[1, 2]])
        w.call("evict", request_ids=[rid])
        assert w.wait(rid) == {"type": "SendFailed", "request_id": rid, "reason": "cancelled"}
    assert dw.digests() == before
    assert tables_empty(P, D)


def test_a_stage_whose_layer_d_lacks_fails_the_push(spawn):
    """Stage 1 holds layers 2-4, D only 0-3: every layer of D has its stage, so the
    registration goes out, but stage 1 cannot place layer 4 and refuses to write
    (``layout_mismatch``): D fails the request once no stage can write, never done."""
    P = spawn.daemon("prefill")
    D = spawn.daemon("decode")
    s0 = spawn.worker(P, "producer", layers=STAGE_LAYERS, first_layer=0, pp_rank=0, pp_size=2, blocks=P_BLOCKS,
                      block_len=BLOCK_LEN, heads=HEADS, seed=10)
    s1 = spawn.worker(P, "producer", layers=STAGE_LAYERS + 1, first_layer=STAGE_LAYERS, pp_rank=1, pp_size=2,
                      blocks=P_BLOCKS, block_len=BLOCK_LEN, heads=HEADS, seed=12)
    assert s0.hello["ok"] and s1.hello["ok"]
    dw = _d_rank(spawn, D)
    rid = "cmpl-pp-extra"
    _recv(dw, P, rid, [9, 10])
    time.sleep(0.3)
    s1.call("ready", request_id=rid, block_ids=[[1, 2]])
    assert s1.wait(rid)["type"] == "SendFailed"
    event = dw.wait(rid)
    assert event is not None and event["type"] == "RecvFailed", event
    assert "push_failed_remote" in event["reason"] and "layer model.layers.4.self_attn" in event["reason"], event
    assert dw.wait(rid, timeout=0.5) is None, "exactly one final event"
    s0.call("ready", request_id=rid, block_ids=[[1, 2]])  # withdrawn from stage 0 meanwhile
    s0.call("evict", request_ids=[rid])
    assert s0.wait(rid) == {"type": "SendFailed", "request_id": rid, "reason": "cancelled"}
    assert tables_empty(P, D)


def test_workers_that_do_not_fit_one_pipeline_engine_are_refused_at_hello(spawn):
    P = spawn.daemon("prefill")
    D = spawn.daemon("decode")
    consumer = spawn.worker(D, "consumer", layers=1, pp_rank=0, pp_size=2)
    assert not consumer.hello["ok"] and "decode-side PP is not supported" in consumer.hello["error"], consumer.hello
    s0 = spawn.worker(P, "producer", layers=1, pp_rank=0, pp_size=2)
    assert s0.hello["ok"], s0.hello
    again = spawn.worker(P, "producer", layers=1, pp_rank=0, pp_size=2)
    assert not again.hello["ok"] and "rank 0 of stage 0 already has a connected worker" in again.hello["error"]
    other = spawn.worker(P, "producer", layers=1, pp_rank=1, pp_size=4)
    assert not other.hello["ok"] and "TP 1 x PP 4 differs from rank 0's TP 1 x PP 2" in other.hello["error"]
    beyond = spawn.worker(P, "producer", layers=1, pp_rank=2, pp_size=2)
    assert not beyond.hello["ok"] and "pipeline stage 2 is not below the PP size 2" in beyond.hello["error"]
    s1 = spawn.worker(P, "producer", layers=1, first_layer=1, pp_rank=1, pp_size=2)
    assert s1.hello["ok"], s1.hello


def test_a_withdrawal_reaches_every_stage_and_ends_once_all_confirmed(spawn):
    """D withdraws a registration both stages hold: each is asked by its source id (stage
    1's is past stage 0's TP ranks), each confirms, and D gives the blocks back once, after
    the last confirmation; blocks staged later are never written."""
    P = spawn.daemon("prefill")
    D = spawn.daemon("decode")
    workers = _stage_workers(spawn, P)
    dw = _d_rank(spawn, D)
    before = dw.digests()
    rid = "cmpl-pp-withdrawn"
    _recv(dw, P, rid, [3, 4])
    time.sleep(0.3)
    assert P.live_info()["tables"]["p_registrations"] == 2, "one registration per stage"
    dw.call("evict", request_ids=[rid])
    event = dw.wait(rid)
    assert event is not None and event["type"] == "RecvFailed" and event["reason"] == "cancelled", event
    assert dw.wait(rid, timeout=0.5) is None, "exactly one final event"
    assert P.live_info()["tables"]["p_registrations"] == 0, "both stages confirmed"
    for w in workers.values():
        w.call("ready", request_id=rid, block_ids=[[1, 2]])
        w.call("evict", request_ids=[rid])
        assert w.wait(rid) == {"type": "SendFailed", "request_id": rid, "reason": "cancelled"}
    assert dw.digests() == before
    assert tables_empty(P, D)


def test_a_restarted_stage_worker_replaces_only_its_own_agent(spawn):
    """Stage 1's worker restarts: its new agent takes the old one's place at D (same rank,
    TP and stage), stage 0's stays, and the next request lands from both."""
    P = spawn.daemon("prefill", "--verify")
    D = spawn.daemon("decode", "--verify")
    workers = _stage_workers(spawn, P)
    dw = _d_rank(spawn, D)
    _recv(dw, P, "cmpl-pp-warm", [1])  # D dials P and learns both stages' agents
    time.sleep(0.3)
    for w in workers.values():
        w.call("ready", request_id="cmpl-pp-warm", block_ids=[[1]])
    assert dw.wait("cmpl-pp-warm") == {"type": "RecvDone", "request_id": "cmpl-pp-warm"}
    workers[1, 0].close()
    workers[1, 0] = spawn.worker(P, "producer", layers=STAGE_LAYERS, first_layer=STAGE_LAYERS, pp_rank=1, pp_size=2,
                                 blocks=P_BLOCKS, block_len=BLOCK_LEN, heads=HEADS, seed=12)
    assert workers[1, 0].hello["ok"], workers[1, 0].hello

    def known() -> list[str]:
        (peer,) = D.live_info()["peers"]
        return peer["agents"]

    deadline = time.monotonic() + 10
    current = {a["stage"]: a["agent"] for a in P.live_info()["agents"]}
    while sorted(known()) != sorted(current.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(known()) == sorted(current.values()), (known(), current)
    rid = "cmpl-pp-after"
    _recv(dw, P, rid, [20, 2])
    time.sleep(0.3)
    for w in workers.values():
        w.call("ready", request_id=rid, block_ids=[[7, 8]])
    assert dw.wait(rid) == {"type": "RecvDone", "request_id": rid}, D.log()[-3000:]
    rows = dw.digests()
    assert rows == [[_expected({20: 7, 2: 8}, 1)[r][b] if b in (20, 2) else rows[r][b] for b in range(D_BLOCKS)]
                    for r in range(len(rows))]
    assert D.metric("pushsvc_verify_total", result="identical") == 2
    assert tables_empty(P, D)
