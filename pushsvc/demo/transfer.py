"""``pushsvc demo --transfer-only``: two daemons on loopback push KV blocks between two workers.

Starts a P and a D daemon (``pushsvc serve`` subprocesses), plays a P worker and a D
worker in this process (each with its own memfd KV cache in a vLLM-like layout), runs
a batch of requests through the full flow (D registration, P finished blocks, NIXL
WRITE, completion events), checks every transferred byte, and prints a summary. No vLLM:
a few seconds, the quick check that the transfer path works on this machine.
"""

from __future__ import annotations

import ctypes
import json
import random
import statistics
import time
import urllib.request

from pushsvc.client import DaemonClient
from pushsvc.demo.console import Console
from pushsvc.launch import Proc, Stack
from pushsvc.protocol import worker as wp
from pushsvc.shm import SharedBuffer

LAYERS = 8
BLOCK_LEN = 16 * 8 * 64 * 2  # 16 tokens x 8 KV heads x head dim 64 x bf16


class _Worker:
    def __init__(self, daemon: Proc, role: wp.Role, blocks: int) -> None:
        self.blocks = blocks
        self.client = DaemonClient(daemon.info["socket_path"], engine_id=daemon.name, rank=0, tp_size=1, role=role)
        self.client.connect()
        self.buf = SharedBuffer.create(2 * LAYERS * blocks * BLOCK_LEN)
        self.regions = [wp.Region(buffer=0, offset=i * blocks * BLOCK_LEN, block_len=BLOCK_LEN, num_blocks=blocks,
                                  layer_names=[f"model.layers.{i // 2}.self_attn"]) for i in range(2 * LAYERS)]
        ctypes.memset(self.buf.address, 0, self.buf.size)
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


def run_transfer_demo(stack: Stack, console: Console, requests: int = 16, blocks: int = 64) -> bool:
    """Push ``requests`` requests of ``blocks`` logical blocks each; True if every byte arrived."""
    rng = random.Random(7)
    workers: list[_Worker] = []
    try:
        console.step(f"starting P and D daemons (logs under {stack.workdir})")
        P = stack.daemon("prefill")
        D = stack.daemon("decode")
        for d in (P, D):
            console.line(f"  {d.name:<8} socket {d.info['socket_path']}  side channel :{d.info['side_channel_port']}"
                         f"  health {d.url}")
        p_blocks = blocks * 2
        d_blocks = blocks * requests
        pw = _Worker(P, "producer", p_blocks)
        workers.append(pw)
        dw = _Worker(D, "consumer", d_blocks)
        workers.append(dw)
        console.line(f"workers registered: {2 * LAYERS} KV regions of {BLOCK_LEN} B blocks "
                     f"(P {p_blocks} blocks, D {d_blocks} blocks)")
        lat, nbytes, ok = [], 0, 0
        console.step(f"pushing {requests} requests of {blocks} blocks")
        console.line(f"{'request':<12}{'blocks':>7}{'MiB':>8}{'latency ms':>12}  bytes")
        for i in range(requests):
            rid = f"demo-{i:03d}"
            src = rng.sample(range(p_blocks), blocks)
            dst = list(range(i * blocks, (i + 1) * blocks))
            for r in range(len(pw.regions)):
                for b in src:
                    pw.fill_block(r, b, rng.randbytes(BLOCK_LEN))
            t0 = time.perf_counter()
            dw.client.send(wp.RegisterRecv(request_id=rid, local_block_ids=[dst], remote_engine_id=P.name,
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
            console.line(f"{rid:<12}{blocks:>7}{size / 2**20:>8.1f}{ms:>12.2f}  {'identical' if good else 'MISMATCH'}")
        with urllib.request.urlopen(f"{P.url}/v1/info", timeout=5) as r:
            tables = json.load(r)["tables"]
        console.line()
        console.line(f"summary: {ok}/{requests} pushes byte-identical, {nbytes / 2**20:.1f} MiB total; latency p50 "
                     f"{statistics.median(lat):.2f} ms, max {max(lat):.2f} ms (first includes the handshake)")
        console.line(f"P daemon tables after the run: {tables}")
        return ok == requests
    finally:
        for w in workers:
            w.close()
