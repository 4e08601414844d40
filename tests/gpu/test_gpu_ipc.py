"""Same-host push on the GPU (``ipc_push = "auto"``): P's daemon maps D's worker KV and
copies each request's blocks into it with one kernel, no NIXL WRITE and no landing copy.
Bytes exact at the mapped blocks and nowhere else, for several KV layouts, with verify;
kill -9 of either daemon with the workers up; the D worker's memory let go when it leaves."""

from __future__ import annotations

import itertools
import json
import random
import time

import pytest
from conftest import Spawner
from test_gpu_push import (D_BLOCKS, LAYERS, P_BLOCKS, _check_given_back, _forward_and_check, _free_gpu_memory,
                           _kill_under_load, _plan, _push_and_check, _recv, _registered_at_p, _send, _wait)

IPC = ("--ipc-push", "auto")
_MEETINGS = itertools.count()


def _ipc_ready(d_daemon, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(p["ipc_ready"] for p in d_daemon.live_info()["peers"]):
        assert time.monotonic() < deadline, "P never told D it mapped D's KV"
        time.sleep(0.01)


def _meet(p, d, p_daemon, d_daemon) -> None:
    """A first push (over NIXL: D does not know P yet), then P maps D's KV."""
    rid = f"meet-{next(_MEETINGS)}"
    _recv(d, p_daemon, [(rid, [D_BLOCKS - 1])])
    _send(p, [(rid, [P_BLOCKS - 1])])
    _wait(d, [rid])
    _wait(p, [rid])
    _ipc_ready(d_daemon)


@pytest.mark.parametrize("layout", ["flash", "mla", "crosslayer"])
def test_same_host_push_copies_exactly_into_ds_blocks(spawn: Spawner, layout: str) -> None:
    p_daemon = spawn.daemon("prefill", *IPC, "--verify")
    d_daemon = spawn.daemon("decode", *IPC, "--landing-mib", "512", "--verify")
    p = spawn.worker(p_daemon, "producer", layout=layout, layers=LAYERS, blocks=P_BLOCKS, seed=31)
    d = spawn.worker(d_daemon, "consumer", layout=layout, layers=LAYERS, blocks=D_BLOCKS, seed=32)
    _meet(p, d, p_daemon, d_daemon)
    landing, parts = d_daemon.metric("pushsvc_landing_copies_total"), p_daemon.metric("pushsvc_write_parts_total")
    _push_and_check(p, d, p_daemon, _plan(random.Random(f"ipc-{layout}"), 6))
    assert p_daemon.metric("pushsvc_ipc_copies_total") == 6
    assert d_daemon.metric("pushsvc_landing_copies_total") == landing  # no landing copy
    assert p_daemon.metric("pushsvc_write_parts_total") == parts  # no NIXL WRITE
    assert d_daemon.metric("pushsvc_verify_total", result="identical") == 7  # "meet" and the six
    info = p_daemon.live_info()
    assert info["tables"]["inflight"] == 0 and info["nixl_handles"]["xfers"] == 0, info


def test_a_layer_wise_request_is_copied_into_ds_kv_once_its_kernels_ran(spawn: Spawner) -> None:
    """P's worker queues a forward pass whose layers each keep the GPU busy ~2 ms before
    writing their final KV, records each layer's event and says LayerSaved at once. P has
    mapped D's KV: it copies each layer once its event is done, so D's blocks hold P's
    final KV (a copy launched early would carry the old bytes), the first copies while
    later layers compute, without a WRITE, verified."""
    p_daemon = spawn.daemon("prefill", *IPC, "--verify")
    d_daemon = spawn.daemon("decode", *IPC, "--landing-mib", "512", "--verify")
    p = spawn.worker(p_daemon, "producer", layout="flash", layers=LAYERS, blocks=P_BLOCKS, seed=43, layerwise=1)
    d = spawn.worker(d_daemon, "consumer", layout="flash", layers=LAYERS, blocks=D_BLOCKS, seed=44)
    _meet(p, d, p_daemon, d_daemon)
    parts = p_daemon.metric("pushsvc_write_parts_total")
    _forward_and_check(p, d, p_daemon, "lw-ipc", [5, 9, 17, 3], [100, 7, 64, 2], seed=700)
    assert d_daemon.metric("pushsvc_verify_total", result="identical") == 2  # the meeting and this one
    assert p_daemon.metric("pushsvc_ipc_copies_total") == 1
    assert p_daemon.metric("pushsvc_write_parts_total") == parts, "no NIXL WRITE"
    [line] = json.loads(p_daemon.get("/v1/requests?request_id=lw-ipc")[1])["timelines"]
    events = line["events_ms"]
    print(f"P's timeline: {events}")
    assert events["write_posted"] < events["prefill_done"], "copies began while later layers computed"
    p.call("finished", rids=["lw-ipc"])
    _wait(p, ["lw-ipc"])
    assert p_daemon.metric("pushsvc_transfers_total", result="done") == 2


def test_a_steps_layer_wise_requests_share_each_layers_copy_and_land_exactly(spawn: Spawner) -> None:
    """Three requests finish their prefill in one forward pass, into a same-host D: P
    copies each layer of all three with one launch (their pairs in one kernel; the unit
    tests count the launches), and each request's blocks in D hold exactly its own final
    KV, verified; no other block of D changed."""
    p_daemon = spawn.daemon("prefill", *IPC, "--verify")
    d_daemon = spawn.daemon("decode", *IPC, "--landing-mib", "512", "--verify")
    p = spawn.worker(p_daemon, "producer", layout="flash", layers=LAYERS, blocks=P_BLOCKS, seed=45, layerwise=1)
    d = spawn.worker(d_daemon, "consumer", layout="flash", layers=LAYERS, blocks=D_BLOCKS, seed=46)
    _meet(p, d, p_daemon, d_daemon)
    plan = [("step-a", [5, 9, 17], [100, 7, 64]), ("step-b", [3, 40], [2, 81]),
            ("step-c", [22, 23, 24, 25], [11, 12, 50, 51])]
    rids = [rid for rid, _, _ in plan]
    _registered_at_p(d, p_daemon, [(rid, d_blocks) for rid, _, d_blocks in plan])
    p.call("forward", requests=[{"rid": rid, "blocks": p_blocks} for rid, p_blocks, _ in plan], step=1, seed=710,
           sleep_cycles=4_000_000)
    recvd = _wait(d, rids)
    assert not any(r["errors"] for r in recvd.values()), recvd
    for rid, p_blocks, d_blocks in plan:
        assert d.call("digests", blocks=d_blocks)["digests"] == p.call("digests", blocks=p_blocks)["digests"], rid
    assert sorted(d.call("changed")["blocks"]) == sorted(b for _, _, d_blocks in plan for b in d_blocks)
    assert d_daemon.metric("pushsvc_verify_total", result="identical") == 1 + len(plan)
    assert p_daemon.metric("pushsvc_ipc_copies_total") == len(plan)
    p.call("finished", rids=rids)
    _wait(p, rids)


def test_a_p_worker_killed_mid_pass_fails_its_copy_and_changes_no_other_block(spawn: Spawner) -> None:
    """P's worker queues a forward pass of ~6 s (each layer keeps the GPU busy ~0.2 s) for a
    request D asked P to copy, and is killed with -9: its events will never be done (a
    query of a dead process's event says "not ready" for ever). P's daemon fails the push
    when the worker's socket closes, D's request fails, no block of D but the request's
    changed (a layer done before the kill may have been copied into them), and the daemon
    serves the next worker."""
    p_daemon = spawn.daemon("prefill", *IPC)
    d_daemon = spawn.daemon("decode", *IPC, "--landing-mib", "512")
    p = spawn.worker(p_daemon, "producer", layout="flash", layers=LAYERS, blocks=P_BLOCKS, seed=45, layerwise=1)
    d = spawn.worker(d_daemon, "consumer", layout="flash", layers=LAYERS, blocks=D_BLOCKS, seed=46)
    _meet(p, d, p_daemon, d_daemon)
    _registered_at_p(d, p_daemon, [("doomed", [10, 11, 12])])
    p.call("forward", rid="doomed", blocks=[1, 2, 3], step=1, seed=5, sleep_cycles=400_000_000)
    p.proc.kill()
    p.proc.wait()
    recvd = _wait(d, ["doomed"])
    assert recvd["doomed"]["errors"], recvd
    assert p_daemon.metric("pushsvc_failures_total", kind="worker_gone") == 1
    assert set(d.call("changed")["blocks"]) <= {10, 11, 12}
    p2 = spawn.worker(p_daemon, "producer", layout="flash", layers=LAYERS, blocks=P_BLOCKS, seed=47)
    _push_and_check(p2, d, p_daemon, _plan(random.Random(47), 3))
    info = p_daemon.live_info()
    assert info["tables"]["inflight"] == 0 and info["nixl_handles"]["xfers"] == 0, info


def test_contiguous_blocks_land_exactly(spawn: Spawner) -> None:
    """A fresh prefill into a fresh D (both sides' blocks consecutive), with a prefix hit
    and scattered ids beside it, in one batch."""
    p_daemon = spawn.daemon("prefill", *IPC, "--verify")
    d_daemon = spawn.daemon("decode", *IPC, "--landing-mib", "256", "--verify")
    p = spawn.worker(p_daemon, "producer", layout="flash", layers=LAYERS, blocks=P_BLOCKS, seed=37)
    d = spawn.worker(d_daemon, "consumer", layout="flash", layers=LAYERS, blocks=D_BLOCKS, seed=38)
    _meet(p, d, p_daemon, d_daemon)
    plan = [("run-0", list(range(0, 40)), list(range(60, 100))),
            ("run-1", list(range(40, 100)), list(range(0, 48))),  # a prefix hit: P's last 48
            ("run-2", [120, 105, 133], [110, 55, 50])]
    _push_and_check(p, d, p_daemon, plan)
    assert p_daemon.metric("pushsvc_ipc_copies_total") == 3
    assert d_daemon.metric("pushsvc_verify_total", result="identical") == 4


@pytest.mark.parametrize("path", ["same_host", "landing"])
def test_long_requests_go_packed_and_land_exactly(spawn: Spawner, path: str) -> None:
    """Requests of 256 blocks or more: the worker's client packs their ids (worker
    protocol 1.7), P's daemon reads them as arrays. Scattered ids and a prefix hit, copied
    by P into D's KV or WRITten into D's landing buffer and copied out, verified."""
    ipc = IPC if path == "same_host" else ("--ipc-push", "off")
    p_daemon = spawn.daemon("prefill", *ipc, "--verify")
    d_daemon = spawn.daemon("decode", *ipc, "--landing-mib", "1536", "--verify")
    p = spawn.worker(p_daemon, "producer", layout="flash", layers=LAYERS, blocks=900, seed=39)
    d = spawn.worker(d_daemon, "consumer", layout="flash", layers=LAYERS, blocks=700, seed=40)
    if path == "same_host":
        _meet(p, d, p_daemon, d_daemon)
    rng = random.Random(41)
    p_free, d_free = rng.sample(range(900), 700), rng.sample(range(700), 560)
    plan = [("long-0", p_free[:300], d_free[:300]),
            ("long-1", p_free[300:700], d_free[300:560])]  # a prefix hit: P's last 260 of 400
    _push_and_check(p, d, p_daemon, plan)
    copies = p_daemon.metric("pushsvc_ipc_copies_total")
    assert copies == (2 if path == "same_host" else 0)
    assert d_daemon.metric("pushsvc_verify_total", result="identical") == (3 if path == "same_host" else 2)


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_kill_9_and_restart_under_same_host_push(spawn: Spawner, side: str) -> None:
    args = {"prefill": (*IPC, "--lease-s", "20"), "decode": (*IPC, "--landing-mib", "512")}
    daemons = {name: spawn.daemon(name, *extra) for name, extra in args.items()}
    p = spawn.worker(daemons["prefill"], "producer", blocks=P_BLOCKS, seed=33)
    d = spawn.worker(daemons["decode"], "consumer", blocks=D_BLOCKS, seed=34)
    _meet(p, d, daemons["prefill"], daemons["decode"])
    _push_and_check(p, d, daemons["prefill"], _plan(random.Random(4), 4))
    free_before = _free_gpu_memory([p, d])
    started_s, _ = _kill_under_load(spawn, daemons, side, p, d, args[side])
    print(f"\n{side} daemon kill -9 under same-host push -> restarted in {started_s:.2f} s")
    _meet(p, d, daemons["prefill"], daemons["decode"])
    _push_and_check(p, d, daemons["prefill"], _plan(random.Random(5), 4))
    assert daemons["prefill"].metric("pushsvc_ipc_copies_total") >= 3
    _check_given_back(free_before, p, d, side)
    for daemon in daemons.values():
        info = daemon.live_info()
        assert info["tables"]["inflight"] == 0 and info["nixl_handles"]["xfers"] == 0, info
        assert info["gpu"]["landing_slots"]["used"] == 0, info


def test_p_lets_go_of_ds_kv_when_ds_worker_leaves(spawn: Spawner) -> None:
    """A mapping P kept would hold the D worker's GPU memory after it exited."""
    p_daemon = spawn.daemon("prefill", *IPC)
    d_daemon = spawn.daemon("decode", *IPC, "--landing-mib", "128")
    p = spawn.worker(p_daemon, "producer", blocks=P_BLOCKS, seed=35)
    own = p_daemon.live_info()["gpu"]["imported"]  # P's worker KV
    for cycle in range(3):
        d = spawn.worker(d_daemon, "consumer", blocks=D_BLOCKS, seed=36 + cycle)
        _meet(p, d, p_daemon, d_daemon)
        _push_and_check(p, d, p_daemon, _plan(random.Random(cycle), 3))
        assert p_daemon.live_info()["gpu"]["imported"] > own  # D's worker KV, mapped
        d.close()
        deadline = time.monotonic() + 20
        while p_daemon.live_info()["gpu"]["imported"] != own and time.monotonic() < deadline:
            time.sleep(0.1)
        gpu = p_daemon.live_info()["gpu"]
        assert gpu["imported"] == own and gpu["allocated"] == 0, gpu
