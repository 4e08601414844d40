"""P's finished blocks packed (worker protocol 1.7): the client packs long groups for a
daemon that takes them and only for such a daemon, and the daemon pushes packed ids
exactly as listed ones, refusing the malformed ones with the request's ``SendFailed``."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import numpy as np
import pytest
from daemon_fixtures import REGIONS, assert_tables_empty, expected_after_push, metric, push_pair, wait_until

from pushsvc.client import DaemonClient
from pushsvc.protocol import worker as wp
from pushsvc.protocol.framing import HEADER

P_ID = "cmpl-a-0-22222222"
D_ID = "cmpl-a-0-11111111"
LONG = wp.PACK_MIN_IDS + 44


def _sent_by(minor: int, msg: wp.WorkerMessage) -> wp.WorkerMessage:
    """What a client talking to a daemon at 1.``minor`` puts on the wire for ``msg``."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        client = DaemonClient("unused", engine_id="e", rank=0, tp_size=1, role="producer")
        client._sock, client.daemon_minor = ours, minor
        client.send(msg)
        (length,) = HEADER.unpack(theirs.recv(HEADER.size, socket.MSG_WAITALL))
        return wp.worker_decoder.decode(theirs.recv(length, socket.MSG_WAITALL))


@pytest.mark.parametrize("kind", ["send_ready", "send_start"])
def test_the_client_packs_long_groups_for_a_daemon_at_1_7(kind: str) -> None:
    groups = [list(range(LONG)), [3, 1], []]
    msg = (wp.SendReady(request_id="r", block_ids=groups, match_key="k") if kind == "send_ready"
           else wp.SendStart(request_id="r", block_ids=groups, step=4))
    sent = _sent_by(wp.PACKED_IDS_MINOR, msg)
    assert isinstance(sent.block_ids[0], bytes) and sent.block_ids[1:] == [[3, 1], []]
    assert [list(map(int, g)) for g in wp.unpack_ids(sent.block_ids)] == groups
    assert sent.request_id == "r" and (sent.match_key == "k" if kind == "send_ready" else sent.step == 4)


def test_the_client_sends_lists_to_an_older_daemon_and_short_groups_as_lists() -> None:
    groups = [list(range(LONG))]
    assert _sent_by(wp.PACKED_IDS_MINOR - 1, wp.SendReady(request_id="r", block_ids=groups)).block_ids == groups
    short = [list(range(wp.PACK_MIN_IDS - 1))]
    assert _sent_by(wp.PACKED_IDS_MINOR, wp.SendReady(request_id="r", block_ids=short)).block_ids == short
    # D's registration keeps its lists whatever the daemon: only P's blocks are packed.
    reg = wp.RegisterRecv(request_id="r", local_block_ids=groups, remote_engine_id="p", remote_host="h",
                          remote_port=1)
    assert _sent_by(wp.PACKED_IDS_MINOR, reg).local_block_ids == groups


@pytest.mark.asyncio
@pytest.mark.parametrize("order", ["registration_first", "blocks_first"])
async def test_packed_ids_push_the_same_bytes_as_listed_ones(order: str) -> None:
    """300 of P's blocks, scattered, packed on the wire, into 280 of D's (a prefix hit):
    the bytes land at the mapped blocks and nowhere else."""
    rng = np.random.default_rng(7)
    p_ids = rng.permutation(600)[:LONG].tolist()
    d_ids = rng.permutation(700)[:LONG - 20].tolist()
    async with push_pair(p_blocks=600, d_blocks=700) as pair:
        if order == "registration_first":
            pair.register_recv(D_ID, d_ids)
            await wait_until(lambda: pair.p.info()["tables"]["p_registrations"] == 1, "the PUSH_REG to reach P")
        pair.pw.send(wp.SendReady(request_id=P_ID, block_ids=[np.asarray(p_ids, dtype="<u4").tobytes()]))
        if order == "blocks_first":
            await wait_until(lambda: pair.p.info()["tables"]["p_staged"] == 1, "P to stage its blocks")
            pair.register_recv(D_ID, d_ids)
        await pair.pw.wait_for(wp.SendDone, P_ID)
        await pair.dw.wait_for(wp.RecvDone, D_ID)
        assert np.array_equal(pair.dw.snapshot(), expected_after_push(pair.pw, pair.dw, p_ids, d_ids))
        assert metric(pair.p, "pushsvc_transfer_bytes_total") == REGIONS * len(d_ids) * pair.pw.block_len
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("packed", "words"),
    [
        (np.arange(300, dtype="<u4").tobytes()[:-1], "1199 bytes of packed block ids, not whole u32s"),
        (np.array([0, 1, 8], dtype="<u4").tobytes(), "outside 0..7"),
        (np.array([2**32 - 1], dtype="<u4").tobytes(), "outside 0..7"),
        (np.array([3, 5, 3], dtype="<u4").tobytes(), "twice"),
    ],
    ids=["torn", "out_of_range", "u32_max", "duplicated"],
)
async def test_malformed_packed_ids_fail_the_send_and_nothing_else(packed: bytes, words: str) -> None:
    async with push_pair(p_blocks=8) as pair:
        pair.pw.send(wp.SendReady(request_id=P_ID, block_ids=[packed]))
        failed = await pair.pw.wait_for(wp.SendFailed, P_ID)
        assert words in failed.reason
        assert metric(pair.p, "pushsvc_malformed_inputs_total", source="worker", reason="finished_blocks") == 1
        # The connection lives on: a good request after it still goes through.
        pair.register_recv(D_ID, [4, 5])
        pair.send_ready(P_ID, [1, 2])
        await pair.pw.wait_for(wp.SendDone, P_ID)
        await pair.dw.wait_for(wp.RecvDone, D_ID)
        await assert_tables_empty(pair.p, pair.d)


def test_the_block_ids_benchmark_measures_both_forms() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import block_ids

    listed, packed = (block_ids.measure(300, form, runs=3) for form in (False, True))
    d_lists = block_ids.measure(300, True, runs=3, d_lists=True)
    # msgpack's small ints against u32s
    assert listed["wire_bytes"] < 4 * 300 <= packed["wire_bytes"] == d_lists["wire_bytes"]
    assert all(v > 0 for r in (listed, packed, d_lists) for v in r.values())
