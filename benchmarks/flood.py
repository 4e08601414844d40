"""Slow and flooding clients against one real daemon: do well-behaved ones still get in?

For each scenario a fresh ``pushsvc serve`` starts, load processes attack its health port
and/or its worker socket, and this process measures, one after the other in a loop:

* ``/healthz`` from a well-behaved client (a new TCP connection per request, like a probe);
* a well-behaved worker: connect + ``Hello`` until ``Welcome`` (a new connection each time,
  rank 0, so the daemon replaces the rank's agent as a restarted worker would), then one
  ``Ping`` until ``Pong``.

Loads: ``idle`` holds N connections that never send a byte and reopens any the daemon
closes; ``slowloris`` holds N HTTP requests whose headers never end (one more header line
a second); ``flood`` connects and resets in a tight loop. Connections "held" are those open
when the scenario ends, "dropped" those the daemon closed.

    python benchmarks/flood.py [--conns 1000] [--seconds 5] [--scenarios baseline,health_idle,...]

Prints a table and writes ``bench-results/flood-<time>/flood.json``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import select
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pushsvc.client import DaemonClient
from pushsvc.protocol import worker as wp

ROOT = Path(__file__).resolve().parent.parent

# scenario -> [(load kind, target, connections)]; "all" is every attack at once.
SCENARIOS: dict[str, list[tuple[str, str, int]]] = {
    "baseline": [],
    "health_idle": [("idle", "tcp", 1)],
    "health_idle_2x": [("idle", "tcp", 2)],  # twice --conns: above the health server's cap at the default
    "health_slowloris": [("slowloris", "tcp", 1)],
    "health_flood": [("flood", "tcp", 0)],
    "unix_idle": [("idle", "unix", 1)],
    "unix_flood": [("flood", "unix", 0)],
    "all": [("idle", "tcp", 1), ("slowloris", "tcp", 1), ("flood", "tcp", 0), ("idle", "unix", 1),
            ("flood", "unix", 0)],
}


# ---------------------------------------------------------------- load processes


def _open(target: str, addr: str) -> socket.socket:
    if target == "unix":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(addr)
    else:
        s = socket.create_connection(("127.0.0.1", int(addr)))
    return s


def _reset(s: socket.socket) -> None:
    # RST instead of FIN: no TIME_WAIT on either side, so a flood can run for minutes.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def run_load(kind: str, target: str, addr: str, conns: int) -> int:
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    opened = dropped = failed = 0
    held: dict[socket.socket, float] = {}
    sel = selectors.DefaultSelector()
    while not stop:
        if kind == "flood":
            try:
                _reset(_open(target, addr))
                opened += 1
            except OSError:
                failed += 1
            continue
        while len(held) < conns and not stop:
            try:
                s = _open(target, addr)
            except OSError:
                failed += 1
                time.sleep(0.01)
                break
            opened += 1
            if kind == "slowloris":
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            held[s] = time.monotonic()
            sel.register(s, selectors.EVENT_READ)
        for key, _ in sel.select(0.2):
            s = key.fileobj
            try:
                data = s.recv(1 << 16)
            except OSError:
                data = b""
            if not data:  # closed by the daemon; reopened on the next pass
                sel.unregister(s)
                del held[s]
                s.close()
                dropped += 1
        if kind == "slowloris":
            now = time.monotonic()
            for s, last in list(held.items()):
                if now - last >= 1.0:
                    try:
                        s.send(b"X-Slow: 1\r\n")
                    except OSError:
                        pass
                    held[s] = now
    print(json.dumps({"kind": kind, "target": target, "opened": opened, "held": len(held),
                      "dropped": dropped, "failed": failed}), flush=True)
    return 0


# ---------------------------------------------------------------- measurement


def health_get(port: int) -> float:
    t0 = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request("GET", "/healthz")
        r = c.getresponse()
        r.read()
        if r.status != 200:
            raise RuntimeError(f"/healthz answered {r.status}")
    finally:
        c.close()
    return time.perf_counter() - t0


def worker_round(path: str, engine_id: str, token: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    client = DaemonClient(path, engine_id=engine_id, rank=0, tp_size=1, role="both", timeout_s=10.0)
    client.connect()
    t1 = time.perf_counter()
    try:
        client.send(wp.Ping(token=token))
        deadline = time.monotonic() + 10
        while not any(isinstance(e, wp.Pong) and e.token == token for e in client.poll()):
            if time.monotonic() > deadline:
                raise TimeoutError("no Pong within 10 s")
            select.select([client.fileno()], [], [], 0.5)
        return t1 - t0, time.perf_counter() - t1
    finally:
        client.close()


def quantiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"n": 0}
    xs = sorted(xs)

    def q(p: float) -> float:
        return xs[min(len(xs) - 1, int(p * len(xs)))] * 1000

    return {"n": len(xs), "p50_ms": q(0.5), "p99_ms": q(0.99), "max_ms": xs[-1] * 1000}


def metrics(port: int) -> dict[str, float]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pushsvc_rejected_connections_total{"):
            key, _, value = line.rpartition(" ")
            out[key[len("pushsvc_rejected_connections_total"):]] = float(value)
    return out


def start_daemon(base: str, name: str) -> tuple[subprocess.Popen, dict]:
    rt = os.path.join(base, name)
    ready = os.path.join(rt, "ready.json")
    os.makedirs(rt)
    with open(os.path.join(rt, "log"), "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pushsvc", "serve", "--engine-id", name, "--runtime-dir", rt, "--health-port", "0",
             "--side-channel-port", "0", "--ready-file", ready, "--log-format", "json", "--log-level", "error"],
            stdout=log, stderr=subprocess.STDOUT)
    while not os.path.exists(ready):
        if proc.poll() is not None:
            raise RuntimeError(f"daemon failed; see {rt}/log")
        time.sleep(0.02)
    with open(ready) as f:
        return proc, json.load(f)


def scenario(name: str, conns: int, seconds: float, base: str) -> dict:
    proc, info = start_daemon(base, name)
    loads = []
    try:
        for kind, target, scale in SCENARIOS[name]:
            addr = info["socket_path"] if target == "unix" else str(info["health_port"])
            loads.append(subprocess.Popen([sys.executable, __file__, "--load", kind, target, addr, str(conns * scale)],
                                          stdout=subprocess.PIPE, text=True))
        time.sleep(2.0 if loads else 0.2)  # let the idle loads open their connections
        fds_under_load = len(os.listdir(f"/proc/{proc.pid}/fd"))
        health: list[float] = []
        hello: list[float] = []
        ping: list[float] = []
        errors: list[str] = []
        end = time.monotonic() + seconds
        token = 0
        while time.monotonic() < end:
            token += 1
            try:
                health.append(health_get(info["health_port"]))
            except Exception as exc:
                errors.append(f"healthz: {type(exc).__name__}: {exc}")
            try:
                h, p = worker_round(info["socket_path"], name, token)
                hello.append(h)
                ping.append(p)
            except Exception as exc:
                errors.append(f"worker: {type(exc).__name__}: {exc}")
            time.sleep(0.01)
        load_stats = []
        for p in loads:
            p.send_signal(signal.SIGTERM)
            out, _ = p.communicate(timeout=30)
            load_stats.append(json.loads(out.strip().splitlines()[-1]))
        return {"scenario": name, "healthz": quantiles(health), "hello": quantiles(hello), "ping": quantiles(ping),
                "errors": len(errors), "first_errors": errors[:5], "loads": load_stats,
                "daemon_fds_under_load": fds_under_load, "rejected": metrics(info["health_port"])}
    finally:
        for p in loads:
            if p.poll() is None:
                p.kill()
                p.wait()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def fmt(q: dict) -> str:
    return f"{q['p50_ms']:7.2f} {q['p99_ms']:8.2f} {q['max_ms']:8.1f}" if q.get("n") else f"{'-':>7} {'-':>8} {'-':>8}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conns", type=int, default=1000, help="idle / slowloris connections per load (default 1000)")
    ap.add_argument("--seconds", type=float, default=5.0, help="measurement time per scenario (default 5)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset of " + ",".join(SCENARIOS))
    ap.add_argument("--out", help="output folder (default bench-results/flood-<time>)")
    ap.add_argument("--load", nargs=4, metavar=("KIND", "TARGET", "ADDR", "CONNS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.load:
        kind, target, addr, n = args.load
        return run_load(kind, target, addr, int(n))
    names = [s for s in args.scenarios.split(",") if s]
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        ap.error(f"unknown scenarios: {sorted(unknown)}")
    base = tempfile.mkdtemp(prefix="psflood-")
    results = []
    print(f"{'scenario':<17} {'/healthz p50 p99 max (ms)':>25} {'hello p50 p99 max':>25} {'ping p50 p99 max':>25} "
          f"{'n':>5} {'err':>4}  held/dropped by the loads")
    try:
        for name in names:
            r = scenario(name, args.conns, args.seconds, base)
            results.append(r)
            loads = ", ".join(f"{x['kind']}-{x['target']} {x['held']}/{x['dropped']}" for x in r["loads"] if x["kind"] != "flood")
            floods = ", ".join(f"flood-{x['target']} {x['opened']} conns" for x in r["loads"] if x["kind"] == "flood")
            print(f"{name:<17} {fmt(r['healthz']):>25} {fmt(r['hello']):>25} {fmt(r['ping']):>25} "
                  f"{r['healthz'].get('n', 0):>5} {r['errors']:>4}  {'; '.join(x for x in (loads, floods) if x)}",
                  flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    out_dir = (Path(args.out) if args.out else ROOT / "bench-results" / time.strftime("flood-%Y%m%d-%H%M%S")).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "flood.json").write_text(json.dumps({"conns": args.conns, "seconds": args.seconds,
                                                    "scenarios": results}, indent=2))
    print(f"wrote {out_dir / 'flood.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
