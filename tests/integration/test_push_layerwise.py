"""Layer-wise push with real daemons, real NIXL and worker processes of vLLM CPU's layout.

P's workers say ``SendStart`` for a request whose prefill ends in the step, then, layer
by layer, write the layer's final KV into their blocks ("compute") and say
``LayerSaved``. NIXL copies at the moment P's daemon posts, so a layer posted before it
was final would reach D with its old bytes: D's blocks are compared, after each layer,
with P's final bytes of the layers saved so far and with D's own bytes of the later
ones. At equal TP, with P TP 2 -> D TP 1 (each P rank a head slice) and P TP 1 -> D TP 2
(a joint agent over D's ranks), verify mode on.
"""

from __future__ import annotations

import hashlib
import time

import pytest

from kvworker import pattern
from procs import tables_empty

pytestmark = pytest.mark.nixl

LAYERS = 4
P_BLOCKS, D_BLOCKS = 16, 24
BLOCK_LEN = 4096  # a whole block (every head); a rank of TP t holds BLOCK_LEN / t of it
HEADS = 4
TPS = {"equal": (1, 1), "p2-d1": (2, 1), "p1-d2": (1, 2)}


def _final(layer: int, p_rank: int) -> int:
    """The seed of P rank ``p_rank``'s final KV of ``layer``."""
    return 100 + 10 * layer + p_rank


def _expected(region: int, p_block: int, p_tp: int, d_tp: int, d_rank: int) -> str:
    """D rank ``d_rank``'s block after P's final KV of ``region``'s layer landed in it."""
    layer = region // 2
    if p_tp > d_tp:  # P's ranks' head slices, side by side
        data = b"".join(pattern(_final(layer, s), region, p_block, BLOCK_LEN // p_tp) for s in range(p_tp))
    else:  # this D rank's head slice of P's block
        part = BLOCK_LEN // d_tp
        data = pattern(_final(layer, 0), region, p_block, BLOCK_LEN)[d_rank * part:(d_rank + 1) * part]
    return hashlib.sha1(data).hexdigest()


def _until(check, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.mark.parametrize("tp", list(TPS))
def test_each_layer_lands_once_final_and_the_push_verifies(spawn, tp):
    p_tp, d_tp = TPS[tp]
    P = spawn.daemon("prefill", "--verify")
    D = spawn.daemon("decode", "--verify")
    pws = [spawn.worker(P, "producer", layers=LAYERS, blocks=P_BLOCKS, rank=r, tp_size=p_tp,
                        block_len=BLOCK_LEN // p_tp, heads=HEADS // p_tp, seed=10 + r) for r in range(p_tp)]
    dws = [spawn.worker(D, "consumer", layers=LAYERS, blocks=D_BLOCKS, rank=r, tp_size=d_tp,
                        block_len=BLOCK_LEN // d_tp, heads=HEADS // d_tp, seed=2 + r) for r in range(d_tp)]
    assert all(w.hello["ok"] for w in pws + dws), [w.hello for w in pws + dws]
    rid, p_blocks, d_blocks = f"cmpl-lw-{tp}", [3, 7, 8], [20, 2, 11]
    for dw in dws:
        dw.call("recv", request_id=rid, block_ids=[d_blocks], remote_engine_id=P.engine_id,
                remote_host="127.0.0.1", remote_port=P.side_port, remote_tp_size=p_tp)
    _until(lambda: P.live_info()["tables"]["p_registrations"] == p_tp, "D's registrations at P")
    before = [dw.digests() for dw in dws]
    for pw in pws:
        pw.call("start", request_id=rid, block_ids=[p_blocks], step=1)

    def landed(layer: int) -> bool:
        for j, dw in enumerate(dws):
            rows = dw.digests()
            for region in (2 * layer, 2 * layer + 1):
                if [rows[region][b] for b in d_blocks] != [_expected(region, pb, p_tp, d_tp, j) for pb in p_blocks]:
                    return False
        return True

    for layer in range(LAYERS):
        for r, pw in enumerate(pws):
            pw.call("compute", layer=layer, blocks=p_blocks, seed=_final(layer, r))
        for j, dw in enumerate(dws):  # computed at P, not saved yet: nothing of it (or later) at D
            rows = dw.digests()
            assert all(rows[region] == before[j][region] for region in range(2 * layer, 2 * LAYERS)), layer
        for pw in pws:
            pw.call("layer", step=1, layer=layer)
        _until(lambda: landed(layer), f"layer {layer} at D")
    for pw in pws:  # the last layer made every region final: done without StepSaved
        assert pw.wait(rid) == {"type": "SendDone", "request_id": rid}
    for dw in dws:
        assert dw.wait(rid) == {"type": "RecvDone", "request_id": rid}, D.log()[-3000:]
    for pw in pws:
        pw.call("step", step=1)
    assert all(landed(layer) for layer in range(LAYERS))
    for j, dw in enumerate(dws):  # D's other blocks never moved
        rows = dw.digests()
        assert all(rows[r][b] == before[j][r][b] for r in range(2 * LAYERS) for b in range(D_BLOCKS)
                   if b not in d_blocks)
    assert D.metric("pushsvc_verify_total", result="identical") == 1
    assert D.metric("pushsvc_verify_blocks_total", result="mismatch") == 0
    assert P.metric("pushsvc_write_parts_total") == LAYERS * p_tp, "one WRITE per layer and P rank"
    assert P.metric("pushsvc_transfers_total", result="done") == p_tp
    assert tables_empty(P, D)


def test_a_registration_after_the_last_layer_gets_one_whole_write(spawn):
    P = spawn.daemon("prefill", "--verify")
    D = spawn.daemon("decode", "--verify")
    pw = spawn.worker(P, "producer", layers=LAYERS, blocks=P_BLOCKS, block_len=BLOCK_LEN, seed=10)
    dw = spawn.worker(D, "consumer", layers=LAYERS, blocks=D_BLOCKS, block_len=BLOCK_LEN, seed=2)
    rid = "cmpl-lw-late"
    pw.call("start", request_id=rid, block_ids=[[1, 2]], step=5)
    for layer in range(LAYERS):
        pw.call("compute", layer=layer, blocks=[1, 2], seed=_final(layer, 0))
        pw.call("layer", step=5, layer=layer)
    pw.call("step", step=5)
    dw.call("recv", request_id=rid, block_ids=[[9, 4]], remote_engine_id=P.engine_id, remote_host="127.0.0.1",
            remote_port=P.side_port)
    assert dw.wait(rid) == {"type": "RecvDone", "request_id": rid}
    assert pw.wait(rid) == {"type": "SendDone", "request_id": rid}
    rows = dw.digests()
    assert [rows[r][b] for r in range(2 * LAYERS) for b in (9, 4)] == [
        _expected(r, pb, 1, 1, 0) for r in range(2 * LAYERS) for pb in (1, 2)]
    assert P.metric("pushsvc_write_parts_total") == 1
    assert D.metric("pushsvc_verify_total", result="identical") == 1
    assert tables_empty(P, D)


def test_each_pipeline_stage_pushes_its_layers_as_it_saves_them(spawn):
    """A pipeline-parallel P (two stages of two layers each) into D's four layers: each
    stage's worker numbers its own layers (0 and 1), and each layer lands in D's regions of
    the same layer name once its stage saved it; D's request is done once both stages'
    last layers landed."""
    P = spawn.daemon("prefill", "--verify")
    D = spawn.daemon("decode", "--verify")
    stages = [spawn.worker(P, "producer", layers=2, first_layer=2 * s, pp_rank=s, pp_size=2, blocks=P_BLOCKS,
                           block_len=BLOCK_LEN, seed=10 + s) for s in range(2)]
    dw = spawn.worker(D, "consumer", layers=LAYERS, blocks=D_BLOCKS, block_len=BLOCK_LEN, seed=2)
    assert all(w.hello["ok"] for w in [*stages, dw])
    rid, p_blocks, d_blocks = "cmpl-lw-pp", [4, 5], [17, 3]
    dw.call("recv", request_id=rid, block_ids=[d_blocks], remote_engine_id=P.engine_id, remote_host="127.0.0.1",
            remote_port=P.side_port)
    _until(lambda: P.live_info()["tables"]["p_registrations"] == 2, "D's registration at both stages")
    before = dw.digests()
    for w in stages:
        w.call("start", request_id=rid, block_ids=[p_blocks], step=3)

    def stage_layer(stage: int, local: int) -> list[str]:
        """What D's blocks must hold for model layer ``2 * stage + local``: the stage's
        worker numbers that layer's regions 2 * local, 2 * local + 1."""
        return [hashlib.sha1(pattern(_final(2 * stage + local, stage), 2 * local + half, pb, BLOCK_LEN)).hexdigest()
                for half in (0, 1) for pb in p_blocks]

    for local in range(2):  # both stages save their layer ``local`` (model layers local and 2 + local)
        for s, w in enumerate(stages):
            w.call("compute", layer=local, blocks=p_blocks, seed=_final(2 * s + local, s))
            w.call("layer", step=3, layer=local)
        for s in range(2):
            layer = 2 * s + local
            _until(lambda layer=layer, s=s: [dw.digests()[2 * layer + half][b] for half in (0, 1) for b in d_blocks]
                   == stage_layer(s, local), f"model layer {layer} at D")
        if local == 0:
            rows = dw.digests()
            assert all(rows[r] == before[r] for layer in (1, 3) for r in (2 * layer, 2 * layer + 1))
    assert dw.wait(rid) == {"type": "RecvDone", "request_id": rid}, D.log()[-3000:]
    for w in stages:
        assert w.wait(rid) == {"type": "SendDone", "request_id": rid}
        w.call("step", step=3)
    assert D.metric("pushsvc_verify_total", result="identical") == 1
    assert P.metric("pushsvc_write_parts_total") == 4, "one WRITE per stage and layer"
    assert tables_empty(P, D)
