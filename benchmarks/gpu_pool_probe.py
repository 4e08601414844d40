"""Could D's KV live in memory D's daemon allocated (vLLM's ``get_mem_pool_context()``), and
would it survive a restart of that daemon? (docs/gpu.md, "Why not the alternatives").

A WRITE is fast only into memory the registering daemon allocated itself, so a zero-copy D
would have vLLM allocate its KV from the daemon: the daemon ``cuMemAlloc``s, exports the
allocation over legacy CUDA IPC, and the worker maps it and hands it to torch through a
``MemPool`` whose allocator returns the mapped range. This probe checks, on the device,
each step of that and what a daemon restart leaves:

1. the worker's tensors made inside ``torch.cuda.use_mem_pool`` lie in the daemon's
   allocation (a pluggable allocator over the mapping);
2. whether the worker can export its mapping again (``cuIpcGetMemHandle``), as the
   connector does for the KV it registers;
3. after the owner dies (SIGKILL) or frees the allocation and exits, whether the worker's
   tensors still hold and take their bytes;
4. whether a new process (a restarted daemon) can open the dead owner's handle.

Three processes per case: the owner (the daemon's part), this one (the worker's), and a
late opener (the restarted daemon's). It prints one line per check; ``--json`` writes them.

    python benchmarks/gpu_pool_probe.py [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

MiB = 1 << 20
SIZE = 64 * MiB
KV_SHAPE = (2, 200, 16, 8, 128)  # FlashAttention [2, blocks, block_size, heads, dim], bf16: 13 MiB


def _owner(conn, ending: str) -> None:
    from pushsvc.devmem.driver import Driver

    driver = Driver()
    driver.use(driver.retain_context(0))
    ptr = driver.alloc(SIZE)
    driver.memset(ptr, 0x11, SIZE)
    conn.send(driver.export_allocation(ptr).handle)
    conn.recv()  # the worker has mapped it and written its tensors
    if ending == "freed":
        driver.free(ptr)
        conn.send("freed")
        conn.recv()
        os._exit(0)
    time.sleep(3600)  # killed by the parent


def _late_opener(conn, handle: bytes) -> None:
    from pushsvc.devmem.driver import Driver

    driver = Driver()
    driver.use(driver.retain_context(0))
    try:
        base, size = driver.ipc_open(handle)
    except Exception as exc:  # noqa: BLE001 - the answer is the error
        conn.send(f"refused: {exc}")
        return
    conn.send(f"opened ({size >> 20} MiB at {base:#x})")


def _pool_over(base: int, size: int):
    """A torch MemPool whose allocator hands out [base, base + size) front to back."""
    import torch

    alloc_t = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
    free_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    cursor = [base]

    def alloc(nbytes, device, stream):
        start, cursor[0] = cursor[0], cursor[0] + nbytes
        return start if cursor[0] <= base + size else 0

    def free(ptr, nbytes, stream):
        pass  # the mapping goes with the process

    callbacks = (alloc_t(alloc), free_t(free))
    addr = [ctypes.cast(cb, ctypes.c_void_p).value for cb in callbacks]
    pool = torch.cuda.MemPool(torch._C._cuda_customAllocator(*addr))
    return pool, callbacks


def probe(ending: str) -> dict[str, str]:
    import torch

    from pushsvc.devmem.driver import Driver

    ctx = mp.get_context("spawn")
    out: dict[str, str] = {}
    mine, theirs = ctx.Pipe()
    owner = ctx.Process(target=_owner, args=(theirs, ending))
    owner.start()
    handle = mine.recv()
    torch.zeros(1, device="cuda")
    driver = Driver()
    base, size = driver.ipc_open(handle)
    pool, _callbacks = _pool_over(base, size)
    with torch.cuda.use_mem_pool(pool):
        flat = torch.zeros(32 * MiB, dtype=torch.int8, device="cuda")
        kv = torch.zeros(KV_SHAPE, dtype=torch.bfloat16, device="cuda")
    inside = all(base <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= base + size
                 for t in (flat, kv))
    out["tensors in the owner's allocation"] = "yes" if inside else "no"
    try:
        driver.export_allocation(base)
        out["worker exports its mapping again"] = "yes"
    except Exception as exc:  # noqa: BLE001
        out["worker exports its mapping again"] = f"refused: {exc}"
    flat.fill_(7)
    kv.fill_(1.5)
    torch.cuda.synchronize()
    mine.send("mapped")
    if ending == "freed":
        mine.recv()
        mine.send("exit")
    else:
        os.kill(owner.pid, signal.SIGKILL)
    owner.join(30)
    out["owner ended"] = f"{ending} (exit code {owner.exitcode})"
    try:
        held = bool((flat == 7).all()) and bool((kv == 1.5).all())
        flat.fill_(9)
        torch.cuda.synchronize()
        out["worker's tensors after the owner ended"] = "bytes kept, writable" if held else "bytes changed"
    except Exception as exc:  # noqa: BLE001
        out["worker's tensors after the owner ended"] = f"failed: {exc}"
    mine2, theirs2 = ctx.Pipe()
    late = ctx.Process(target=_late_opener, args=(theirs2, handle))
    late.start()
    out["a new process opens the owner's handle"] = mine2.recv()
    late.join(30)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the answers here")
    args = ap.parse_args()
    results = {}
    for ending in ("killed", "freed"):
        results[ending] = probe(ending)
        print(f"owner {ending}:")
        for check, answer in results[ending].items():
            print(f"  {check:42s} {answer}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"when": time.strftime("%Y-%m-%d %H:%M:%S"), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
