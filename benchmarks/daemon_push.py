"""Daemon push, side by side with the in-process NIXL baseline, plus the control-path
figures: idle daemon CPU, worker message round trip, idle ``poll()`` cost.

    python benchmarks/daemon_push.py [--sizes 1M,16M,256M] [--block-len 64K] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

sys.path.insert(0, os.path.dirname(__file__))
import nixl_pair  # noqa: E402

from pushsvc.client import DaemonClient  # noqa: E402
from pushsvc.protocol import worker as wp  # noqa: E402
from pushsvc.shm import SharedBuffer  # noqa: E402


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


class Daemon:
    def __init__(self, base: str, name: str) -> None:
        rt = os.path.join(base, name)
        os.makedirs(rt)
        ready = os.path.join(rt, "ready.json")
        with open(os.path.join(rt, "log"), "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pushsvc", "serve", "--engine-id", name, "--runtime-dir", rt,
                 "--health-port", "0", "--side-channel-port", "0", "--ready-file", ready, "--log-format", "json",
                 "--log-level", os.environ.get("BENCH_LOG_LEVEL", "warning")], stdout=log, stderr=subprocess.STDOUT)
        while not os.path.exists(ready):
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon {name} failed; see {rt}/log")
            time.sleep(0.02)
        with open(ready) as f:
            self.info = json.load(f)
        self.name = name

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(20)


def _worker(d: Daemon, role: str, total: int, block_len: int):
    c = DaemonClient(d.info["socket_path"], engine_id=d.name, rank=0, tp_size=1, role=role)
    c.connect()
    buf = SharedBuffer.create(total)
    c.register_kv([buf.fd], [wp.Region(buffer=0, offset=0, block_len=block_len, num_blocks=total // block_len)])
    return c, buf


def _wait(clients, rid: str) -> None:
    # Block in select() like an engine between steps would, instead of spinning: on a
    # 2-core host a spinning client would steal the core a daemon needs.
    pending = set(range(len(clients)))
    while pending:
        select.select([clients[i] for i in pending], [], [], 1.0)
        for i in list(pending):
            if any(getattr(e, "request_id", None) == rid for e in clients[i].poll()):
                pending.discard(i)


def run(sizes: list[int], block_len: int, repeats: int) -> dict:
    base = tempfile.mkdtemp(prefix="psbench-")
    P, D = Daemon(base, "prefill"), Daemon(base, "decode")
    try:
        total = max(sizes)
        pc, pbuf = _worker(P, "producer", total, block_len)
        dc, dbuf = _worker(D, "consumer", total, block_len)
        rows = []
        seq = 0
        for size in sizes:
            n = size // block_len
            ids = list(range(n))
            times = []
            for rep in range(repeats + 1):
                seq += 1
                rid = f"bench-{seq}"
                dc.send(wp.RegisterRecv(request_id=rid, local_block_ids=[ids], remote_engine_id="prefill",
                                        remote_host="127.0.0.1", remote_port=P.info["side_channel_port"]))
                _wait_registered = time.perf_counter()
                time.sleep(0.005)  # the registration reaches P first, as when prefill takes longer
                t0 = time.perf_counter()
                pc.send(wp.SendReady(request_id=rid, block_ids=[ids]))
                _wait([pc, dc], rid)
                if rep:
                    times.append(time.perf_counter() - t0)
            rows.append({"size": size, "blocks": n, "block_len": block_len, "push_s": statistics.median(times)})
        # Control path: round trip of a worker message, idle poll cost, idle CPU.
        n = 2000
        t0 = time.perf_counter()
        for i in range(n):
            pc.send(wp.Ping(token=i))
            while not any(isinstance(e, wp.Pong) for e in pc.poll()):
                pass
        rtt_us = (time.perf_counter() - t0) / n * 1e6
        n = 200000
        t0 = time.perf_counter()
        for _ in range(n):
            pc.poll()
        poll_us = (time.perf_counter() - t0) / n * 1e6
        procs = [psutil.Process(P.proc.pid), psutil.Process(D.proc.pid)]
        time.sleep(1.0)
        before = [sum(p.cpu_times()[:2]) for p in procs]
        window = 10.0
        time.sleep(window)
        idle = [(sum(p.cpu_times()[:2]) - b) / window * 100 for p, b in zip(procs, before)]
        pc.close(), dc.close()
        return {"push": rows, "rtt_us": rtt_us, "idle_poll_us": poll_us, "idle_cpu_percent": idle}
    finally:
        P.stop()
        D.stop()
        shutil.rmtree(base, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64K,1M,16M,64M,256M")
    ap.add_argument("--block-len", default="64K")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    sizes = [_size(s) for s in args.sizes.split(",")]
    block_len = _size(args.block_len)
    base = {r["size"]: r for r in nixl_pair.run(sizes, block_len, args.repeats)}
    res = run(sizes, block_len, args.repeats)
    print(f"{'size':>10} {'blocks':>7} {'in-process ms':>14} {'GB/s':>7} {'daemon ms':>10} {'GB/s':>7} {'ratio':>6}")
    for r in res["push"]:
        b = base[r["size"]]
        gbs_b = r["size"] / b["notified_s"] / 1e9
        gbs_d = r["size"] / r["push_s"] / 1e9
        r.update(inproc_s=b["notified_s"], inproc_write_s=b["write_s"])
        print(f"{r['size'] / 2**20:>9.2f}M {r['blocks']:>7} {b['notified_s'] * 1e3:>14.3f} {gbs_b:>7.2f} "
              f"{r['push_s'] * 1e3:>10.3f} {gbs_d:>7.2f} {gbs_d / gbs_b:>6.2f}")
    print(f"worker message round trip: {res['rtt_us']:.1f} us; idle poll(): {res['idle_poll_us']:.2f} us")
    print(f"idle daemon CPU (10 s, one worker registered): P {res['idle_cpu_percent'][0]:.2f}% "
          f"D {res['idle_cpu_percent'][1]:.2f}% of a core")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
