"""A stand-in vLLM worker process for integration tests, driven over stdin/stdout.

It owns a KV cache with a vLLM-like layout in memfd shared memory (``layers`` layers from
``first_layer`` on, named as vLLM names them, each a K and a V region, spread over two
buffers; a pipeline stage's worker holds its stage's layers only; ``--heads`` says its blocks are
head-major, as vLLM CPU's are; ``--packed``: block-outermost rows of one page per layer,
as packed MLA caches store them), registers it with its daemon through
the real client library, and executes JSON-line commands. Every block starts filled
with a pattern unique to (seed, region, block), so the test can tell which bytes moved.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import sys
import time

from pushsvc.client import DaemonClient
from pushsvc.errors import DaemonUnavailable
from pushsvc.protocol import worker as wp
from pushsvc.shm import SharedBuffer


def pattern(seed: int, region: int, block: int, length: int) -> bytes:
    head = hashlib.blake2b(f"{seed}:{region}:{block}".encode(), digest_size=32).digest()
    return (head * (length // len(head) + 1))[:length]


class KVWorker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.client = DaemonClient(args.socket, engine_id=args.engine_id, rank=args.rank,
                                   tp_size=args.tp_size, role=args.role, pp_rank=args.pp_rank, pp_size=args.pp_size)
        self.regions: list[wp.Region] = []
        if args.packed:
            # Block-outermost rows: block b's row holds one page per layer, side by side.
            row = args.layers * args.block_len
            self.buffers = [SharedBuffer.create(args.blocks * row)]
            for layer in range(args.layers):
                self.regions.append(wp.Region(
                    buffer=0, offset=layer * args.block_len, block_len=args.block_len, num_blocks=args.blocks,
                    block_stride=row, layer_names=[_layer_name(args.first_layer + layer)], heads=args.heads,
                    replicated=bool(args.replicated)))
        else:
            n_regions = 2 * args.layers
            per_buffer = [n_regions // 2, n_regions - n_regions // 2]
            self.buffers = [SharedBuffer.create(n * args.blocks * args.block_len) for n in per_buffer]
            for b, count in enumerate(per_buffer):
                for i in range(count):
                    layer = (len(self.regions)) // 2
                    self.regions.append(wp.Region(
                        buffer=b, offset=i * args.blocks * args.block_len, block_len=args.block_len,
                        num_blocks=args.blocks, layer_names=[_layer_name(args.first_layer + layer)],
                        heads=args.heads, replicated=bool(args.replicated)))
        for r_idx, region in enumerate(self.regions):
            for blk in range(args.blocks):
                self.write_block(r_idx, blk, pattern(args.seed, r_idx, blk, args.block_len))
        self.events: list[dict] = []
        self.arrived: dict[int, float] = {}  # id(event) -> wall-clock arrival (collect)

    def block_addr(self, region: int, block: int) -> int:
        r = self.regions[region]
        return self.buffers[r.buffer].address + r.offset + block * r.stride

    def write_block(self, region: int, block: int, data: bytes) -> None:
        ctypes.memmove(self.block_addr(region, block), data, len(data))

    def read_block(self, region: int, block: int) -> bytes:
        return ctypes.string_at(self.block_addr(region, block), self.args.block_len)

    def start(self) -> dict:
        welcome = self.client.connect()
        reg = self.client.register_kv([b.fd for b in self.buffers], self.regions, self.args.blocks_per_logical)
        return {"welcome": _as_dict(welcome), "registered": _as_dict(reg)}

    def handle(self, cmd: dict) -> dict:
        op = cmd["op"]
        if op == "recv":
            self.client.send(wp.RegisterRecv(
                request_id=cmd["request_id"], local_block_ids=cmd["block_ids"],
                remote_engine_id=cmd["remote_engine_id"], remote_host=cmd["remote_host"],
                remote_port=cmd["remote_port"], remote_tp_size=cmd.get("remote_tp_size", 1),
                match_key=cmd.get("match_key", "")))
            return {}
        if op == "ready":
            self.client.send(wp.SendReady(request_id=cmd["request_id"], block_ids=cmd["block_ids"],
                                          match_key=cmd.get("match_key", "")))
            return {}
        if op == "start":  # layer-wise push: the prefill of request_id ends in step ``step``
            self.client.send(wp.SendStart(request_id=cmd["request_id"], block_ids=cmd["block_ids"],
                                          step=cmd["step"], match_key=cmd.get("match_key", "")))
            return {}
        if op == "compute":  # the forward pass writes layer ``layer``'s final KV into ``blocks``
            for r, region in enumerate(self.regions):
                if region.layer_names == [_layer_name(self.args.first_layer + cmd["layer"])]:
                    for b in cmd["blocks"]:
                        self.write_block(r, b, pattern(cmd["seed"], r, b, self.args.block_len))
            return {}
        if op == "layer":
            self.client.send(wp.LayerSaved(step=cmd["step"], layer=cmd["layer"]))
            return {}
        if op == "step":
            self.client.send(wp.StepSaved(step=cmd["step"]))
            return {}
        if op == "recv_many":
            # Many registrations in one command, so a stream is not paced by the test.
            pace = cmd.get("interval", 0.0)
            for rid, blocks in cmd["requests"]:
                if pace:
                    time.sleep(pace)
                    self._poll()  # events keep flowing while the stream is paced
                self.client.send(wp.RegisterRecv(
                    request_id=rid, local_block_ids=blocks, remote_engine_id=cmd["remote_engine_id"],
                    remote_host=cmd["remote_host"], remote_port=cmd["remote_port"],
                    remote_tp_size=cmd.get("remote_tp_size", 1)))
            return {}
        if op == "ready_many":
            for rid, blocks in cmd["requests"]:
                self.client.send(wp.SendReady(request_id=rid, block_ids=blocks))
            return {}
        if op == "collect":
            return self.collect(cmd["request_ids"], cmd.get("timeout", 30.0), cmd.get("linger", 0.2))
        if op == "evict":
            self.client.send(wp.Evict(request_ids=cmd["request_ids"]))
            return {}
        if op == "wait":
            return self.wait(cmd["request_id"], cmd.get("timeout", 10.0))
        if op == "digests":
            return {"digests": [[hashlib.sha1(self.read_block(r, b)).hexdigest() for b in range(self.args.blocks)]
                                for r in range(len(self.regions))]}
        if op == "ping":
            t0 = time.perf_counter()
            n = cmd.get("count", 1000)
            for i in range(n):
                self.client.send(wp.Ping(token=i))
                while not any(isinstance(e, wp.Pong) for e in self._poll()):
                    pass
            return {"round_trip_us": (time.perf_counter() - t0) / n * 1e6}
        if op == "idle_poll":
            n = cmd.get("count", 100000)
            t0 = time.perf_counter()
            for _ in range(n):
                self.client.poll()
            return {"poll_us": (time.perf_counter() - t0) / n * 1e6}
        raise ValueError(f"unknown op {op}")

    def _poll(self) -> list:
        got = self.client.poll()
        now = time.time()
        for e in got:
            if not isinstance(e, wp.Pong):
                d = _as_dict(e)
                self.arrived[id(d)] = now
                self.events.append(d)
        return got

    def collect(self, request_ids: list[str], timeout: float, linger: float) -> dict:
        """Every event for ``request_ids``, with the wall-clock time each arrived: waits
        until each id has one, then ``linger`` seconds more so duplicates show up too."""
        wanted = set(request_ids)
        got: dict[str, list[dict]] = {rid: [] for rid in request_ids}
        at: dict[str, list[float]] = {rid: [] for rid in request_ids}
        deadline = time.monotonic() + timeout
        linger_until = None
        while True:
            keep = []
            for e in self.events:
                rid = e.get("request_id")
                if rid in wanted:
                    got[rid].append(e)
                    at[rid].append(self.arrived.pop(id(e), time.time()))
                else:
                    keep.append(e)
            self.events = keep
            now = time.monotonic()
            if linger_until is None and all(got.values()):
                linger_until = now + linger
            if now > deadline or (linger_until is not None and now > linger_until):
                return {"events": got, "at": at}
            self._poll()
            time.sleep(0.0005)

    def wait(self, request_id: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for i, e in enumerate(self.events):
                if e.get("request_id") == request_id:
                    self.arrived.pop(id(e), None)
                    return {"event": self.events.pop(i)}
            if time.monotonic() > deadline:
                return {"event": None}
            self._poll()
            time.sleep(0.001)


def _layer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn"


def _as_dict(msg) -> dict:
    import msgspec

    d = msgspec.to_builtins(msg)
    d.pop("t", None)
    d["type"] = type(msg).__name__
    return d


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--engine-id", required=True)
    p.add_argument("--role", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--blocks", type=int, default=32)
    p.add_argument("--block-len", type=int, default=2048)
    p.add_argument("--blocks-per-logical", type=int, default=1)
    p.add_argument("--heads", type=int, default=0, help="KV heads outermost in each block (0: not head-major)")
    p.add_argument("--replicated", type=int, default=0, help="1: every TP rank holds the same KV (MLA)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--pp-rank", type=int, default=0, help="the pipeline stage this worker runs")
    p.add_argument("--pp-size", type=int, default=1)
    p.add_argument("--first-layer", type=int, default=0, help="the model layer its first region holds")
    p.add_argument("--packed", type=int, default=0,
                   help="1: block-outermost rows, one page (region) per layer in each block's row (packed MLA)")
    args = p.parse_args()
    worker = KVWorker(args)
    out = sys.stdout
    try:
        out.write(json.dumps({"ok": True, **worker.start()}) + "\n")
    except Exception as exc:  # reported to the test, which decides
        out.write(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        return 1
    out.flush()
    for line in sys.stdin:
        try:
            reply = {"ok": True, **worker.handle(json.loads(line))}
        except DaemonUnavailable as exc:
            reply = {"ok": False, "error": f"DaemonUnavailable: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
