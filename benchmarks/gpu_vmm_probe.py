"""Which kinds of device memory can be a fast NIXL WRITE destination when the process that
registers it did not allocate it (docs/gpu.md, "Memory kinds").

The GPU path lands WRITEs in a buffer D's daemon owns and copies them into the worker's
KV, because a destination the daemon only *imported* over legacy CUDA IPC is written at
~0.4 GB/s (UCX cannot export an imported mapping again). A zero-copy D needs a kind of
memory that a process other than the daemon owns (the worker, so it outlives a daemon
restart) and that the daemon can import *and* UCX can hand to the WRITing process. CUDA
VMM allocations can be exported as POSIX fds or as fabric handles; this probe measures a
WRITE into each kind, owned and imported by the registering process:

* ``malloc-owned``: ``cudaMalloc`` by the registering process (the baseline);
* ``vmm-fd-owned`` / ``vmm-fd-imported``: ``cuMemCreate`` with POSIX-fd handles;
* ``vmm-fabric-owned`` / ``vmm-fabric-imported``: ``cuMemCreate`` with fabric handles
  (an imported fabric allocation can be exported again by its importer).

Three processes: an exporter (the worker's part: it allocates and exports), the target
(D's daemon's part: imports or allocates, registers with NIXL, waits for notifications) and
this one (P: owns its source, WRITEs 256 MiB as 8192 x 32 KiB descriptors, five times).
A kind whose allocation, export or import the driver refuses is reported with the error.

    python benchmarks/gpu_vmm_probe.py [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import sys
import time
from multiprocessing import reduction

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nixl_pair import timed_write  # noqa: E402  (benchmarks/, next to this script)
from pushsvc.engine.nixl import NixlEngine  # noqa: E402

MiB, KiB = 1 << 20, 1 << 10
SIZE = 512 * MiB
TOTAL = 256 * MiB
BLOCK = 32 * KiB
POSIX_FD, FABRIC = 1, 8  # CUmemAllocationHandleType
KINDS = ("malloc-owned", "vmm-fd-owned", "vmm-fd-imported", "vmm-fabric-owned", "vmm-fabric-imported")


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("location", _Location),
                ("win32", ctypes.c_void_p), ("compression", ctypes.c_ubyte), ("rdma", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class Vmm:
    """The CUDA driver's virtual memory calls, on device 0 (its primary context)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._ok(self.lib.cuInit(0), "cuInit")
        self.ctx = ctypes.c_void_p()
        self._ok(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), 0), "cuDevicePrimaryCtxRetain")
        self._ok(self.lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def _ok(self, rc: int, what: str) -> None:
        if rc:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise RuntimeError(f"{what}: {(name.value or b'?').decode()} ({rc})")

    def create(self, handle_type: int) -> int:
        prop = _Prop(type=1, handle_types=handle_type, location=_Location(1, 0), rdma=1)
        handle = ctypes.c_ulonglong()
        self._ok(self.lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(SIZE), ctypes.byref(prop),
                                      ctypes.c_ulonglong(0)), "cuMemCreate")
        return handle.value

    def export(self, handle: int, handle_type: int) -> bytes | int:
        if handle_type == FABRIC:
            out = (ctypes.c_ubyte * 64)()
            self._ok(self.lib.cuMemExportToShareableHandle(out, ctypes.c_ulonglong(handle), handle_type,
                                                           ctypes.c_ulonglong(0)), "cuMemExportToShareableHandle")
            return bytes(out)
        fd = ctypes.c_int()
        self._ok(self.lib.cuMemExportToShareableHandle(ctypes.byref(fd), ctypes.c_ulonglong(handle), handle_type,
                                                       ctypes.c_ulonglong(0)), "cuMemExportToShareableHandle")
        return fd.value

    def import_(self, shared: bytes | int, handle_type: int) -> int:
        handle = ctypes.c_ulonglong()
        if handle_type == FABRIC:
            buf = (ctypes.c_ubyte * 64).from_buffer_copy(shared)
            rc = self.lib.cuMemImportFromShareableHandle(ctypes.byref(handle), buf, handle_type)
        else:
            rc = self.lib.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(shared),
                                                         handle_type)
        self._ok(rc, "cuMemImportFromShareableHandle")
        return handle.value

    def map(self, handle: int) -> int:
        ptr = ctypes.c_ulonglong()
        self._ok(self.lib.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(SIZE), ctypes.c_size_t(0),
                                              ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
        self._ok(self.lib.cuMemMap(ptr, ctypes.c_size_t(SIZE), ctypes.c_size_t(0), ctypes.c_ulonglong(handle),
                                   ctypes.c_ulonglong(0)), "cuMemMap")
        access = _Access(location=_Location(1, 0), flags=3)  # read-write
        self._ok(self.lib.cuMemSetAccess(ptr, ctypes.c_size_t(SIZE), ctypes.byref(access), ctypes.c_size_t(1)),
                 "cuMemSetAccess")
        return ptr.value

    def malloc(self) -> int:
        ptr = ctypes.c_ulonglong()
        self._ok(self.lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(SIZE)), "cuMemAlloc")
        return ptr.value

    def head(self, ptr: int, n: int = 64) -> bytes:
        self._ok(self.lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        out = (ctypes.c_ubyte * n)()
        self._ok(self.lib.cuMemcpyDtoH_v2(out, ctypes.c_ulonglong(ptr), ctypes.c_size_t(n)), "cuMemcpyDtoH")
        return bytes(out)


def _exporter(conn, handle_type: int) -> None:
    """The worker's part: allocate VMM memory, export it, keep it until told."""
    try:
        vmm = Vmm()
        shared = vmm.export(vmm.create(handle_type), handle_type)
        if handle_type == FABRIC:
            conn.send(("ok", shared))
        else:
            conn.send(("fd", None))
            reduction.send_handle(conn, shared, os.getppid())
    except Exception as exc:  # reported by the main process
        conn.send(("error", str(exc)))
    conn.recv()


def _target(conn, kind: str) -> None:
    """D's daemon's part: own or import the destination, register it, wait for each WRITE."""
    try:
        vmm = Vmm()
        handle_type = FABRIC if "fabric" in kind else POSIX_FD
        if kind == "malloc-owned":
            ptr = vmm.malloc()
        elif kind.endswith("-owned"):
            ptr = vmm.map(vmm.create(handle_type))
        else:
            status, shared = conn.recv()
            if status == "fd":
                shared = reduction.recv_handle(conn)
            ptr = vmm.map(vmm.import_(shared, handle_type))
        agent = NixlEngine(["UCX"]).create_agent(f"probe-{kind}")
        agent.register([(ptr, SIZE)], "VRAM", 0)
        conn.send(("ok", agent.metadata(), ptr))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}", 0))
        return
    agent.add_remote(conn.recv())
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        want = cmd.encode()
        conn.send("armed")
        seen: set[bytes] = set()
        while want not in seen:
            for msgs in agent.notifs().values():
                seen.update(msgs)
        conn.send(vmm.head(ptr))
    agent.close()


STEP_S = 30.0  # the longest any step of a probe may take before the kind is reported stuck


def _recv(conn, what: str):
    if not conn.poll(STEP_S):
        raise TimeoutError(f"no answer within {STEP_S:.0f} s: {what}")
    return conn.recv()


def _probe(kind: str, src, agent, local, src_idx) -> dict:
    try:
        return _run_probe(kind, src, agent, local, src_idx)
    except (TimeoutError, EOFError, OSError, RuntimeError) as exc:
        return {"kind": kind, "error": f"{type(exc).__name__}: {exc}"}


def _run_probe(kind: str, src, agent, local, src_idx) -> dict:
    ctx = mp.get_context("spawn")
    exporter = None
    parent, child = ctx.Pipe()
    if kind.endswith("-imported"):
        e_parent, e_child = ctx.Pipe()
        exporter = ctx.Process(target=_exporter, args=(e_child, FABRIC if "fabric" in kind else POSIX_FD))
        exporter.start()
        status, shared = _recv(e_parent, "the exporter's handle")
        if status == "fd":
            shared = reduction.recv_handle(e_parent)
        if status == "error":
            e_parent.send("stop")
            exporter.join(10)
            return {"kind": kind, "error": f"exporter: {shared}"}
    target = ctx.Process(target=_target, args=(child, kind))
    target.start()
    try:
        if exporter is not None:
            parent.send((status, None if status == "fd" else shared))
            if status == "fd":
                reduction.send_handle(parent, shared, target.pid)
        status, meta, base = _recv(parent, "the target's registration")
        if status == "error":
            return {"kind": kind, "error": meta}
        name = agent.add_remote(meta)
        parent.send(agent.metadata())
        n = TOTAL // BLOCK
        dst = np.stack([base + np.arange(n) * BLOCK, np.full(n, BLOCK), np.zeros(n)], axis=1).astype(np.uint64)
        remote = agent.prep_remote(name, dst, "VRAM")
        rates = []
        head = b""
        for i in range(5):
            parent.send(f"w{i}")
            assert _recv(parent, "armed") == "armed"
            t0 = timed_write(agent, local, src_idx, remote, np.arange(n), f"w{i}").start
            head = _recv(parent, f"WRITE {i}'s notification")
            rates.append(TOTAL / (time.perf_counter() - t0) / 1e9)
        parent.send(None)
        return {"kind": kind, "gb_s": rates, "median_gb_s": float(np.median(rates[1:])),
                "bytes_ok": head == src[:64].cpu().numpy().tobytes()}
    finally:
        target.join(10)
        if target.is_alive():
            target.kill()
        if exporter is not None:
            if exporter.is_alive():
                e_parent.send("stop")
            exporter.join(10)
            if exporter.is_alive():
                exporter.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--kinds", default=",".join(KINDS))
    args = ap.parse_args()
    import torch

    src = torch.randint(0, 256, (SIZE,), dtype=torch.uint8, device="cuda")
    agent = NixlEngine(["UCX"]).create_agent("probe-source")
    agent.register([(src.data_ptr(), SIZE)], "VRAM", 0)
    n = TOTAL // BLOCK
    table = np.stack([src.data_ptr() + np.arange(n) * BLOCK, np.full(n, BLOCK), np.zeros(n)], axis=1)
    local = agent.prep_local(table.astype(np.uint64), "VRAM")
    results = []
    for kind in args.kinds.split(","):
        results.append(_probe(kind, src, agent, local, np.arange(n)))
        print(json.dumps(results[-1]), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    agent.close()


if __name__ == "__main__":
    main()
