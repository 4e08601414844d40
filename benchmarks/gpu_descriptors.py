"""How the shape of a WRITE's descriptor lists costs on one GPU, and the device
primitives the GPU path is built on (docs/gpu.md).

Two processes, each owning a 1 GiB ``cudaMalloc``'d buffer (torch) registered with its own
NIXL agent (UCX, progress thread off). The same 256 MiB is written with descriptor lists
of different shapes: dense 32 KiB blocks in order (both sides contiguous), the destination
strided (every other block), both sides scattered (random permutations), and 1 MiB
blocks. Then, across the same two processes: a CUDA IPC export by the driver calls
(``devmem.driver``), the import, and the landing gather (``index_copy_`` over int64 rows of
a view spanning two imported allocations) with its event polled.

    python benchmarks/gpu_descriptors.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nixl_pair import timed_write  # noqa: E402  (benchmarks/, next to this script)
from pushsvc.engine.nixl import NixlEngine  # noqa: E402

GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10
TOTAL = 256 * MiB


def _patterns(base_src: int, base_dst: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = {}
    for name, block in (("dense_32k", 32 * KiB), ("dense_1m", MiB), ("dst_strided_32k", 32 * KiB),
                        ("scattered_32k", 32 * KiB)):
        n = TOTAL // block
        src_slots = np.arange(n)
        dst_slots = np.arange(n)
        if name.startswith("dst_strided"):
            dst_slots = dst_slots * 2
        if name.startswith("scattered"):
            src_slots = rng.permutation(2 * n)[:n]
            dst_slots = rng.permutation(2 * n)[:n]
        src = np.stack([base_src + src_slots * block, np.full(n, block), np.zeros(n)], axis=1).astype(np.uint64)
        dst = np.stack([base_dst + dst_slots * block, np.full(n, block), np.zeros(n)], axis=1).astype(np.uint64)
        out[name] = (src, dst)
    return out


def _target(conn) -> None:
    import torch

    from pushsvc.devmem.driver import Driver

    torch.cuda.set_device(0)
    buf = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    agent = NixlEngine(["UCX"]).create_agent("probe-target")
    agent.register([(buf.data_ptr(), GiB)], "VRAM", 0)
    conn.send((agent.metadata(), buf.data_ptr()))
    agent.add_remote(conn.recv())
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        if cmd[0] == "notif":
            want = cmd[1].encode()
            conn.send("armed")
            seen: set[bytes] = set()
            while want not in seen:
                for msgs in agent.notifs().values():
                    seen.update(msgs)
            conn.send(time.perf_counter())
        elif cmd[0] == "import":  # the landing primitives, on memory another process owns
            handles = cmd[1]
            driver = Driver()
            mapped = [driver.ipc_open(h) for h in handles]
            conn.send(_gather_check(torch, mapped, buf))
            for address, _ in mapped:
                driver.ipc_close(address)
    agent.close()


class _Raw:
    def __init__(self, address: int, shape: tuple[int, ...]) -> None:
        self.__cuda_array_interface__ = {"data": (address, False), "shape": shape, "typestr": "<i8",
                                         "strides": None, "version": 2}


def _gather_check(torch, mapped: list[tuple[int, int]], own) -> dict:
    """Rows of 32 KiB over a view spanning two imported allocations; copy 256 MiB of own
    buffer into scattered rows of both, on a side stream, and poll the event."""
    unit = 32 * KiB
    origin = min(a for a, _ in mapped)
    end = max(a + s for a, s in mapped)
    span = torch.as_tensor(_Raw(origin, ((end - origin) // unit, unit // 8)), device="cuda")
    rows_per = [(a - origin) // unit for a, _ in mapped]
    n = TOTAL // unit
    half = n // 2
    rng = np.random.default_rng(1)
    idx = np.concatenate([rows_per[0] + rng.permutation(mapped[0][1] // unit)[:half],
                          rows_per[1] + rng.permutation(mapped[1][1] // unit)[:n - half]]).astype(np.int64)
    src = own[:TOTAL].view(torch.int64).view(n, unit // 8)
    src.copy_(torch.randint(-(1 << 62), 1 << 62, src.shape, device="cuda", dtype=torch.int64))
    stream = torch.cuda.Stream()
    index = torch.from_numpy(idx).cuda()
    torch.cuda.synchronize()
    times = []
    polls = 0
    for _ in range(6):
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            span.index_copy_(0, index, src)
            ev = torch.cuda.Event()
            ev.record(stream)
        while not ev.query():
            polls += 1
        times.append(time.perf_counter() - t0)
    ok = bool(torch.equal(span.index_select(0, index), src))
    return {"gather_ok": ok, "gather_256mib_s": float(np.median(times[1:])), "event_polls": polls,
            "gather_tb_s": TOTAL / float(np.median(times[1:])) / 1e12}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch

    from pushsvc.devmem.driver import Driver

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child,))
    proc.start()
    torch.cuda.set_device(0)
    buf = torch.randint(0, 255, (GiB,), dtype=torch.uint8, device="cuda")
    agent = NixlEngine(["UCX"]).create_agent("probe-initiator")
    agent.register([(buf.data_ptr(), GiB)], "VRAM", 0)
    meta, dst_base = parent.recv()
    parent.send(agent.metadata())
    name = agent.add_remote(meta)
    results: dict = {"writes": {}}
    for pattern, (src, dst) in _patterns(buf.data_ptr(), dst_base).items():
        local = agent.prep_local(src, "VRAM")
        remote = agent.prep_remote(name, dst, "VRAM")
        idx = np.arange(len(src), dtype=np.int32)
        times = []
        for rep in range(6):
            tag = f"{pattern}-{rep}"
            parent.send(("notif", tag))
            parent.recv()
            t0 = timed_write(agent, local, idx, remote, idx, tag).start
            seen = parent.recv()
            if rep:
                times.append(max(seen, time.perf_counter()) - t0)
        s = float(np.median(times))
        results["writes"][pattern] = {"descriptors": len(src), "seconds": s, "gb_s": TOTAL / s / 1e9}
        print(json.dumps({pattern: results["writes"][pattern]}), flush=True)
        agent.release_dlist(local)
        agent.release_dlist(remote)
    # Device primitives: two allocations exported by the driver calls, imported by the target.
    driver = Driver()
    a = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    b = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    exports = [driver.export_allocation(t.data_ptr()) for t in (a, b)]
    results["export"] = [{"base_is_ptr": e.base == t.data_ptr(), "size": e.size} for e, t in zip(exports, (a, b))]
    results["device_uuid"] = driver.device_uuid(driver.pointer_device(a.data_ptr())).hex()
    parent.send(("import", [e.handle for e in exports]))
    results["import"] = parent.recv()
    print(json.dumps({"export": results["export"], "import": results["import"]}), flush=True)
    parent.send(None)
    proc.join(60)
    agent.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
