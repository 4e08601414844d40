"""GPU push on one GPU or across two: the daemon path side by side with its anchors, in one run.

For 1 to 4096 blocks of vLLM-shaped KV (32 layers, FlashAttention layout, 16 tokens x 8 KV
heads x 128 dim bf16: 32 KiB per layer half, 2 MiB per block), with P's and D's block ids
contiguous (a fresh prefill) and scattered (a long-running engine):

* **daemon push**: two ``pushsvc serve --gpu on`` daemons and two worker processes holding
  the KV (``tests/gpu/kvproc.py``, the connector's worker role). Timed from P's worker
  handing ``SendReady`` to its daemon (D's registration already at P) until D's worker
  sees ``RecvDone``: the WRITE into D's landing buffer, in parts, and the copies into D's
  KV included. The exposed copy is read off D's ``pushsvc_landing_exposed_seconds``.
* **same-host push** (``ipc_push = "auto"``): the same daemons and workers, but P's daemon
  maps D's worker KV and copies each request's blocks into it with one kernel (no NIXL
  WRITE, no landing copy; docs/gpu.md, "Same-host push"). Timed the same way.
* **in-process NIXL**: two processes owning the same KV shapes (``cudaMalloc``), one NIXL
  agent each, one WRITE of the same block pairs, timed from the post until the target
  saw the notification (``gpu_anchors.py``).
* **torch copy**: one device-to-device copy of the same bytes, for scale (``gpu_anchors.py``).

Plus the small-request latency (1 block x 32 layers, worker message to ``RecvDone``), and
streams (``--stream``): requests of contiguous blocks pushed back to back on each path,
against as many in-process WRITEs posted back to back and one torch copy of all the bytes.
P's side (its worker, the anchors' initiator, the copy's source) is on GPU ``--p-gpu``, D's
on ``--d-gpu``; by default 0 and, where two GPUs are visible, 1 (``gpuprocs.gpu_for``).
Writes ``gpu_push.json`` and ``gpu_push.png`` and prints a table (docs/benchmarks.md).

    python benchmarks/gpu_push.py [--blocks 1,4,16,64,256,1024,4096] [--repeats 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from daemon_readings import PHASES, hist, hot_passes, phases, timeline_medians
from mps import run_under_mps
from procstats import CpuMeter

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "connector"), str(ROOT / "tests" / "gpu"), str(ROOT / "tests" / "integration")]

from gpu_anchors import BLOCK_BYTES, BLOCK_SIZE, DIM, HEADS, LAYERS, block_sets, nixl_anchor, torch_copy  # noqa: E402

# ---------------------------------------------------------------- daemon push


class _Proc:
    """A kvproc worker driven asynchronously: commands out, replies read when wanted."""

    def __init__(self, daemon, role: str, blocks: int, seed: int, layerwise: bool = False) -> None:
        from gpuprocs import GpuWorker  # tests/gpu

        self.w = GpuWorker(daemon, role, layout="flash", layers=LAYERS, blocks=blocks, seed=seed,
                           layerwise=int(layerwise))

    def send(self, op: str, **kw) -> None:
        self.w.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.w.proc.stdin.flush()

    def reply(self) -> dict:
        out = self.w._read()
        if not out.get("ok"):
            raise RuntimeError(out.get("error"))
        return out

    def call(self, op: str, **kw) -> dict:
        self.send(op, **kw)
        return self.reply()


def _registered(p_daemon, d: "_Proc", rid: str, d_ids: list[int]) -> None:
    """D's worker registers ``rid`` into ``d_ids``; once P's daemon has the registration,
    D's worker waits for it (polling from then on, its reply read by the caller)."""
    _registered_all(p_daemon, d, {rid: d_ids})


def _registered_all(p_daemon, d: "_Proc", requests: dict[str, list[int]]) -> None:
    """``_registered`` for several requests, registered in one step of D's worker."""
    regs = p_daemon.metric("pushsvc_notifications_total", kind="push_reg")
    d.call("recv", p_engine="prefill", p_port=p_daemon.side_port,
           requests=[{"rid": rid, "blocks": ids} for rid, ids in requests.items()])
    deadline = time.monotonic() + 10
    while p_daemon.metric("pushsvc_notifications_total", kind="push_reg") < regs + len(requests):
        if time.monotonic() > deadline:
            raise RuntimeError("D's registrations never reached P")
        time.sleep(0.001)
    d.send("wait", rids=list(requests), timeout=60, spin=True)
    time.sleep(0.002)


def _ipc_ready(d_daemon, timeout: float = 20.0) -> None:
    """Wait until P told D's daemon it mapped D's worker KV (same-host push from then on)."""
    deadline = time.monotonic() + timeout
    while not any(p["ipc_ready"] for p in d_daemon.live_info()["peers"]):
        if time.monotonic() > deadline:
            raise RuntimeError("P never mapped D's KV (same-host push)")
        time.sleep(0.01)


def daemon_push(sizes: list[int], total_blocks: int, patterns: list[str], repeats: int, small_reps: int,
                log_level: str = "warning", part_mib: int | None = None, staging_mib: int = 0,
                ucx_mode: str = "peer", sgl: bool = False, ipc: bool = False, hot_yield: str = "on",
                spin_s: float = 0.0, stream: tuple[int, list[int]] = (0, [])) -> dict:
    """One push at a time of each size and pattern, then the small request; then, for
    ``stream = (k, sizes)``, ``k`` requests of contiguous blocks (request i: blocks
    ``[i * n, (i + 1) * n)`` on both sides) registered in one step of D's worker and
    finished in one step of P's, timed from P's worker's step until D's worker saw the
    last ``RecvDone``: what the daemons move while requests follow each other, with each
    one's fixed hops overlapping the others' bytes."""
    from procs import start_daemon

    base = Path(tempfile.mkdtemp(prefix="psbench-gpu-"))
    landing_mib = (total_blocks * BLOCK_BYTES >> 20) + 64
    parts = ("--write-part-mib", str(part_mib)) if part_mib is not None else ()
    if staging_mib:
        parts += ("--staging-mib", str(staging_mib))
    mode = ("--ucx-error-handling-mode", ucx_mode, "--ucx-sgl", "on" if sgl else "off", "--ipc-push",
            "auto" if ipc else "off", "--poll-hot-yield", hot_yield, "--poll-spin-s", str(spin_s))
    p_daemon = start_daemon(base, "prefill", "--gpu", "on", "--log-level", log_level, *parts, *mode, timeout=120)
    d_daemon = start_daemon(base, "decode", "--gpu", "on", "--log-level", log_level, "--landing-mib",
                            str(landing_mib), *mode, timeout=120)
    p = _Proc(p_daemon, "producer", total_blocks, 1)
    d = _Proc(d_daemon, "consumer", total_blocks, 2)
    out: dict = {"push": {}, "exposed": {}, "parts": {}, "timelines": {}, "stream": {}}
    seq = 0
    meter = CpuMeter({"P": p_daemon.proc.pid, "D": d_daemon.proc.pid})
    started, cpu0 = time.monotonic(), meter.snapshot()

    def one(n: int, p_ids: list[int], d_ids: list[int]) -> tuple[float, float]:
        nonlocal seq
        rid = f"b{seq}"
        seq += 1
        _registered(p_daemon, d, rid, d_ids)
        t0 = p.call("send", requests=[{"rid": rid, "blocks": p_ids}])["t"]
        got = d.reply()
        p.call("wait", rids=[rid], timeout=60)
        fin = got["finished"][rid]
        if fin["errors"]:
            raise RuntimeError(f"{rid}: load failed")
        return fin["t"] - t0, t0

    if ipc:  # the first push makes the daemons meet (over NIXL); P maps D's KV then
        one(1, [0], [0])
        _ipc_ready(d_daemon)
    for pattern in patterns:
        for n in sizes:
            p_ids, d_ids = block_sets(n, total_blocks, pattern, n + 7)
            exp0, parts0 = hist(d_daemon, "pushsvc_landing_exposed_seconds"), p_daemon.metric(
                "pushsvc_write_parts_total")
            one(n, p_ids, d_ids)  # warm-up
            exp0, parts0 = hist(d_daemon, "pushsvc_landing_exposed_seconds"), p_daemon.metric(
                "pushsvc_write_parts_total")
            first = seq
            times = [one(n, p_ids, d_ids)[0] for _ in range(repeats)]
            exp1, parts1 = hist(d_daemon, "pushsvc_landing_exposed_seconds"), p_daemon.metric(
                "pushsvc_write_parts_total")
            out["push"][(pattern, n)] = statistics.median(times)
            out["exposed"][(pattern, n)] = (exp1[0] - exp0[0]) / max(1.0, exp1[1] - exp0[1])
            out["parts"][(pattern, n)] = (parts1 - parts0) / repeats
            print(f"  {'same-host push' if ipc else 'daemon push':15s} {pattern:10s} {n:5d} blocks: {out['push'][(pattern, n)] * 1e3:8.3f} ms "
                  f"(exposed copy {out['exposed'][(pattern, n)] * 1e3:.3f} ms, "
                  f"{out['parts'][(pattern, n)]:.0f} parts)", flush=True)
            if n >= 64:  # where a large push's time goes: every event of both timelines
                spread = timeline_medians(p_daemon, d_daemon, [f"b{i}" for i in range(first, seq)])
                out["timelines"][f"{pattern} {n}"] = spread
                print("    " + ", ".join(f"{k} {v:.2f}" for k, v in spread.items()), flush=True)
    first_small = seq
    small = [one(1, [5], [9])[0] for _ in range(small_reps)]
    out["small_rids"] = [f"b{i}" for i in range(first_small, seq)]
    out["small"] = {"p50_ms": float(np.percentile(small, 50) * 1e3), "p90_ms": float(np.percentile(small, 90) * 1e3),
                    "p99_ms": float(np.percentile(small, 99) * 1e3), "n": len(small)}
    out["small_timeline_ms"] = timeline_medians(p_daemon, d_daemon, out["small_rids"])
    k, stream_sizes = stream
    for n in stream_sizes:
        times = []
        for rep in range(repeats + 1):  # the first is a warm-up
            reqs = {f"s{n}-{rep}.{i}": list(range(i * n, (i + 1) * n)) for i in range(k)}
            _registered_all(p_daemon, d, reqs)
            t0 = p.call("send", requests=[{"rid": rid, "blocks": ids} for rid, ids in reqs.items()])["t"]
            got = d.reply()
            p.call("wait", rids=list(reqs), timeout=60)
            if got["missing"] or any(f["errors"] for f in got["finished"].values()):
                raise RuntimeError(f"stream of {k} x {n}: load failed or missing ({got['missing']})")
            if rep:
                times.append(max(f["t"] for f in got["finished"].values()) - t0)
        out["stream"][n] = statistics.median(times)
        print(f"  {'same-host push' if ipc else 'daemon push':15s} stream {k} x {n:5d} blocks: "
              f"{out['stream'][n] * 1e3:8.3f} ms", flush=True)
    out["hot_passes"] = {"P": hot_passes(p_daemon), "D": hot_passes(d_daemon)}
    print("  hot progress passes (all, over 0.5 ms, over 2.5 ms): " + "; ".join(
        f"{side} {v['passes']:.0f}, {v['over_0.5ms']:.0f}, {v['over_2.5ms']:.0f}" for side, v in out["hot_passes"].items()),
        flush=True)
    wall, used = time.monotonic() - started, CpuMeter.delta(cpu0, meter.snapshot())
    out["daemon_cpu"] = {side: {"cpu_s": used.get(f"{side}/root", 0.0), "wall_s": wall,
                                "spun_s": daemon.metric("pushsvc_progress_spin_seconds_total")}
                         for side, daemon in (("P", p_daemon), ("D", d_daemon))}
    print("  daemons' CPU over the run: " + "; ".join(
        f"{side} {v['cpu_s']:.2f} s of {v['wall_s']:.2f} s (spun {v['spun_s']:.2f} s)"
        for side, v in out["daemon_cpu"].items()), flush=True)
    out["daemon_info"] = {"prefill": p_daemon.live_info(), "decode": d_daemon.live_info()}
    out["ipc_copies"] = p_daemon.metric("pushsvc_ipc_copies_total")
    if log_level == "debug":
        out["phases"] = phases(p_daemon.log(), d_daemon.log())
    for w in (p, d):
        w.w.close()
    for daemon in (p_daemon, d_daemon):
        daemon.stop()
    return out


def layerwise_compare(sizes: list[int], total_blocks: int, repeats: int, sleep_cycles: int,
                      paths: tuple[str, ...] = ("landing", "same_host"), spin_s: float = 0.0,
                      batch: int = 1) -> dict:
    """P's worker runs a forward pass of 32 layers (each keeps the GPU busy
    ``sleep_cycles``, then writes its layer's KV of the requests' blocks) that ends the
    prefill of ``batch`` requests of each size; D's worker waits for their KV. Whole-request
    push: the pass, then ``SendReady`` for each. Layer-wise push: ``SendStart`` before the
    pass; each layer of each request is posted into D's landing buffer, or copied into a
    same-host D's KV (``ipc_push``), once its event is done. Timed on the host's clock from
    the GPU finishing the pass to D's worker seeing the last of the batch's ``RecvDone``:
    what of the transfer is left after the prefill. Keys: (mode, path, blocks), and (mode,
    path, "parts"), (mode, path, "copies") and (mode, path, "p_cpu_s"): P's daemon's CPU
    time over the run, warm-ups included."""
    from procs import start_daemon

    out: dict = {}
    landing_mib = (total_blocks * BLOCK_BYTES >> 20) + 64
    for path in paths:
        ipc = "auto" if path == "same_host" else "off"
        for mode in ("whole", "layerwise"):
            base = Path(tempfile.mkdtemp(prefix=f"psbench-gpu-{mode}-"))
            common = ("--gpu", "on", "--ipc-push", ipc, "--poll-spin-s", str(spin_s))
            p_daemon = start_daemon(base, "prefill", *common, timeout=120)
            d_daemon = start_daemon(base, "decode", *common, "--landing-mib", str(landing_mib), timeout=120)
            p = _Proc(p_daemon, "producer", total_blocks, 1, layerwise=mode == "layerwise")
            d = _Proc(d_daemon, "consumer", total_blocks, 2)
            seq = 0
            meter = CpuMeter({"P": p_daemon.proc.pid})
            cpu0 = meter.snapshot()
            try:
                for n in sizes:
                    after = []
                    for rep in range(repeats + 1):
                        seq += 1
                        # Request i of the batch: blocks [i * n, (i + 1) * n) on both sides.
                        reqs = {f"{mode}-{n}-{rep}" + (f".{i}" if batch > 1 else ""): list(range(i * n, (i + 1) * n))
                                for i in range(batch)}
                        _registered_all(p_daemon, d, reqs)
                        sends = [{"rid": rid, "blocks": ids} for rid, ids in reqs.items()]
                        pass_args = {"seed": 100 + seq, "sleep_cycles": sleep_cycles}
                        if mode == "layerwise":
                            done = p.call("forward", requests=sends, step=seq, sync=True, **pass_args)["t"]
                        else:
                            done = p.call("compute", blocks=[b for ids in reqs.values() for b in ids],
                                          **pass_args)["t"]
                            p.call("send", requests=sends)
                        got = d.reply()
                        if got["missing"] or any(f["errors"] for f in got["finished"].values()):
                            raise RuntimeError(f"{list(reqs)}: load failed or missing ({got['missing']})")
                        if mode == "layerwise":
                            p.call("finished", rids=list(reqs))
                        p.call("wait", rids=list(reqs), timeout=60)
                        if rep:  # the first is a warm-up (and, same-host, the push that makes P map D's KV)
                            after.append(max(f["t"] for f in got["finished"].values()) - done)
                    out[(mode, path, n)] = statistics.median(after)
                    print(f"  {path:9s} {mode:9s} {n:5d} blocks: RecvDone {out[(mode, path, n)] * 1e3:8.3f} ms "
                          f"after the pass's end (p90 {np.percentile(after, 90) * 1e3:.3f})", flush=True)
                    if mode == "layerwise":  # what follows P's last layer seen final, in both daemons
                        rids = [f"{mode}-{n}-{rep}" + (f".{i}" if batch > 1 else "")
                                for rep in range(1, repeats + 1) for i in range(batch)]
                        spread = timeline_medians(p_daemon, d_daemon, rids, origin="P prefill_done")
                        out[(mode, path, n, "timeline")] = spread
                        print("    " + ", ".join(f"{k} {v:.3f}" for k, v in spread.items() if v >= 0), flush=True)
                out[(mode, path, "parts")] = p_daemon.metric("pushsvc_write_parts_total")
                out[(mode, path, "copies")] = p_daemon.metric("pushsvc_ipc_copies_total")
                out[(mode, path, "p_cpu_s")] = CpuMeter.delta(cpu0, meter.snapshot()).get("P/root", 0.0)
                print(f"  {path:9s} {mode:9s} P's daemon: {out[(mode, path, 'p_cpu_s')]:.2f} s of CPU over "
                      f"{seq} pushes", flush=True)
            finally:
                for w in (p, d):
                    w.w.close()
                for daemon in (p_daemon, d_daemon):
                    daemon.stop()
    return out


# ---------------------------------------------------------------- report


def _chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, pattern in zip(axes, ("contiguous", "scattered")):
        sub = [r for r in rows if r["pattern"] == pattern]
        if not sub:
            continue
        blocks = [r["blocks"] for r in sub]
        for key, label in (("daemon_gb_s", "daemon push, NIXL + landing (incl. D copy)"),
                           ("ipc_gb_s", "daemon push, same host (P's copy)"), ("nixl_gb_s", "in-process NIXL WRITE"),
                           ("torch_gb_s", "torch device copy")):
            if all(key in r for r in sub):
                ax.plot(blocks, [r[key] for r in sub], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{pattern} block ids")
        ax.set_xlabel("blocks (2 MiB each: 32 layers x K,V x 32 KiB)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", default="1,4,16,64,256,1024,4096")
    ap.add_argument("--patterns", default="contiguous,scattered")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--small", type=int, default=50)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-results"))
    ap.add_argument("--part-mib", type=int, default=None,
                    help="P's write_part_mib (default: the daemon's own default)")
    ap.add_argument("--staging-mib", type=int, default=0,
                    help="P's staging_mib: P copies blocks into its own buffer and WRITEs from there")
    ap.add_argument("--ucx-error-handling-mode", default="peer", choices=["peer", "none"],
                    help="the daemons' and the in-process anchor's UCX error handling (docs/architecture.md)")
    ap.add_argument("--ucx-sgl", default="off", choices=["on", "off"],
                    help="the daemons' ucx_sgl and the in-process anchor's alike (docs/gpu.md)")
    ap.add_argument("--poll-hot-yield", default="on", choices=["on", "off"],
                    help="the daemons' poll_hot_yield (docs/architecture.md, \"Two hot loops on one CPU\")")
    ap.add_argument("--poll-spin-s", type=float, default=0.0,
                    help="the daemons' poll_spin_s: busy polling while requests wait (docs/architecture.md)")
    ap.add_argument("--phases", action="store_true",
                    help="daemon push only, daemons logging at debug: where each push's time goes")
    ap.add_argument("--layerwise", action="store_true",
                    help="only whole-request against layer-wise push after a simulated forward pass")
    ap.add_argument("--batch", type=int, default=1,
                    help="--layerwise: requests of each size whose prefill one forward pass ends")
    ap.add_argument("--layer-cycles", type=int, default=2_000_000,
                    help="--layerwise: GPU cycles each layer is kept busy (~1 ms at 2 GHz)")
    ap.add_argument("--ipc", default="both", choices=["both", "off", "only"],
                    help="both: the daemon push over NIXL into D's landing buffer and the same-host push "
                         "(ipc_push), side by side (with --layerwise too); off: only the former; only: "
                         "only the latter (--layerwise)")
    ap.add_argument("--stream", type=int, default=8,
                    help="requests per stream: pushed back to back, in one step of each worker (0: no stream)")
    ap.add_argument("--stream-blocks", default="16,64,256,512",
                    help="blocks per request of the streams (contiguous ids)")
    ap.add_argument("--p-gpu", type=int, default=None, help="P's GPU (default 0)")
    ap.add_argument("--d-gpu", type=int, default=None, help="D's GPU (default 1 where two are visible, else 0)")
    ap.add_argument("--mps", action="store_true",
                    help="the daemons, the workers and the anchors as clients of a private MPS server "
                         "(benchmarks/mps.py: lets the processes' kernels share the GPU)")
    args = ap.parse_args()
    if args.ipc == "only" and not args.layerwise:
        ap.error("--ipc only goes with --layerwise (the whole-request figures compare both paths to NIXL)")
    run_under_mps(args.mps, run, args)


def run(args: argparse.Namespace) -> None:
    from gpuprocs import gpu_for  # tests/gpu

    for name, value in (("PUSHSVC_P_GPU", args.p_gpu), ("PUSHSVC_D_GPU", args.d_gpu)):
        if value is not None:
            os.environ[name] = str(value)  # the worker processes read it too
    p_gpu, d_gpu = gpu_for("producer"), gpu_for("consumer")
    print(f"P on cuda:{p_gpu}, D on cuda:{d_gpu}", flush=True)
    sizes = [int(b) for b in args.blocks.split(",")]
    patterns = args.patterns.split(",")
    stream = (args.stream, [int(b) for b in args.stream_blocks.split(",")] if args.stream > 0 else [])
    total = max([max(sizes) * (args.batch if args.layerwise else 1)]
                + [args.stream * n for n in stream[1] if not args.layerwise]) + 256
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.layerwise:
        paths = {"both": ("landing", "same_host"), "off": ("landing",), "only": ("same_host",)}[args.ipc]
        got = layerwise_compare(sizes, total, args.repeats, args.layer_cycles, paths, args.poll_spin_s, args.batch)
        cols = {f"{path}_{mode}": (mode, path) for path in paths for mode in ("whole", "layerwise")}
        rows = [{"blocks": n, "mib": n * BLOCK_BYTES >> 20,
                 **{f"{col}_ms": got[(*key, n)] * 1e3 for col, key in cols.items()}} for n in sizes]
        print(f"\nRecvDone after the pass's end, ms (medians; the last of {args.batch} per pass)")
        print("| blocks | MiB | " + " | ".join(f"{path.replace('_', '-')}, {mode}" for mode, path in cols.values())
              + " |")
        print("|---:|---:|" + "---:|" * len(cols))
        for r in rows:
            print(f"| {r['blocks']} | {r['mib']} | " + " | ".join(f"{r[f'{col}_ms']:.3f}" for col in cols) + " |")
        (out_dir / "gpu_layerwise.json").write_text(json.dumps(
            {"layer_cycles": args.layer_cycles, "repeats": args.repeats, "poll_spin_s": args.poll_spin_s, "mps": args.mps,
             "batch": args.batch,
             "rows": rows, "write_parts": {col: got[(*key, "parts")] for col, key in cols.items()},
             "ipc_copies": {col: got[(*key, "copies")] for col, key in cols.items()},
             "p_daemon_cpu_s": {col: got[(*key, "p_cpu_s")] for col, key in cols.items()},
             "timelines_after_prefill_done_ms": {f"{path} {n}": got[("layerwise", path, n, "timeline")]
                                                 for path in paths for n in sizes}}, indent=2))
        return
    if args.phases:
        push = daemon_push(sizes, total, patterns, args.repeats, args.small, log_level="debug",
                           part_mib=args.part_mib, staging_mib=args.staging_mib,
                           ucx_mode=args.ucx_error_handling_mode, sgl=args.ucx_sgl == "on",
                           hot_yield=args.poll_hot_yield, spin_s=args.poll_spin_s)
        (out_dir / "gpu_phases.json").write_text(json.dumps(push["phases"], indent=2))
        for rid, ev in list(push["phases"].items())[:: max(1, len(push["phases"]) // 40)]:
            print(rid, " ".join(f"{k}={v}" for k, v in sorted(ev.items(), key=lambda kv: kv[1])))
        small = [push["phases"][r] for r in push["small_rids"] if r in push["phases"]]
        print(f"small request, median ms after P's send_ready over {len(small)}:")
        for _, event in PHASES:
            got = [ev[event] for ev in small if event in ev]
            if got:
                print(f"  {event:16s} {statistics.median(got):7.3f}")
        return
    print("torch copy ...", flush=True)
    copy = torch_copy(sizes, args.repeats, p_gpu, d_gpu)
    stream_copy = torch_copy([stream[0] * n for n in stream[1]], args.repeats, p_gpu, d_gpu) if stream[1] else {}
    print("in-process NIXL ...", flush=True)
    anchor = nixl_anchor(sizes, total, patterns, args.repeats, args.ucx_error_handling_mode, args.ucx_sgl == "on",
                         p_gpu, d_gpu, stream)
    print("daemon push ...", flush=True)
    push = daemon_push(sizes, total, patterns, args.repeats, args.small, part_mib=args.part_mib,
                       staging_mib=args.staging_mib, ucx_mode=args.ucx_error_handling_mode,
                       sgl=args.ucx_sgl == "on", hot_yield=args.poll_hot_yield, spin_s=args.poll_spin_s,
                       stream=stream)
    same_host = None
    if args.ipc == "both":
        print("same-host push ...", flush=True)
        same_host = daemon_push(sizes, total, patterns, args.repeats, args.small, ucx_mode=args.ucx_error_handling_mode,
                                hot_yield=args.poll_hot_yield, ipc=True, spin_s=args.poll_spin_s, stream=stream)
    rows = []
    for pattern in patterns:
        for n in sizes:
            nbytes = n * BLOCK_BYTES
            d, a, c = push["push"][(pattern, n)], anchor[(pattern, n)], copy[n]
            rows.append({"pattern": pattern, "blocks": n, "bytes": nbytes, "daemon_s": d, "nixl_s": a, "torch_s": c,
                         "daemon_gb_s": nbytes / d / 1e9, "nixl_gb_s": nbytes / a / 1e9, "torch_gb_s": nbytes / c / 1e9,
                         "daemon_vs_nixl": a / d, "exposed_copy_s": push["exposed"][(pattern, n)],
                         "exposed_share": push["exposed"][(pattern, n)] / d, "parts": push["parts"][(pattern, n)]})
            if same_host is not None:
                i = same_host["push"][(pattern, n)]
                rows[-1].update(ipc_s=i, ipc_gb_s=nbytes / i / 1e9, ipc_vs_nixl=a / i, ipc_vs_torch=c / i)
    result = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows, "small_request": push["small"],
              "small_timeline_ms": push["small_timeline_ms"], "part_timelines_ms": push["timelines"],
              "layout": {"layers": LAYERS, "block_size": BLOCK_SIZE, "kv_heads": HEADS, "head_dim": DIM,
                         "dtype": "bfloat16", "block_bytes": BLOCK_BYTES},
              "daemon_info": push["daemon_info"], "write_part_mib": args.part_mib,
              "staging_mib": args.staging_mib, "ucx_sgl": args.ucx_sgl,
              "poll_hot_yield": args.poll_hot_yield, "poll_spin_s": args.poll_spin_s, "daemon_cpu": push["daemon_cpu"],
              "p_gpu": p_gpu, "d_gpu": d_gpu, "mps": args.mps}
    k = stream[0]
    stream_rows = []
    for n in stream[1]:
        nbytes, a = k * n * BLOCK_BYTES, anchor[("stream", n)]
        row = {"requests": k, "blocks": n, "bytes": nbytes, "nixl_s": a, "nixl_gb_s": nbytes / a / 1e9,
               "daemon_s": push["stream"][n], "daemon_gb_s": nbytes / push["stream"][n] / 1e9,
               "daemon_vs_nixl": a / push["stream"][n], "torch_gb_s": nbytes / stream_copy[k * n] / 1e9}
        if same_host is not None:
            i = same_host["stream"][n]
            row.update(ipc_s=i, ipc_gb_s=nbytes / i / 1e9, ipc_vs_nixl=a / i)
        stream_rows.append(row)
    result["stream_rows"] = stream_rows
    if same_host is not None:
        result.update(same_host_small_request=same_host["small"], same_host_small_timeline_ms=same_host[
            "small_timeline_ms"], same_host_copies=same_host["ipc_copies"], same_host_daemon_cpu=same_host["daemon_cpu"])
    (out_dir / "gpu_push.json").write_text(json.dumps(result, indent=2))
    _chart(rows, out_dir / "gpu_push.png")
    print("\n| ids | blocks | MiB | daemon push GB/s | in-process NIXL GB/s | daemon / NIXL | torch copy GB/s "
          "| exposed copy | parts |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['pattern']} | {r['blocks']} | {r['bytes'] >> 20} | {r['daemon_gb_s']:.1f} | {r['nixl_gb_s']:.1f} "
              f"| {r['daemon_vs_nixl'] * 100:.0f}% | {r['torch_gb_s']:.0f} | {r['exposed_share'] * 100:.1f}% "
              f"({r['exposed_copy_s'] * 1e3:.3f} ms) | {r['parts']:.0f} |")
    if same_host is not None:
        print(f"\nsame-host push (P's copy into D's KV; {same_host['ipc_copies']:.0f} requests copied so):")
        print("| ids | blocks | MiB | same-host push GB/s | in-process NIXL GB/s | same-host / NIXL | torch copy GB/s "
              "| same-host / torch |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['pattern']} | {r['blocks']} | {r['bytes'] >> 20} | {r['ipc_gb_s']:.1f} | {r['nixl_gb_s']:.1f} "
                  f"| {r['ipc_vs_nixl'] * 100:.0f}% | {r['torch_gb_s']:.0f} | {r['ipc_vs_torch'] * 100:.0f}% |")
    if stream_rows:
        print(f"\nstreams: {k} requests pushed back to back (one step of each worker), first step to last RecvDone; "
              "in-process: as many WRITEs posted back to back, first post to the last notification seen")
        print("| blocks per request | MiB in all | in-process NIXL GB/s | daemon push GB/s | daemon / NIXL "
              "| same-host push GB/s | same-host / NIXL | torch copy GB/s |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in stream_rows:
            same = (f"{r['ipc_gb_s']:.1f} | {r['ipc_vs_nixl'] * 100:.0f}%" if "ipc_gb_s" in r else "- | -")
            print(f"| {r['blocks']} | {r['bytes'] >> 20} | {r['nixl_gb_s']:.1f} | {r['daemon_gb_s']:.1f} "
                  f"| {r['daemon_vs_nixl'] * 100:.0f}% | {same} | {r['torch_gb_s']:.0f} |")
    for name, run in (("daemon push", push), ("same-host push", same_host)):
        if run is None:
            continue
        s = run["small"]
        print(f"\n{name}, small request (1 block x 32 layers): SendReady -> RecvDone p50 {s['p50_ms']:.3f} ms, "
              f"p90 {s['p90_ms']:.3f} ms, p99 {s['p99_ms']:.3f} ms over {s['n']}")
        print("  where it goes (daemons' request timelines, median ms after P's send_ready):")
        for event, ms in run["small_timeline_ms"].items():
            print(f"    {event:22s} {ms:7.3f}")


if __name__ == "__main__":
    main()
