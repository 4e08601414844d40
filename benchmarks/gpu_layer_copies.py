"""How the same-host copies of one forward pass's requests finish, launched three ways with
the daemon's own pair copy (``pushsvc.devmem.cuda``: the kernel, the stream, the pooled
events P's daemon uses), from a process of their own as P's daemon launches them:

* ``whole``: after the pass, one launch per request (every layer);
* ``per request``: at each layer's end, one launch per request (that layer), as
  ``LayerCopy`` does;
* ``per layer``: at each layer's end, one launch for that layer of every request.

``--busy none``: the launches back to back, the GPU otherwise idle. ``--busy sleep``:
another process runs a pass of ``--layers`` spinning kernels of ``--layer-cycles`` each (P's
worker's forward pass, as ``gpu_push.py --layerwise`` simulates it), and this one launches
each layer's copies when that layer would end (paced on the host's clock); the pass's end
is when the other process saw its kernels done.

Per way: what is left after the pass (from its end until this process saw the last copy
done, polling the copies' events as P's loop does), the share of the layer copies already
done at the pass's end, and the host time one launch call takes. Requests of ``--blocks``
vLLM-shaped blocks each (32 layers x K,V x 32 KiB), P's and D's block ids a permutation.
Prints a table, writes ``gpu_layer_copies.json``. Needs one CUDA GPU and torch (the busy
process only).

    python benchmarks/gpu_layer_copies.py [--requests 8] [--blocks 16,256] [--busy none,sleep]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pushsvc.state.landing import CopyPlan  # noqa: E402

HALF = 32 * 1024  # one layer's K (or V) of one block: 16 tokens x 8 heads x 128 dim bf16
WAYS = ("whole", "per request", "per layer")


def _pass(layers: int, cycles: int, go, ended, stop) -> None:
    """The other process: on ``go``, a pass of ``layers`` spinning kernels; ``ended`` gets
    the host time it saw them done."""
    import torch

    torch.cuda.init()
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    go.clear()
    ended.value = -1.0
    while not stop.is_set():
        if not go.wait(0.05):
            continue
        go.clear()
        for _ in range(layers):
            torch.cuda._sleep(cycles)
        torch.cuda.synchronize()
        ended.value = time.perf_counter()


class _Copies:
    def __init__(self, layers: int, blocks: int) -> None:
        from pushsvc.devmem.cuda import CudaMemory

        self.memory = CudaMemory()
        self.device = self.memory.device(self.memory._driver.device_uuid(0))
        self.layers, self.blocks = layers, blocks
        regions = 2 * layers
        span = blocks * HALF
        self.src = self.device.allocate(regions * span)
        self.dst = self.device.allocate(regions * span)
        table = np.zeros((regions, 8), dtype=np.int64)
        for r in range(regions):
            table[r, :7] = (self.src.address + r * span, HALF, blocks, self.dst.address + r * span, HALF, blocks, HALF)
        plan = CopyPlan(table, np.arange(regions, dtype=np.int64), np.zeros(regions, dtype=np.int64), 1, 0, 16,
                        pairs=True)
        self.copier = self.device.pair_copier(plan)

    def close(self) -> None:
        self.device.synchronize()
        self.copier.close()
        self.src.close()
        self.dst.close()
        self.memory.close()


def _requests(n_requests: int, blocks: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_requests):
        ids = np.arange(i * blocks, (i + 1) * blocks, dtype=np.int64)
        out.append((ids, rng.permutation(ids)))
    return out


def _one(copies: _Copies, way: str, reqs, layer_s: float, go, ended) -> dict:
    """One pass: launches of ``way``; what is left after the pass's end."""
    copier, layers = copies.copier, copies.layers
    launch_s: list[float] = []
    jobs: list = []

    def launch(src, dst, entries) -> None:
        t = time.perf_counter()
        jobs.append(copier.launch(0, src, dst, entries))
        launch_s.append(time.perf_counter() - t)

    merged = (np.concatenate([s for s, _ in reqs]), np.concatenate([d for _, d in reqs]))
    if go is not None:
        ended.value = -1.0
        go.set()
    start = time.perf_counter()
    if way != "whole":
        for layer in range(layers):
            while time.perf_counter() < start + (layer + 1) * layer_s:
                pass
            if way == "per request":
                for src, dst in reqs:
                    launch(src, dst, (2 * layer, 2))
            else:
                launch(*merged, (2 * layer, 2))
    if go is not None:
        while ended.value < 0:
            pass
        pass_end = ended.value
    else:
        pass_end = start
    done_at_end = sum(job.done() for job in jobs) / len(jobs) if jobs else 0.0
    if way == "whole":
        for src, dst in reqs:
            launch(src, dst, None)
    for job in jobs:  # they finish in order: P's loop would see the last one done so
        while not job.done():
            pass
    return {"after_s": time.perf_counter() - pass_end, "done_at_end": done_at_end,
            "launch_us": statistics.median(launch_s) * 1e6, "launches": len(launch_s)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--blocks", default="16,256", help="blocks per request")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--busy", default="none,sleep")
    ap.add_argument("--layer-cycles", type=int, default=2_000_000, help="--busy sleep: GPU cycles a layer")
    ap.add_argument("--layer-ms", type=float, default=1.0, help="--busy sleep: host pacing of a layer's launches")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-results"))
    args = ap.parse_args()
    sizes = [int(b) for b in args.blocks.split(",")]
    ctx = mp.get_context("spawn")
    results = []
    for busy in args.busy.split(","):
        go = ended = stop = proc = None
        if busy == "sleep":
            go, stop, ended = ctx.Event(), ctx.Event(), ctx.Value("d", -1.0, lock=False)
            go.set()
            proc = ctx.Process(target=_pass, args=(args.layers, args.layer_cycles, go, ended, stop), daemon=True)
            proc.start()
            deadline = time.monotonic() + 120
            while go.is_set() and time.monotonic() < deadline:
                time.sleep(0.01)
        try:
            for n in sizes:
                copies = _Copies(args.layers, args.requests * n)
                try:
                    reqs = _requests(args.requests, n, n)
                    for way in WAYS:
                        runs = [_one(copies, way, reqs, args.layer_ms / 1e3 if busy == "sleep" else 0.0, go, ended)
                                for _ in range(args.repeats + 1)][1:]
                        row = {"busy": busy, "blocks": n, "way": way,
                               "after_ms": statistics.median(r["after_s"] for r in runs) * 1e3,
                               "done_at_end": statistics.median(r["done_at_end"] for r in runs),
                               "launch_us": statistics.median(r["launch_us"] for r in runs),
                               "launches": runs[0]["launches"]}
                        results.append(row)
                        print(f"{busy:5s} {n:5d} blocks x {args.requests} {way:11s}: {row['after_ms']:7.3f} ms after "
                              f"the pass, {row['done_at_end']:4.0%} of the layer copies done at its end, "
                              f"{row['launches']} launches of {row['launch_us']:.1f} us", flush=True)
                finally:
                    copies.close()
        finally:
            if proc is not None:
                stop.set()
                proc.join(30)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_layer_copies.json").write_text(json.dumps(
        {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "requests": args.requests, "layers": args.layers,
         "layer_cycles": args.layer_cycles, "layer_ms": args.layer_ms, "repeats": args.repeats,
         "rows": results}, indent=2))


if __name__ == "__main__":
    main()
