"""A GPU worker process for the GPU tests and benchmark: vLLM-shaped CUDA KV caches and
the connector's worker role (``PushWorker``, no vLLM), driven by JSON lines on stdin.

Layouts (per layer unless noted; bf16 unless noted):

* ``flash``: FlashAttention's ``[2, blocks, block_size, heads, dim]``;
* ``flashinfer``: ``[blocks, 2, block_size, heads, dim]``;
* ``hnd``: ``[2, blocks, block_size, heads, dim]`` as a view of ``[2, blocks, heads,
  block_size, dim]`` storage (vLLM's HND stride order);
* ``mla``: ``[blocks, block_size, 576]`` (one region per layer);
* ``crosslayer``: one ``[blocks, layers, 2, block_size, heads, dim]`` tensor, each layer
  a view of it (vLLM's cross-layer blocks).

Every op answers one line ``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "connector"))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from pushsvc.protocol import worker as wp  # noqa: E402
from pushsvc_connector.kvshare import share_kv  # noqa: E402
from pushsvc_connector.steps import StepPlan  # noqa: E402
from pushsvc_connector.worker import PushWorker  # noqa: E402

LAYOUTS = ("flash", "flashinfer", "hnd", "mla", "crosslayer")


class KV:
    """The layer tensors vLLM would hand ``register_kv_caches``, and per-block access."""

    def __init__(self, layout: str, layers: int, blocks: int, block_size: int, heads: int, dim: int,
                 seed: int) -> None:
        dev = torch.device("cuda", torch.cuda.current_device())
        self.layout, self.blocks = layout, blocks
        self.tensors: dict[str, torch.Tensor] = {}
        self.storage: list[tuple[torch.Tensor, int]] = []  # (tensor whose dim ``d`` runs over blocks, d)
        dt = torch.bfloat16
        if layout == "crosslayer":
            big = torch.empty(blocks, layers, 2, block_size, heads, dim, dtype=dt, device=dev)
            self.storage.append((big, 0))
            for layer in range(layers):
                self.tensors[f"model.layers.{layer}.self_attn"] = big[:, layer]
        for layer in range(layers if layout != "crosslayer" else 0):
            name = f"model.layers.{layer}.self_attn"
            if layout == "flash":
                t = torch.empty(2, blocks, block_size, heads, dim, dtype=dt, device=dev)
                self.storage.append((t, 1))
            elif layout == "flashinfer":
                t = torch.empty(blocks, 2, block_size, heads, dim, dtype=dt, device=dev)
                self.storage.append((t, 0))
            elif layout == "hnd":
                base = torch.empty(2, blocks, heads, block_size, dim, dtype=dt, device=dev)
                self.storage.append((base, 1))
                t = base.permute(0, 1, 3, 2, 4)
            elif layout == "mla":
                t = torch.empty(blocks, block_size, 576, dtype=dt, device=dev)
                self.storage.append((t, 0))
            else:
                raise ValueError(f"unknown layout {layout}")
            self.tensors[name] = t
        gen = torch.Generator(device=dev).manual_seed(seed)
        for t, _ in self.storage:
            raw = t.view(torch.int16)
            raw.copy_(torch.randint(-(1 << 15), 1 << 15, raw.shape, dtype=torch.int16, device=dev, generator=gen))
        torch.cuda.synchronize()
        self.snapshot: list[torch.Tensor] | None = None

    def block_bytes(self, blocks: list[int], heads: tuple[int, int] | None = None) -> list[bytes]:
        """Every byte of each block, over every layer, in one fixed order; ``heads``: only
        the KV heads ``h0 <= h < h1`` (the ``hnd`` layout: heads outermost in a block)."""
        index = torch.tensor(blocks, dtype=torch.long, device="cuda")
        parts = []
        for t, d in self.storage:
            if heads is not None:
                if self.layout != "hnd":
                    raise ValueError("head ranges only for the hnd layout")
                t = t[:, :, heads[0]:heads[1]]  # storage [2, blocks, heads, block_size, dim]
            picked = t.index_select(d, index).movedim(d, 0).contiguous()
            parts.append(picked.view(torch.uint8).reshape(len(blocks), -1))
        host = torch.cat(parts, dim=1).cpu().numpy()
        return [host[i].tobytes() for i in range(len(blocks))]

    def digests(self, blocks: list[int], heads: tuple[int, int] | None = None) -> list[str]:
        out = []
        for i in range(0, len(blocks), 256):
            out += [hashlib.blake2b(b, digest_size=16).hexdigest()
                    for b in self.block_bytes(blocks[i:i + 256], heads)]
        return out

    def compute_layer(self, layer: int, blocks: list[int], seed: int, sleep_cycles: int) -> None:
        """What a forward pass does to ``layer`` of ``blocks``, queued on the current
        stream and not waited for: the GPU is busy ``sleep_cycles`` first, then writes the
        layer's final KV (seeded bytes)."""
        name = f"model.layers.{layer}.self_attn"
        t = self.tensors[name]
        # From page-locked memory, asynchronously: a copy from pageable memory would wait
        # for the stream's earlier work, and the CPU would no longer run ahead of the GPU.
        index = torch.tensor(blocks, dtype=torch.long).pin_memory().to("cuda", non_blocking=True)
        torch.cuda._sleep(sleep_cycles)
        dim = 1 if t.dim() >= 3 and t.shape[0] == 2 and self.layout != "mla" else 0
        picked = t.index_select(dim, index)
        gen = torch.Generator(device="cuda").manual_seed(seed)
        fresh = torch.randint(-(1 << 15), 1 << 15, picked.shape, dtype=torch.int16, device="cuda",
                              generator=gen).view(t.dtype)
        t.index_copy_(dim, index, fresh)

    def take_snapshot(self) -> None:
        self.snapshot = [t.clone() for t, _ in self.storage]
        torch.cuda.synchronize()

    def changed(self) -> list[int]:
        """Blocks whose bytes differ from the snapshot, in any layer."""
        assert self.snapshot is not None
        changed = torch.zeros(self.blocks, dtype=torch.bool, device="cuda")
        for (t, d), old in zip(self.storage, self.snapshot):
            diff = (t.view(torch.int16) != old.view(torch.int16)).movedim(d, 0).reshape(self.blocks, -1)
            changed |= diff.any(dim=1)
        return torch.nonzero(changed).flatten().tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--role", required=True)
    ap.add_argument("--layout", default="flash", choices=LAYOUTS)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--layerwise", type=int, default=0, help="1: push layer by layer (the worker's layer events)")
    ap.add_argument("--device", type=int, default=0, help="the GPU (torch's index) the KV lives on")
    args = ap.parse_args()
    torch.cuda.set_device(args.device)
    kv = KV(args.layout, args.layers, args.blocks, args.block_size, args.heads, args.dim, args.seed)
    worker = PushWorker(socket_path=args.socket, rank=args.rank, tp_size=args.tp_size, role=args.role,
                        reconnect_interval_s=0.05, layerwise=bool(args.layerwise),
                        stream=lambda: torch.cuda.current_stream().cuda_stream)
    # The layer's KV heads on this rank, as vLLM's KV-cache spec says them (MLA: one row).
    heads = dict.fromkeys(kv.tensors, 1 if args.layout == "mla" else args.heads)
    share = share_kv(kv.tensors, args.blocks, heads=heads)
    started = time.perf_counter()
    worker.register(share)
    _say(ok=True, regions=len(share.regions), buffers=len(share.cuda.buffers) if share.cuda else 0,
         register_s=time.perf_counter() - started, connected=worker.welcome is not None)
    finished: dict[str, dict] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            _say(ok=True, **_run(cmd, worker, kv, finished))
        except Exception as exc:  # the test reads the error; the process goes on
            _say(ok=False, error=f"{type(exc).__name__}: {exc}")
        if cmd["op"] == "quit":
            break
    worker.close()


def _collect(worker: PushWorker, finished: dict[str, dict], wait_s: float) -> None:
    sending, recving = worker.get_finished(wait_s)
    errors = worker.take_load_errors()
    now = time.perf_counter()
    for rid in sending:
        finished[rid] = {"side": "send", "t": now}
    for rid in recving:
        finished[rid] = {"side": "recv", "t": now, "errors": errors}


def _run(cmd: dict, worker: PushWorker, kv: KV, finished: dict[str, dict]) -> dict:
    op = cmd["op"]
    if op == "recv":
        regs = {r["rid"]: wp.RegisterRecv(request_id=r["rid"], local_block_ids=[r["blocks"]],
                                          remote_engine_id=cmd["p_engine"], remote_host="127.0.0.1",
                                          remote_port=cmd["p_port"], match_key=r.get("key", ""),
                                          remote_tp_size=cmd.get("p_tp", 1))
                for r in cmd["requests"]}
        worker.start_step(StepPlan(recvs=regs))
        return {"t": time.perf_counter()}
    if op == "send":
        sends = {r["rid"]: wp.SendReady(request_id=r["rid"], block_ids=[r["blocks"]], match_key=r.get("key", ""))
                 for r in cmd["requests"]}
        worker.start_step(StepPlan(sends=sends))
        return {"t": time.perf_counter()}
    if op == "forward":
        # One step whose forward pass ends the prefill of ``rid`` (or of each of
        # ``requests``, a batch) with layer-wise push: a SendStart per request before the
        # pass, then each layer's kernels queued (busy first, then writing the layer's final
        # KV of every request's blocks) and saved (the layer's event recorded behind them,
        # LayerSaved sent at once), then the pass's end. Nothing here waits for the GPU.
        requests = cmd.get("requests") or [{"rid": cmd["rid"], "blocks": cmd["blocks"]}]
        plan = StepPlan(layerwise={r["rid"]: wp.SendStart(request_id=r["rid"], block_ids=[r["blocks"]],
                                                          step=cmd["step"]) for r in requests}, step=cmd["step"])
        blocks = [b for r in requests for b in r["blocks"]]
        worker.begin_step(plan)
        started = time.perf_counter()
        for layer in range(len(kv.tensors)):
            kv.compute_layer(layer, blocks, cmd["seed"] + layer, cmd["sleep_cycles"])
            worker.layer_saved(f"model.layers.{layer}.self_attn")
        worker.start_step(plan)
        worker.step_saved()
        queued = time.perf_counter() - started
        if cmd.get("sync"):  # the pass's end on the GPU, on this host's clock
            torch.cuda.synchronize()
        return {"queued_s": queued, "t": time.perf_counter()}
    if op == "compute":  # the same forward pass without layer-wise push, waited for
        for layer in range(len(kv.tensors)):
            kv.compute_layer(layer, cmd["blocks"], cmd["seed"] + layer, cmd["sleep_cycles"])
        torch.cuda.synchronize()
        return {"t": time.perf_counter()}
    if op == "finished":  # the scheduler's word: the layer-wise requests finished
        worker.start_step(StepPlan(sends={rid: wp.SendReady(request_id=rid, block_ids=[[]]) for rid in cmd["rids"]}))
        return {}
    if op == "evict":  # vLLM dropped the requests (D: aborted while waiting for KV)
        worker.start_step(StepPlan(evictions=cmd["rids"]))
        return {}
    if op == "expire":  # the scheduler's backstop fired (P: the lease; D: the watchdog)
        worker.start_step(StepPlan(expired_recvs=cmd["rids"], expired_sends=cmd["rids"]))
        return {}
    if op == "wait":
        want = set(cmd["rids"])
        deadline = time.monotonic() + cmd.get("timeout", 30.0)
        while not want <= finished.keys() and time.monotonic() < deadline:
            _collect(worker, finished, 0.0 if cmd.get("spin") else 0.005)
        out = {rid: finished.pop(rid) for rid in want if rid in finished}
        for v in out.values():
            v["errors"] = sorted(v.get("errors", ()))
        return {"finished": out, "missing": sorted(want - out.keys())}
    if op == "poll":
        _collect(worker, finished, cmd.get("wait_s", 0.0))
        return {"connected": worker.welcome is not None, "pending": len(worker._recving) + len(worker._sending)}
    if op == "until_connected":
        # Connected to a daemon other than ``old`` (after a restart the worker still holds
        # the dead daemon's welcome until it notices the connection is gone).
        deadline = time.monotonic() + cmd.get("timeout", 30.0)
        old = cmd.get("old", "")
        while (worker.welcome is None or worker.welcome.daemon_id == old) and time.monotonic() < deadline:
            _collect(worker, finished, 0.01)
        connected = worker.welcome is not None and worker.welcome.daemon_id != old
        return {"connected": connected, "t": time.perf_counter(),
                "daemon_id": worker.welcome.daemon_id if worker.welcome else ""}
    if op == "digests":
        heads = cmd.get("heads")
        return {"digests": kv.digests(cmd["blocks"], tuple(heads) if heads else None)}
    if op == "snapshot":
        kv.take_snapshot()
        return {}
    if op == "changed":
        return {"blocks": kv.changed()}
    if op == "mem":
        torch.cuda.empty_cache()  # this worker's own cached blocks (snapshots) are not the daemons'
        free, total = torch.cuda.mem_get_info()
        return {"free": free, "total": total}
    if op == "quit":
        return {}
    raise ValueError(f"unknown op {op}")


def _say(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
