"""``pushsvc demo``: two daemons on loopback push KV blocks between two workers.

Starts a P and a D daemon (``pushsvc serve`` subprocesses), plays a P worker and a D
worker in this process (each with its own memfd KV cache in a vLLM-like layout), runs
a batch of requests through the full flow (D registration, P finished blocks, NIXL
WRITE, completion events), checks every transferred byte, and prints a summary.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

from pushsvc.client import DaemonClient
from pushsvc.protocol import worker as wp
from pushsvc.shm import SharedBuffer

LAYERS = 8
BLOCK_LEN = 16 * 8 * 64 * 2  # 16 tokens x 8 KV heads x head dim 64 x bf16


@dataclass
class _Daemon:
    name: str
    proc: subprocess.Popen
    info: dict

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def _start_daemon(base: str, name: str) -> _Daemon:
    rt = os.path.join(base, name)
    os.makedirs(rt, exist_ok=True)
    ready = os.path.join(rt, "ready.json")
    log = open(os.path.join(rt, "daemon.log"), "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pushsvc", "serve", "--engine-id", name, "--runtime-dir", rt, "--health-port", "0",
         "--side-channel-port", "0", "--ready-file", ready, "--log-format", "json"],
        stdout=log, stderr=subprocess.STDOUT)
    log.close()
    deadline = time.monotonic() + 60
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"daemon {name} did not start; see {rt}/daemon.log")
        time.sleep(0.02)
    with open(ready) as f:
        return _Daemon(name, proc, json.load(f))


class _Worker:
    def __init__(self, daemon: _Daemon, role: str, blocks: int, fill: int) -> None:
        self.blocks = blocks
        self.client = DaemonClient(daemon.info["socket_path"], engine_id=daemon.name, rank=0, tp_size=1, role=role)
        self.client.connect()
        self.buf = SharedBuffer.create(2 * LAYERS * blocks * BLOCK_LEN)
        self.regions = [wp.Region(buffer=0, offset=i * blocks * BLOCK_LEN, block_len=BLOCK_LEN, num_blocks=blocks,
                                  layer_names=[f"model.layers.{i // 2}.self_attn"]) for i in range(2 * LAYERS)]
        ctypes.memset(self.buf.address, fill, self.buf.size)
        self.client.register_kv([self.buf.fd], self.regions)
        self.events: dict[str, wp.DaemonMessage] = {}

    def block(self, region: int, block: int) -> bytes:
        return ctypes.string_at(self.buf.address + (region * self.blocks + block) * BLOCK_LEN, BLOCK_LEN)

    def fill_block(self, region: int, block: int, data: bytes) -> None:
        ctypes.memmove(self.buf.address + (region * self.blocks + block) * BLOCK_LEN, data, BLOCK_LEN)

    def pump(self) -> None:
        for e in self.client.poll():
            rid = getattr(e, "request_id", None)
            if rid:
                self.events[rid] = e

    def close(self) -> None:
        self.client.close()
        self.buf.close()


def run_demo(requests: int = 16, blocks: int = 64) -> int:
    base = tempfile.mkdtemp(prefix="pushsvc-demo-")
    daemons: list[_Daemon] = []
    workers: list[_Worker] = []
    rng = random.Random(7)
    try:
        print(f"starting P and D daemons under {base} ...", flush=True)
        P = _start_daemon(base, "prefill")
        D = _start_daemon(base, "decode")
        daemons += [P, D]
        for d in daemons:
            print(f"  {d.name:<8} socket {d.info['socket_path']}  side channel :{d.info['side_channel_port']}"
                  f"  health http://127.0.0.1:{d.info['health_port']}")
        p_blocks = blocks * 2
        d_blocks = blocks * requests
        pw = _Worker(P, "producer", p_blocks, 0)
        dw = _Worker(D, "consumer", d_blocks, 0)
        workers += [pw, dw]
        print(f"workers registered: {2 * LAYERS} KV regions of {BLOCK_LEN} B blocks "
              f"(P {p_blocks} blocks, D {d_blocks} blocks)", flush=True)
        lat, nbytes, ok = [], 0, 0
        print(f"{'request':<12}{'blocks':>7}{'MiB':>8}{'latency ms':>12}  bytes")
        for i in range(requests):
            rid = f"demo-{i:03d}"
            src = rng.sample(range(p_blocks), blocks)
            dst = list(range(i * blocks, (i + 1) * blocks))
            for r in range(len(pw.regions)):
                for b in src:
                    pw.fill_block(r, b, rng.randbytes(BLOCK_LEN))
            t0 = time.perf_counter()
            dw.client.send(wp.RegisterRecv(request_id=rid, local_block_ids=[dst], remote_engine_id="prefill",
                                           remote_host="127.0.0.1", remote_port=P.info["side_channel_port"]))
            pw.client.send(wp.SendReady(request_id=rid, block_ids=[src]))
            deadline = time.monotonic() + 30
            while not (rid in dw.events and rid in pw.events) and time.monotonic() < deadline:
                dw.pump()
                pw.pump()
                time.sleep(0.0002)
            ms = (time.perf_counter() - t0) * 1e3
            good = isinstance(dw.events.get(rid), wp.RecvDone) and all(
                dw.block(r, d) == pw.block(r, s) for r in range(len(pw.regions)) for s, d in zip(src, dst))
            size = blocks * len(pw.regions) * BLOCK_LEN
            ok += good
            nbytes += size
            lat.append(ms)
            print(f"{rid:<12}{blocks:>7}{size / 2**20:>8.1f}{ms:>12.2f}  {'identical' if good else 'MISMATCH'}",
                  flush=True)
        with urllib.request.urlopen(f"http://127.0.0.1:{P.info['health_port']}/v1/info", timeout=5) as r:
            tables = json.load(r)["tables"]
        print()
        print(f"summary: {ok}/{requests} pushes byte-identical, {nbytes / 2**20:.1f} MiB total; "
              f"latency p50 {statistics.median(lat):.2f} ms, max {max(lat):.2f} ms (first includes the handshake)")
        print(f"P daemon tables after the run: {tables}")
        return 0 if ok == requests else 1
    finally:
        for w in workers:
            w.close()
        codes = [d.stop() for d in daemons]
        print(f"daemons stopped (exit codes {codes})")
        shutil.rmtree(base, ignore_errors=True)
