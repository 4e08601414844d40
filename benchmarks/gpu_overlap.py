"""Does a copy launched by one process overlap kernels another process keeps running on the
same GPU? The question behind the same-host push's layer-wise copies (docs/gpu.md): P's
daemon copies each layer into D's KV while P's worker runs the forward pass. Two
processes' kernels do not share the GPU's SMs (no MPS); each holds them in turn, a time
slice at a time. Whether a ``cudaMemcpyAsync`` escapes that is what ``memcpy`` shows.

One process keeps the GPU busy (``--busy sleep``: a spinning kernel on one SM, ~1 ms, as
the GPU tests' simulated layers; ``matmul``: bf16 matmuls on every SM, as a forward pass),
``--depth`` kernels queued between two waits for the GPU (the GPU is idle for that process
only in those waits). Another times, on the host's clock from the launch until its stream
is done, a copy of N MiB of 32 KiB rows (a layer half of one vLLM-shaped block), three
ways:

* ``kernel``: one gather kernel (``index_copy_`` over int64 rows, scattered ids), SMs;
* ``memcpy``: one ``cudaMemcpyAsync`` of the same bytes (``copy_`` of contiguous
  tensors; copy engine or SMs is the driver's choice);
* ``memcpy x64``: the same bytes in 64 ``cudaMemcpyAsync`` calls (runs of blocks).

Each against the same copy with the GPU idle. ``--same-process``: also with the busy
kernels queued by the copying process itself, on a stream of its own (what a copy the
worker launched would meet: one process's streams share the GPU without time slices).
``--mps``: all of it as clients of a private MPS server, which lets two processes'
kernels share the GPU (``mps.py``). Prints a table, writes ``gpu_overlap.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

from mps import run_under_mps

ROW = 32 * 1024  # bytes: 16 tokens x 8 KV heads x 128 dim bf16


class _Load:
    """Busy work of ``kind`` queued ``depth`` kernels at a time on a stream of its own."""

    def __init__(self, kind: str, depth: int) -> None:
        import torch

        self.kind, self.depth = kind, depth
        self.stream = torch.cuda.Stream()
        if kind == "matmul":  # the sleep kernel needs no operands
            with torch.cuda.stream(self.stream):
                self.a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
                self.b = torch.randn_like(self.a)
            self.stream.synchronize()

    def queue(self) -> None:
        import torch

        with torch.cuda.stream(self.stream):
            for _ in range(self.depth):
                if self.kind == "sleep":
                    torch.cuda._sleep(2_000_000)
                else:
                    self.a @ self.b

    def drain(self) -> None:
        self.stream.synchronize()


def _busy(kind: str, depth: int, ready, stop) -> None:
    load = _Load(kind, depth)
    ready.set()
    while not stop.is_set():
        load.queue()
        load.drain()


def _timed(launch, repeats: int, load: _Load | None = None) -> float:
    """Median seconds from ``launch()`` to its stream done; with ``load``, its busy kernels
    queued in this process (on their own stream) just before each launch."""
    import torch

    stream = torch.cuda.current_stream()
    times = []
    for _ in range(repeats + 1):
        stream.synchronize()
        if load is not None:
            load.queue()
        started = time.perf_counter()
        launch()
        stream.synchronize()
        times.append(time.perf_counter() - started)
        if load is not None:
            load.drain()
    return statistics.median(times[1:])


def copies(sizes_mib: list[int], repeats: int, load: _Load | None = None) -> dict[str, float]:
    import torch

    out = {}
    for mib in sizes_mib:
        rows = (mib << 20) // ROW
        src = torch.randint(0, 1 << 60, (rows, ROW // 8), device="cuda", dtype=torch.int64)
        dst = torch.empty_like(src)
        ids = torch.randperm(rows, device="cuda")
        pieces = list(zip(src.chunk(64), dst.chunk(64)))

        def runs() -> None:
            for s, d in pieces:
                d.copy_(s)

        out[f"{mib} kernel"] = _timed(lambda: dst.index_copy_(0, ids, src), repeats, load)
        out[f"{mib} memcpy"] = _timed(lambda: dst.copy_(src), repeats, load)
        out[f"{mib} memcpy x64"] = _timed(runs, repeats, load)
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mib", default="16,128,512")
    ap.add_argument("--busy", default="sleep,matmul")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--depth", type=int, default=4,
                    help="kernels the busy process queues between two waits for the GPU (its idle gaps)")
    ap.add_argument("--same-process", action="store_true",
                    help="also with the busy kernels queued by the copying process itself, on a stream of its own")
    ap.add_argument("--mps", action="store_true",
                    help="every process of the run a client of a private MPS server (benchmarks/mps.py)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-results"))
    args = ap.parse_args()
    run_under_mps(args.mps, run, args)


def run(args: argparse.Namespace) -> None:
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    ctx = mp.get_context("spawn")
    results = {"idle": copies(sizes, args.repeats)}
    for kind in args.busy.split(","):
        ready, stop = ctx.Event(), ctx.Event()
        proc = ctx.Process(target=_busy, args=(kind, args.depth, ready, stop), daemon=True)
        proc.start()
        if not ready.wait(120):
            raise SystemExit(f"the {kind} process did not start")
        time.sleep(0.2)
        try:
            results[kind] = copies(sizes, args.repeats)
        finally:
            stop.set()
            proc.join(30)
        if args.same_process:  # the busy kernels in the copying process, on another stream
            results[f"{kind}, same process"] = copies(sizes, args.repeats, _Load(kind, args.depth))
    conditions = list(results)
    print("| copy | MiB | " + " | ".join(f"{c} ms" for c in conditions) + " |")
    print("|---|---:|" + "---:|" * len(conditions))
    for key in results["idle"]:
        mib, method = key.split(" ", 1)
        print(f"| {method} | {mib} | " + " | ".join(f"{results[c][key] * 1e3:.3f}" for c in conditions) + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_overlap.json").write_text(json.dumps(
        {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "repeats": args.repeats, "row_bytes": ROW, "mps": args.mps,
         "seconds": results}, indent=2))


if __name__ == "__main__":
    main()
