"""The GPU path end to end on one GPU: two daemons, worker processes with vLLM-shaped CUDA
KV caches (``kvproc.py``), real NIXL. Bytes land exactly at the mapped blocks and nowhere
else, in either order of the two legs, with prefix-hit tails and WRITEs in parts; verify
mode; backpressure; kill -9 of either daemon with the workers staying up; an abort storm;
layer-wise push gated by the worker's layer events; and nothing leaks (GPU memory, NIXL
handles, fds)."""

from __future__ import annotations

import collections
import os

import random
import signal
import sys
import time

import pytest
from conftest import Spawner
from gpuprocs import GpuWorker

LAYERS = 32
P_BLOCKS, D_BLOCKS = 160, 120  # different block counts on the two sides
RESTART_GOAL_S = 5.0


def _recv(d: GpuWorker, p_daemon, requests: list[tuple[str, list[int]]]) -> None:
    d.call("recv", p_engine=p_daemon.engine_id, p_port=p_daemon.side_port,
           requests=[{"rid": rid, "blocks": blocks} for rid, blocks in requests])


def _send(p: GpuWorker, requests: list[tuple[str, list[int]]]) -> None:
    p.call("send", requests=[{"rid": rid, "blocks": blocks} for rid, blocks in requests])


def _wait(w: GpuWorker, rids: list[str], timeout: float = 60.0) -> dict:
    out = w.call("wait", rids=rids, timeout=timeout)
    assert not out["missing"], f"no final event for {out['missing']}"
    return out["finished"]


def _plan(rng: random.Random, n: int) -> list[tuple[str, list[int], list[int]]]:
    """(rid, P blocks, D blocks): sizes from 1 block to WRITEs in many parts, some with a
    prefix hit on D (D registers only the tail of P's blocks), blocks scattered."""
    p_free, d_free = list(range(P_BLOCKS)), list(range(D_BLOCKS))
    rng.shuffle(p_free)
    rng.shuffle(d_free)
    sizes = [(1, 1), (3, 3), (16, 16), (40, 40), (10, 6), (24, 1)][:n]
    plan = []
    for i, (np_, nd) in enumerate(sizes):
        p_ids, p_free = p_free[:np_], p_free[np_:]
        d_ids, d_free = d_free[:nd], d_free[nd:]
        plan.append((f"req-{i}", p_ids, d_ids))
    return plan


def _push_and_check(p: GpuWorker, d: GpuWorker, p_daemon, plan) -> None:
    d.call("snapshot")
    first_recv = plan[::2]  # D's registration first, then P's blocks ...
    first_send = plan[1::2]  # ... and the other way round
    _recv(d, p_daemon, [(rid, dd) for rid, _, dd in first_recv])
    _send(p, [(rid, pp) for rid, pp, _ in first_send])
    time.sleep(0.2)
    _send(p, [(rid, pp) for rid, pp, _ in first_recv])
    _recv(d, p_daemon, [(rid, dd) for rid, _, dd in first_send])
    rids = [rid for rid, _, _ in plan]
    recvd = _wait(d, rids)
    _wait(p, rids)
    assert all(not v["errors"] for v in recvd.values()), recvd
    mapped_p = [b for _, pp, dd in plan for b in pp[len(pp) - len(dd):]]
    mapped_d = [b for _, _, dd in plan for b in dd]
    assert d.call("digests", blocks=mapped_d)["digests"] == p.call("digests", blocks=mapped_p)["digests"]
    assert sorted(d.call("changed")["blocks"]) == sorted(mapped_d)  # no other block of D changed


@pytest.mark.parametrize("layout", ["flash", "flashinfer", "hnd", "mla", "crosslayer"])
def test_pushed_bytes_land_at_the_mapped_blocks_only(spawn: Spawner, layout: str) -> None:
    p_daemon = spawn.daemon("prefill", "--write-part-mib", "4")
    d_daemon = spawn.daemon("decode", "--landing-mib", "512")
    p = spawn.worker(p_daemon, "producer", layout=layout, layers=LAYERS, blocks=P_BLOCKS, seed=1)
    d = spawn.worker(d_daemon, "consumer", layout=layout, layers=LAYERS, blocks=D_BLOCKS, seed=2)
    assert p.hello["connected"] and d.hello["connected"]
    # One IPC handle per CUDA allocation: torch's allocator puts tensors under 10 MiB into
    # shared 20 MiB segments, so D's layers (7.5 MiB each) share handles, at offsets.
    assert p.hello["buffers"] == (1 if layout == "crosslayer" else LAYERS if layout != "mla" else p.hello["buffers"])
    assert 1 <= d.hello["buffers"] <= LAYERS
    _push_and_check(p, d, p_daemon, _plan(random.Random(layout), 6))
    assert p_daemon.metric("pushsvc_write_parts_total") > 6  # the large ones went in parts
    assert d_daemon.metric("pushsvc_landing_copies_total") >= 6
    assert d_daemon.metric("pushsvc_landing_slots", state="used") == 0


def _registered_at_p(d, p_daemon, requests: list[tuple[str, list[int]]]) -> None:
    """D snapshots its KV and registers ``requests`` (id, D's blocks) in one step; returns
    once P's daemon has their PUSH_REGs."""
    d.call("snapshot")
    regs = p_daemon.metric("pushsvc_notifications_total", kind="push_reg")
    _recv(d, p_daemon, requests)
    deadline = time.monotonic() + 10
    while p_daemon.metric("pushsvc_notifications_total", kind="push_reg") < regs + len(requests):
        assert time.monotonic() < deadline, "D's registrations never reached P"
        time.sleep(0.01)


def _forward_and_check(p, d, p_daemon, rid: str, p_blocks: list[int], d_blocks: list[int], seed: int) -> None:
    """D registers ``rid``; once P's daemon has the PUSH_REG, P's worker queues a forward
    pass ending its prefill, each layer keeping the GPU busy ~2 ms before writing its final
    KV (layer events recorded, LayerSaved said at once). D's blocks then hold P's final
    KV, and no other block of D changed."""
    _registered_at_p(d, p_daemon, [(rid, d_blocks)])
    out = p.call("forward", rid=rid, blocks=p_blocks, step=1, seed=seed, sleep_cycles=4_000_000)
    print(f"forward pass queued in {out['queued_s'] * 1e3:.1f} ms")
    recvd = _wait(d, [rid])
    assert not recvd[rid]["errors"], recvd
    assert d.call("digests", blocks=d_blocks)["digests"] == p.call("digests", blocks=p_blocks)["digests"]
    assert sorted(d.call("changed")["blocks"]) == sorted(d_blocks)


def test_layerwise_push_posts_each_layer_once_its_kernels_ran(spawn: Spawner) -> None:
    """P's worker queues a forward pass whose layers each keep the GPU busy ~2 ms before
    writing their final KV, records each layer's event and says LayerSaved at once (the
    CPU runs far ahead of the GPU). P's daemon posts a layer only once its event is done:
    D's blocks hold P's final KV (a layer posted early would carry its old bytes), verify
    identical, one WRITE per layer or a few layers at a time, and the request is reported
    to vLLM only after the scheduler's word."""
    p_daemon = spawn.daemon("prefill", "--verify")
    d_daemon = spawn.daemon("decode", "--landing-mib", "512", "--verify")
    p = spawn.worker(p_daemon, "producer", layout="flash", layers=LAYERS, blocks=P_BLOCKS, seed=11, layerwise=1)
    d = spawn.worker(d_daemon, "consumer", layout="flash", layers=LAYERS, blocks=D_BLOCKS, seed=12)
    _forward_and_check(p, d, p_daemon, "lw-0", [5, 9, 17, 3], [100, 7, 64, 2], seed=900)
    assert d_daemon.metric("pushsvc_verify_total", result="identical") == 1
    parts = p_daemon.metric("pushsvc_write_parts_total")
    print(f"layer-wise push: {parts:.0f} WRITEs for {LAYERS} layers")
    assert 1 < parts <= LAYERS, "the layers went as they became final, not all at once"
    held = p.call("wait", rids=["lw-0"], timeout=0.5)
    assert held["missing"] == ["lw-0"], "reported to vLLM before the scheduler's word"
    p.call("finished", rids=["lw-0"])
    _wait(p, ["lw-0"])
    assert p_daemon.metric("pushsvc_transfers_total", result="done") == 1


@pytest.mark.parametrize("layout", ["flash", "mla"])
def test_pushes_from_p_staging_land_exactly_and_with_verify(spawn: Spawner, layout: str) -> None:
    """P's staging (staging_mib): blocks copied into P's own buffer, WRITEs from there; the
    worker's KV is never registered with NIXL; verify covers both copies."""
    p_daemon = spawn.daemon("prefill", "--write-part-mib", "4", "--staging-mib", "512", "--verify")
    d_daemon = spawn.daemon("decode", "--landing-mib", "512", "--verify")
    p = spawn.worker(p_daemon, "producer", layout=layout, layers=LAYERS, blocks=P_BLOCKS, seed=5)
    d = spawn.worker(d_daemon, "consumer", layout=layout, layers=LAYERS, blocks=D_BLOCKS, seed=6)
    _push_and_check(p, d, p_daemon, _plan(random.Random(f"staging-{layout}"), 6))
    assert p_daemon.metric("pushsvc_staging_copies_total") >= 6
    assert d_daemon.metric("pushsvc_verify_total", result="identical") == 6
    info = p_daemon.live_info()
    staging = sum(a["staging_bytes"] for a in info["agents"])
    slots = info["gpu"]["staging_slots"]
    assert slots["used"] == 0 and slots["total"] > 0, info
    # As many whole blocks as fit in 512 MiB (an MLA block does not divide it), the copier's
    # tables (under 1 MiB) on top, all of it accounted for.
    assert info["gpu"]["allocated"] == staging, info
    assert (512 << 20) - staging // slots["total"] < staging < (512 << 20) + (1 << 20), info


def test_verify_mode_digests_device_blocks(spawn: Spawner) -> None:
    p_daemon = spawn.daemon("prefill", "--verify")
    d_daemon = spawn.daemon("decode", "--verify", "--landing-mib", "256")
    p = spawn.worker(p_daemon, "producer", blocks=P_BLOCKS, seed=3)
    d = spawn.worker(d_daemon, "consumer", blocks=D_BLOCKS, seed=4)
    _push_and_check(p, d, p_daemon, _plan(random.Random(9), 5))
    assert d_daemon.metric("pushsvc_verify_total", result="identical") == 5
    assert d_daemon.metric("pushsvc_verify_total", result="mismatch") == 0


def test_registrations_wait_for_landing_space(spawn: Spawner) -> None:
    p_daemon = spawn.daemon("prefill")
    d_daemon = spawn.daemon("decode", "--landing-mib", "64")  # 32 slots of 2 MiB
    p = spawn.worker(p_daemon, "producer", blocks=P_BLOCKS, seed=5)
    d = spawn.worker(d_daemon, "consumer", blocks=D_BLOCKS, seed=6)
    d.call("snapshot")
    plan = [(f"w{i}", list(range(20 * i, 20 * i + 20)), list(range(20 * i, 20 * i + 20))) for i in range(4)]
    _recv(d, p_daemon, [(rid, dd) for rid, _, dd in plan])
    time.sleep(0.3)
    assert d_daemon.metric("pushsvc_landing_waits_total") == 3  # one fits, three wait their turn
    _send(p, [(rid, pp) for rid, pp, _ in plan])
    recvd = _wait(d, [rid for rid, _, _ in plan])
    assert all(not v["errors"] for v in recvd.values())
    mapped = [b for _, _, dd in plan for b in dd]
    assert d.call("digests", blocks=mapped)["digests"] == p.call("digests", blocks=mapped)["digests"]
    # 40 blocks never fit 32 slots: D fails it at once and releases the exchange, so P's
    # blocks for it are freed when they come (keyed, as a router's requests are), not at
    # the end of P's lease.
    d.call("recv", p_engine=p_daemon.engine_id, p_port=p_daemon.side_port,
           requests=[{"rid": "huge", "blocks": list(range(40, 80)), "key": "x-huge"}])
    failed = _wait(d, ["huge"])["huge"]
    assert failed["errors"] == list(range(40, 80))
    assert d_daemon.metric("pushsvc_failures_total", kind="landing_too_small") == 1
    p.call("send", requests=[{"rid": "huge", "blocks": list(range(40)), "key": "x-huge"}])
    assert _wait(p, ["huge"], timeout=10.0)["huge"]["side"] == "send"
    assert p_daemon.metric("pushsvc_transfers_total", result="released") == 1


def _gpu_state(daemon) -> dict:
    info = daemon.live_info()
    return {"gpu": info["gpu"], "handles": info["nixl_handles"], "fds": info["open_fds"], "tables": info["tables"]}


@pytest.mark.parametrize("staging", [False, True], ids=["from_kv", "from_staging"])
def test_two_p_ranks_fill_one_d_rank_by_head(spawn: Spawner, staging: bool) -> None:
    """P TP 2 -> D TP 1 on the GPU (HND blocks: KV heads outermost): each P rank WRITEs its
    four heads into its half of D's eight-head blocks, straight into D's KV (no landing
    buffer: it takes one P rank's parts only). D's request is done once both landed;
    verify checks each P rank's digests against its own half."""
    p_daemon = spawn.daemon("prefill", "--verify", *(("--staging-mib", "256") if staging else ()))
    d_daemon = spawn.daemon("decode", "--verify", "--landing-mib", "0")
    ps = [spawn.worker(p_daemon, "producer", layout="hnd", layers=8, blocks=P_BLOCKS, heads=4, rank=r, tp_size=2,
                       seed=20 + r) for r in range(2)]
    d = spawn.worker(d_daemon, "consumer", layout="hnd", layers=8, blocks=D_BLOCKS, heads=8, seed=22)
    d.call("snapshot")
    plan = [("tp-0", [5, 9, 2], [7, 1, 30]), ("tp-1", list(range(40, 80)), list(range(60, 100))),
            ("tp-2", [11, 12, 13], [3])]  # a prefix hit on D: only P's last block
    d.call("recv", p_engine=p_daemon.engine_id, p_port=p_daemon.side_port, p_tp=2,
           requests=[{"rid": rid, "blocks": dd} for rid, _, dd in plan])
    for p in ps:
        _send(p, [(rid, pp) for rid, pp, _ in plan])
    rids = [rid for rid, _, _ in plan]
    recvd = _wait(d, rids)
    assert all(v["side"] == "recv" and not v["errors"] for v in recvd.values()), recvd
    for p in ps:
        _wait(p, rids)
    mapped_p = [b for _, pp, dd in plan for b in pp[len(pp) - len(dd):]]
    mapped_d = [b for _, _, dd in plan for b in dd]
    for r, p in enumerate(ps):
        assert d.call("digests", blocks=mapped_d, heads=[4 * r, 4 * r + 4])["digests"] == \
            p.call("digests", blocks=mapped_p)["digests"], f"P rank {r}'s heads"
    assert sorted(d.call("changed")["blocks"]) == sorted(mapped_d)
    assert d_daemon.metric("pushsvc_verify_total", result="identical") == len(plan)
    assert p_daemon.metric("pushsvc_transfers_total", result="done") == 2 * len(plan)


def test_one_p_rank_fills_two_d_ranks_by_head_through_a_joint_agent(spawn: Spawner) -> None:
    """P TP 1 -> D TP 2 on the GPU (two D worker processes on the one device, HND blocks):
    D's daemon joins both D ranks' imported KV in one NIXL agent, and P's one WRITE per
    request puts heads 0-3 of its blocks into D rank 0's and heads 4-7 into D rank 1's,
    straight into their KV (no landing buffer); verify checks both halves at once."""
    p_daemon = spawn.daemon("prefill", "--verify")
    d_daemon = spawn.daemon("decode", "--verify", "--landing-mib", "0")
    p = spawn.worker(p_daemon, "producer", layout="hnd", layers=8, blocks=P_BLOCKS, heads=8, seed=24)
    ds = [spawn.worker(d_daemon, "consumer", layout="hnd", layers=8, blocks=D_BLOCKS, heads=4, rank=r, tp_size=2,
                       seed=25 + r) for r in range(2)]
    joints = d_daemon.live_info()["joints"]
    assert [(j["rank"], j["tp_size"], j["members"]) for j in joints] == [(0, 1, [0, 1])], joints
    for d in ds:
        d.call("snapshot")
    plan = [("up-0", [5, 9, 2], [7, 1, 30]), ("up-1", list(range(40, 80)), list(range(60, 100))),
            ("up-2", [11, 12, 13], [3])]  # a prefix hit on D: only P's last block
    for d in ds:
        d.call("recv", p_engine=p_daemon.engine_id, p_port=p_daemon.side_port, p_tp=1,
               requests=[{"rid": rid, "blocks": dd} for rid, _, dd in plan])
    _send(p, [(rid, pp) for rid, pp, _ in plan])
    rids = [rid for rid, _, _ in plan]
    for d in ds:
        recvd = _wait(d, rids)
        assert all(v["side"] == "recv" and not v["errors"] for v in recvd.values()), recvd
    _wait(p, rids)
    mapped_p = [b for _, pp, dd in plan for b in pp[len(pp) - len(dd):]]
    mapped_d = [b for _, _, dd in plan for b in dd]
    for r, d in enumerate(ds):
        assert d.call("digests", blocks=mapped_d)["digests"] == \
            p.call("digests", blocks=mapped_p, heads=[4 * r, 4 * r + 4])["digests"], f"D rank {r}'s heads"
        assert sorted(d.call("changed")["blocks"]) == sorted(mapped_d)
    assert d_daemon.metric("pushsvc_verify_total", result="identical") == len(plan)
    assert p_daemon.metric("pushsvc_transfers_total", result="done") == len(plan), "one WRITE per request"


def test_a_d_tp_above_ps_into_landing_buffers_is_refused_naming_it(spawn: Spawner) -> None:
    p_daemon = spawn.daemon("prefill")
    d_daemon = spawn.daemon("decode", "--landing-mib", "256")
    ds = [spawn.worker(d_daemon, "consumer", layout="hnd", layers=4, blocks=D_BLOCKS, heads=4, rank=r, tp_size=2,
                       seed=27 + r) for r in range(2)]
    assert d_daemon.live_info()["joints"] == []
    for d in ds:
        d.call("recv", p_engine=p_daemon.engine_id, p_port=p_daemon.side_port, p_tp=1,
               requests=[{"rid": "up-landing", "blocks": [1, 2]}])
    for d in ds:
        out = _wait(d, ["up-landing"])["up-landing"]
        assert out["errors"] == [1, 2], out  # the blocks come back as failed loads
    assert "P TP 1 -> D TP 2: D's KV lands in GPU landing buffers" in d_daemon.log()


def test_heterogeneous_tp_into_a_landing_buffer_is_refused_naming_it(spawn: Spawner) -> None:
    p_daemon = spawn.daemon("prefill")
    d_daemon = spawn.daemon("decode", "--landing-mib", "256")
    d = spawn.worker(d_daemon, "consumer", layout="hnd", layers=4, blocks=D_BLOCKS, heads=8, seed=23)
    d.call("recv", p_engine=p_daemon.engine_id, p_port=p_daemon.side_port, p_tp=2,
           requests=[{"rid": "tp-landing", "blocks": [1, 2]}])
    out = _wait(d, ["tp-landing"])["tp-landing"]
    assert out["errors"] == [1, 2], out  # the blocks come back as failed loads
    assert "GPU landing buffer takes KV from one P rank only" in d_daemon.log()


def _free_gpu_memory(workers: list[GpuWorker]) -> dict[GpuWorker, int]:
    """Free memory of each worker's GPU (P's and D's: one GPU or two), read once every
    worker gave back the blocks its own torch cache held: on one GPU a worker's cached
    blocks would show in the other's reading."""
    for w in workers:
        w.call("mem")
    return {w: w.call("mem")["free"] for w in workers}


def _kill_under_load(spawn: Spawner, daemons: dict, side: str, p: GpuWorker, d: GpuWorker,
                     args: tuple[str, ...]) -> tuple[float, float]:
    """Twelve requests registered at D and sent by P, then kill -9 of ``side``'s daemon and
    its restart with ``args`` (``daemons[side]`` is the new one after). Returns the daemon's
    start and the time until its worker re-registered, both in seconds, once every request
    of the load ended, done or failed: none hangs."""
    load = [(f"load-{i}", list(range(i * 8, i * 8 + 8)), list(range(i * 8, i * 8 + 8))) for i in range(12)]
    _recv(d, daemons["prefill"], [(rid, dd) for rid, _, dd in load])
    _send(p, [(rid, pp) for rid, pp, _ in load])
    old_id = daemons[side].info["daemon_id"]
    daemons[side].proc.send_signal(signal.SIGKILL)
    daemons[side].proc.wait(30)
    new, started_s = spawn.restart(daemons[side], *args)
    t0 = time.perf_counter()
    back = (p if side == "prefill" else d).call("until_connected", old=old_id, timeout=30)
    assert back["connected"] and back["daemon_id"] == new.info["daemon_id"]
    daemons[side] = new
    _wait(d, [rid for rid, _, _ in load], timeout=90)
    _wait(p, [rid for rid, _, _ in load], timeout=90)
    return started_s, started_s + back["t"] - t0


def _check_given_back(free_before: dict[GpuWorker, int], p: GpuWorker, d: GpuWorker, side: str) -> None:
    """Nothing of the killed daemon stays on either GPU (its context, imports and landing
    went with it; the new one holds the same again)."""
    free_after = _free_gpu_memory([p, d])
    for w, name in ((p, "P's"), (d, "D's")):
        assert abs(free_after[w] - free_before[w]) < 256 << 20, (
            f"{(free_before[w] - free_after[w]) >> 20} MiB of {name} GPU not given back after the {side} restart "
            f"(D's landing is 512 MiB; docs/gpu.md, known limits)")


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_kill_9_and_restart_with_the_workers_up(spawn: Spawner, side: str) -> None:
    daemons = {"prefill": spawn.daemon("prefill", "--write-part-mib", "4", "--lease-s", "20"),
               "decode": spawn.daemon("decode", "--landing-mib", "512")}
    p = spawn.worker(daemons["prefill"], "producer", blocks=P_BLOCKS, seed=7)
    d = spawn.worker(daemons["decode"], "consumer", blocks=D_BLOCKS, seed=8)
    _push_and_check(p, d, daemons["prefill"], _plan(random.Random(1), 4))
    free_before = _free_gpu_memory([p, d])
    started_s, ready_s = _kill_under_load(spawn, daemons, side, p, d, (
        ("--write-part-mib", "4", "--lease-s", "20") if side == "prefill" else ("--landing-mib", "512")))
    print(f"\n{side} daemon kill -9 -> restarted and the worker re-registered: {ready_s:.2f} s "
          f"(goal {RESTART_GOAL_S} s; daemon start {started_s:.2f} s)")
    # New requests work at once, with the new daemon.
    _push_and_check(p, d, daemons["prefill"], _plan(random.Random(2), 4))
    _check_given_back(free_before, p, d, side)
    for daemon in daemons.values():
        state = _gpu_state(daemon)
        landing = sum(a["landing_bytes"] for a in daemon.live_info()["agents"])
        assert state["gpu"]["allocated"] == landing, state
        assert (512 << 20 <= landing < (512 << 20) + (1 << 20)) if daemon is daemons["decode"] else landing == 0
        assert state["handles"]["xfers"] == 0 and state["tables"]["inflight"] == 0, state
        assert state["gpu"]["landing_slots"]["used"] == 0, state


def test_abort_storm_of_1000_operations(spawn: Spawner) -> None:
    p_daemon = spawn.daemon("prefill", "--write-part-mib", "4", "--lease-s", "30", "--watchdog-s", "30")
    d_daemon = spawn.daemon("decode", "--landing-mib", "256", "--watchdog-s", "30")
    p = spawn.worker(p_daemon, "producer", blocks=P_BLOCKS, seed=11)
    d = spawn.worker(d_daemon, "consumer", blocks=D_BLOCKS, seed=12)
    _push_and_check(p, d, p_daemon, _plan(random.Random(3), 2))  # the daemons know each other now
    baseline = {name: _gpu_state(x) for name, x in (("p", p_daemon), ("d", d_daemon))}
    rng = random.Random(20261201)
    ops = 0
    rids: list[str] = []
    n = 0
    started = time.monotonic()
    while ops < 1000:
        print(f"storm: {ops} operations, {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
        batch = []
        d_free = rng.sample(range(D_BLOCKS), D_BLOCKS)  # live requests never share D blocks
        for _ in range(16):
            size = rng.choice([1, 2, 4, 8, 12])
            rid = f"s{n}"
            n += 1
            p_ids = rng.sample(range(P_BLOCKS), size)
            d_ids, d_free = (d_free[:size], d_free[size:]) if rng.random() < 0.9 and len(d_free) >= size else (
                [], d_free)
            batch.append((rid, p_ids, d_ids))
        for rid, _, dd in batch:
            if dd:
                _recv(d, p_daemon, [(rid, dd)])
                ops += 1
        for rid, pp, _ in batch:
            _send(p, [(rid, pp)])
            ops += 1
        # Aborts at every point, before, during and after the WRITE: D's engine drops the
        # request, P's backstop fires for it.
        aborted = [rid for rid, _, _ in batch if rng.random() < 0.3]
        dropped = [rid for rid, _, dd in batch if dd and rid in aborted]
        if dropped:
            d.call("evict", rids=dropped)
            ops += len(dropped)
        # P also drops what D never registered for (its lease would, much later).
        expired = sorted(set(aborted) | {rid for rid, _, dd in batch if not dd})
        if expired:
            p.call("expire", rids=expired)
            ops += len(expired)
        _wait(d, [rid for rid, _, dd in batch if dd], timeout=60)
        _wait(p, [rid for rid, _, _ in batch], timeout=60)
        rids += [rid for rid, _, _ in batch]
    print(f"\nabort storm: {ops} operations over {len(rids)} requests")
    for name, daemon in (("p", p_daemon), ("d", d_daemon)):
        state = _gpu_state(daemon)
        assert state["tables"] == baseline[name]["tables"], state
        assert state["handles"] == baseline[name]["handles"], state
        assert state["gpu"] == baseline[name]["gpu"], state


def _fd_kinds(pid: int) -> collections.Counter:
    """What a process's descriptors are open on, by kind (``socket``, ``/dev/nvidia-uvm``, ...)."""
    kinds: collections.Counter = collections.Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        kinds[target.split(":[")[0] if ":[" in target else target] += 1
    return kinds


def test_nothing_leaks_when_workers_come_and_go(spawn: Spawner) -> None:
    p_daemon = spawn.daemon("prefill")
    d_daemon = spawn.daemon("decode", "--landing-mib", "128")
    empty = {name: _gpu_state(x) for name, x in (("p", p_daemon), ("d", d_daemon))}
    fds_at_start = {name: _fd_kinds(x.proc.pid) for name, x in (("p", p_daemon), ("d", d_daemon))}
    after_first: dict[str, collections.Counter] = {}
    for cycle in range(4):
        p = spawn.worker(p_daemon, "producer", blocks=P_BLOCKS, seed=cycle)
        d = spawn.worker(d_daemon, "consumer", blocks=D_BLOCKS, seed=cycle + 10)
        _push_and_check(p, d, p_daemon, _plan(random.Random(cycle), 3))
        info = d_daemon.live_info()
        landing = sum(a["landing_bytes"] for a in info["agents"])
        # the landing buffer and its copy table, nothing else
        assert info["gpu"]["allocated"] == landing and 128 << 20 <= landing < (128 << 20) + (1 << 20), info
        p.close()
        d.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(
                _gpu_state(x)["gpu"]["imported"] for x in (p_daemon, d_daemon)):
            time.sleep(0.1)
        for name, daemon in (("p", p_daemon), ("d", d_daemon)):
            state = _gpu_state(daemon)
            assert state["gpu"]["imported"] == 0 and state["gpu"]["allocated"] == 0, state
            assert state["handles"] == empty[name]["handles"], state
            now = _fd_kinds(daemon.proc.pid)
            if cycle == 0:
                # The first registration initializes the driver's and UCX's CUDA state for
                # good (measured: ~10 descriptors on /dev/nvidia*, one socket, one
                # anon_inode): device files only, and never again.
                opened = now - fds_at_start[name]
                assert sum(opened.values()) <= 16 and all(
                    k.startswith("/dev/nvidia") or k in ("socket", "anon_inode") for k in opened), (name, opened)
                after_first[name] = now
                continue
            assert sum(now.values()) <= sum(after_first[name].values()) + 2, (
                f"cycle {cycle}, {name}: {sum(after_first[name].values())} -> {sum(now.values())} fds; "
                f"opened: {dict(now - after_first[name])}, closed: {dict(after_first[name] - now)}")
