"""Daemon push, side by side with the in-process NIXL baseline, plus the control-path
figures: idle daemon CPU, worker message round trip, per-request control overhead, idle
``poll()`` cost.

A push is timed from the P worker's ``SendReady`` (D's registration already at P, as when
prefill takes longer than the registration; with a negative ``--gap-ms``, from D's worker's
``RegisterRecv``, P's blocks staged before) until both workers heard of it: ``SendDone``
at P and ``RecvDone`` at D. That is what the engines wait for; the in-process baseline
(``nixl_pair.py``) is timed from the WRITE post until DONE and the notification was seen.

    python benchmarks/daemon_push.py [--sizes 64K,1M,16M,256M] [--block-len 64K] [--gap-ms 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime

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


def _worker(d: Daemon, role: str, total: int, block_len: int, regions: int = 1):
    """A worker client whose KV is ``regions`` regions (a model's layers' K and V): a
    block id spans all of them, ``block_len // regions`` bytes in each."""
    c = DaemonClient(d.info["socket_path"], engine_id=d.name, rank=0, tp_size=1, role=role)
    c.connect()
    buf = SharedBuffer.create(total)
    blocks, part = total // block_len, block_len // regions
    c.register_kv([buf.fd], [wp.Region(buffer=0, offset=r * blocks * part, block_len=part, num_blocks=blocks)
                             for r in range(regions)])
    return c, buf


def _wait(clients, rid: str) -> list[float]:
    """Block until every client has an event for ``rid``; when each arrived."""
    return _wait_all(clients, [rid])


def _wait_all(clients, rids: list[str], timeout: float = 120.0) -> list[float]:
    """Block until every client has an event for each of ``rids``; when each client had
    its last. TimeoutError after ``timeout`` seconds."""
    # Block in select() like an engine between steps would, instead of spinning: on a
    # 2-core host a spinning client would steal the core a daemon needs.
    pending = {i: set(rids) for i in range(len(clients))}
    seen = [0.0] * len(clients)
    deadline = time.monotonic() + timeout
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no event for {sorted(set().union(*pending.values()))} within {timeout} s")
        select.select([clients[i] for i in pending], [], [], 1.0)
        for i in list(pending):
            pending[i] -= {getattr(e, "request_id", None) for e in clients[i].poll()}
            if not pending[i]:
                seen[i] = time.perf_counter()
                del pending[i]
    return seen


class Pair:
    """A P and a D daemon, each with one registered worker client over ``total`` bytes."""

    def __init__(self, total: int, block_len: int, regions: int = 1, gap_s: float = 0.005) -> None:
        self.base = tempfile.mkdtemp(prefix="psbench-")
        self.gap_s = gap_s  # D's registration -> P's SendReady: how long both daemons sit idle first
        self.P = self.D = None
        try:
            self.P = Daemon(self.base, "prefill")
            self.D = Daemon(self.base, "decode")
            self.pc, self.pbuf = _worker(self.P, "producer", total, block_len, regions)
            self.dc, self.dbuf = _worker(self.D, "consumer", total, block_len, regions)
        except BaseException:
            self.close()
            raise
        self.seq = 0
        self._jitter = random.Random(1)

    def start(self, blocks: int) -> tuple[str, float]:
        """Start a push of ``blocks`` blocks: D registers, then, ``gap_s`` later, P's worker
        hands them over (a negative ``gap_s``: the other order, as when D's engine admits the
        request after P's prefill ended). Its request id and the moment of the later of the two."""
        self.seq += 1
        rid = f"bench-{self.seq}"
        ids = list(range(blocks))
        register = wp.RegisterRecv(request_id=rid, local_block_ids=[ids], remote_engine_id="prefill",
                                   remote_host="127.0.0.1", remote_port=self.P.info["side_channel_port"])
        ready = wp.SendReady(request_id=rid, block_ids=[ids])
        if self.gap_s >= 0:
            (first, c1), (second, c2) = (register, self.dc), (ready, self.pc)
        else:
            (first, c1), (second, c2) = (ready, self.pc), (register, self.dc)
        c1.send(first)
        # Both daemons idle meanwhile. P's blocks first: P then polls at its busy pace, and a
        # fixed gap would bring D's registration in step with those passes; it varies +-20%.
        time.sleep(self.gap_s if self.gap_s >= 0 else -self.gap_s * self._jitter.uniform(0.8, 1.2))
        t0 = time.perf_counter()
        c2.send(second)
        return rid, t0

    def push_stream(self, blocks: int, k: int) -> float:
        """``k`` pushes of ``blocks`` blocks each (push i: blocks ``[i * blocks, (i + 1) *
        blocks)`` on both sides) back to back: D registers all, ``gap_s`` later P's worker
        hands all over, one message each. Seconds until both workers heard of the last."""
        pushes = {}  # request id -> its blocks
        for i in range(k):
            self.seq += 1
            pushes[f"bench-{self.seq}"] = ids = list(range(i * blocks, (i + 1) * blocks))
            self.dc.send(wp.RegisterRecv(request_id=f"bench-{self.seq}", local_block_ids=[ids],
                                         remote_engine_id="prefill", remote_host="127.0.0.1",
                                         remote_port=self.P.info["side_channel_port"]))
        time.sleep(abs(self.gap_s))
        t0 = time.perf_counter()
        for rid, ids in pushes.items():
            self.pc.send(wp.SendReady(request_id=rid, block_ids=[ids]))
        return max(_wait_all([self.pc, self.dc], list(pushes))) - t0

    def push(self, blocks: int) -> tuple[float, float, float]:
        """One push of ``blocks`` blocks: seconds until (both, P's SendDone, D's RecvDone)."""
        rid, t0 = self.start(blocks)
        p_done, d_done = _wait([self.pc, self.dc], rid)
        return max(p_done, d_done) - t0, p_done - t0, d_done - t0

    def close(self) -> None:
        for c in ("pc", "dc"):
            if hasattr(self, c):
                getattr(self, c).close()
        for d in (self.P, self.D):
            if d is not None:
                d.stop()
        shutil.rmtree(self.base, ignore_errors=True)


def _timelines(d: Daemon, limit: int) -> list[dict]:
    url = f"http://127.0.0.1:{d.info['health_port']}/v1/requests?limit={limit}"
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)["timelines"]


def path_medians(pair: Pair, n: int) -> dict[str, float]:
    """Where the last ``n`` pushes spent their time, from both daemons' request
    timelines (one host, one monotonic clock; docs/architecture.md): the median of each
    step along P's send_ready -> matched -> write_posted -> D's completion -> recv_done,
    and P's write_posted -> write_settled -> send_done, in microseconds."""
    def moments(line: dict) -> dict[str, float]:
        start = datetime.fromisoformat(line["start"]).timestamp()
        return {k: start + v / 1e3 for k, v in line["events_ms"].items()}

    p = {t["peer_request_id"]: moments(t) for t in _timelines(pair.P, n) if t.get("peer_request_id")}
    d = {t["request_id"]: moments(t) for t in _timelines(pair.D, n)}
    steps = [("p", "send_ready", "p", "matched"), ("d", "push_reg_sent", "p", "matched"),
             ("p", "matched", "p", "write_posted"),
             ("p", "write_posted", "d", "completion"), ("d", "completion", "d", "recv_done"),
             ("p", "write_posted", "p", "write_settled"), ("p", "write_settled", "p", "send_done")]
    out = {}
    for a_side, a, b_side, b in steps:
        gaps = [((d if b_side == "d" else p)[rid][b] - (d if a_side == "d" else p)[rid][a]) * 1e6
                for rid in p.keys() & d.keys()]
        if gaps:
            out[f"{a_side}.{a} -> {b_side}.{b}"] = statistics.median(gaps)
    return out


def run(sizes: list[int], block_len: int, repeats: int, control: bool = True, idle_window: float = 10.0,
        regions: int = 1, gap_s: float = 0.005, stream: int = 0) -> dict:
    """Push each size ``repeats`` times (after one warm-up) through a fresh daemon pair.
    With ``stream`` > 1, also ``stream`` pushes of each size back to back
    (``Pair.push_stream``), as many times. With ``control``, also the control-path figures
    and (``idle_window`` > 0) idle CPU."""
    pair = Pair(max(sizes) * max(1, stream), block_len, regions, gap_s)
    try:
        rows = []
        for size in sizes:
            n = size // block_len
            times = [pair.push(n)[0] for _ in range(repeats + 1)][1:]
            rows.append({"size": size, "blocks": n, "block_len": block_len, "push_s": statistics.median(times)})
        res: dict = {"push": rows}
        if stream > 1:
            res["stream"] = []
            for size in sizes:
                n = size // block_len
                times = [pair.push_stream(n, stream) for _ in range(repeats + 1)][1:]
                res["stream"].append({"size": size, "blocks": n, "block_len": block_len, "stream": stream,
                                      "push_s": statistics.median(times)})
        if not control:
            return res
        pc = pair.pc
        # Round trip of a worker message through the daemon's event loop.
        n = 2000
        t0 = time.perf_counter()
        for i in range(n):
            pc.send(wp.Ping(token=i))
            while not any(isinstance(e, wp.Pong) for e in pc.poll()):
                pass
        res["rtt_us"] = (time.perf_counter() - t0) / n * 1e6
        # Per-request control overhead: the smallest push (one block), many times.
        one = [pair.push(1) for _ in range(51)][1:]
        res["one_block"] = {"block_len": block_len,
                            "both_us": statistics.median(t[0] for t in one) * 1e6,
                            "send_done_us": statistics.median(t[1] for t in one) * 1e6,
                            "recv_done_us": statistics.median(t[2] for t in one) * 1e6}
        res["one_block_path_us"] = path_medians(pair, 50)
        n = 200000
        t0 = time.perf_counter()
        for _ in range(n):
            pc.poll()
        res["idle_poll_us"] = (time.perf_counter() - t0) / n * 1e6
        if idle_window > 0:
            procs = [psutil.Process(pair.P.proc.pid), psutil.Process(pair.D.proc.pid)]
            time.sleep(1.0)
            before = [sum(p.cpu_times()[:2]) for p in procs]
            time.sleep(idle_window)
            res["idle_cpu_percent"] = [(sum(p.cpu_times()[:2]) - b) / idle_window * 100
                                       for p, b in zip(procs, before)]
            res["idle_window_s"] = idle_window
        return res
    finally:
        pair.close()


def _table(rows: list[dict], inproc: dict[int, dict], pushes: int) -> None:
    """Print the daemon's ``rows`` beside the in-process ones of the same sizes (``inproc``,
    by size; noted into each row), ``pushes`` pushes of each size per measurement."""
    print(f"{'size':>10} {'blocks':>7} {'in-process ms':>14} {'GB/s':>7} {'daemon ms':>10} {'GB/s':>7} {'ratio':>6}")
    for r in rows:
        b = inproc[r["size"]]
        r.update(inproc_s=b["notified_s"], inproc_write_s=b["write_s"])
        nbytes = r["size"] * pushes
        gbs_b, gbs_d = nbytes / b["notified_s"] / 1e9, nbytes / r["push_s"] / 1e9
        print(f"{r['size'] / 2**20:>9.2f}M {r['blocks']:>7} {b['notified_s'] * 1e3:>14.3f} {gbs_b:>7.2f} "
              f"{r['push_s'] * 1e3:>10.3f} {gbs_d:>7.2f} {gbs_d / gbs_b:>6.2f}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64K,256K,1M,4M,16M,64M,256M")
    ap.add_argument("--block-len", default="64K")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--idle-window", type=float, default=10.0)
    ap.add_argument("--ucx-error-handling-mode", default="peer", choices=["peer", "none"],
                    help="for the daemons (ucx_error_handling_mode) and the in-process baseline alike")
    ap.add_argument("--regions", type=int, default=1,
                    help="regions per block (a model's layers' K and V; vLLM-shaped: 2 x layers)")
    ap.add_argument("--gap-ms", type=float, default=5.0,
                    help="how long before P's worker hands its blocks over D registers (both daemons idle "
                         "meanwhile); negative: P's blocks first, D's registration that long after")
    ap.add_argument("--stream", type=int, default=8,
                    help="also this many pushes of each size back to back, against as many in-process WRITEs "
                         "posted back to back (0 or 1: no streams)")
    ap.add_argument("--json")
    args = ap.parse_args()
    os.environ["PUSHSVC_UCX_ERROR_HANDLING_MODE"] = args.ucx_error_handling_mode  # the daemons read it
    sizes = [_size(s) for s in args.sizes.split(",")]
    block_len = _size(args.block_len)
    mode = args.ucx_error_handling_mode
    # The same buffer as the daemons' (the largest size, times the stream's length): a
    # block's pieces in the 64 regions lie as far apart as theirs, so NIXL cannot merge
    # them where the daemon cannot.
    total = max(sizes) * max(1, args.stream)
    base = {r["size"]: r for r in nixl_pair.run(sizes, block_len, args.repeats, mode, args.regions, total=total)}
    one = nixl_pair.run([block_len], block_len, 50, mode, args.regions, total=total)[0]
    streams = {r["size"]: r for r in nixl_pair.run(sizes, block_len, args.repeats, mode, args.regions, total=total,
                                                    stream=args.stream)} if args.stream > 1 else {}
    res = run(sizes, block_len, args.repeats, idle_window=args.idle_window, regions=args.regions,
              gap_s=args.gap_ms / 1e3, stream=args.stream)
    _table(res["push"], base, 1)
    if res.get("stream"):
        print(f"streams of {args.stream} pushes back to back (in-process: as many WRITEs posted back to back), "
              "GB/s of all of them:")
        _table(res["stream"], streams, args.stream)
    o = res["one_block"]
    print(f"worker message round trip: {res['rtt_us']:.1f} us; idle poll(): {res['idle_poll_us']:.2f} us")
    print(f"one {block_len >> 10} KiB block: daemon {o['both_us']:.0f} us (P SendDone {o['send_done_us']:.0f}, "
          f"D RecvDone {o['recv_done_us']:.0f}), in-process {one['notified_s'] * 1e6:.0f} us: "
          f"control overhead {o['both_us'] - one['notified_s'] * 1e6:.0f} us per request")
    print("  where it goes (median of the daemons' request timelines, us):")
    for step, us in res["one_block_path_us"].items():
        print(f"    {step:42s} {us:8.0f}")
    if "idle_cpu_percent" in res:
        print(f"idle daemon CPU ({args.idle_window:.0f} s, one worker registered): P {res['idle_cpu_percent'][0]:.2f}% "
              f"D {res['idle_cpu_percent'][1]:.2f}% of a core")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
