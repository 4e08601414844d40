"""The anchors of ``gpu_push.py``, on vLLM-shaped KV (32 layers, FlashAttention layout,
16 tokens x 8 KV heads x 128 dim bf16: 32 KiB per layer half, 2 MiB per block):

* **torch copy**: one device-to-device copy of the same bytes (a peer copy between two
  GPUs), for scale.
* **in-process NIXL**: two processes owning the same KV shapes (``cudaMalloc``), one NIXL
  agent each, one WRITE of the same block pairs timed from the post until the target saw
  the notification; and streams of WRITEs posted back to back.

Imported by ``gpu_push.py``, which puts the project, the connector and the GPU tests'
helpers on ``sys.path`` first.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time

import numpy as np

LAYERS, BLOCK_SIZE, HEADS, DIM = 32, 16, 8, 128
BLOCK_BYTES = LAYERS * 2 * BLOCK_SIZE * HEADS * DIM * 2  # 2 MiB


def block_sets(n: int, total: int, pattern: str, seed: int) -> tuple[list[int], list[int]]:
    if pattern == "contiguous":
        return list(range(n)), list(range(n))
    rng = np.random.default_rng(seed)
    return sorted(rng.choice(total, n, replace=False).tolist()), rng.choice(total, n, replace=False).tolist()


# ---------------------------------------------------------------- torch copy


def torch_copy(sizes: list[int], repeats: int, src_gpu: int = 0, dst_gpu: int = 0) -> dict[int, float]:
    """One copy of each size from GPU ``src_gpu`` to ``dst_gpu`` (a peer copy when they differ)."""
    import torch

    if src_gpu != dst_gpu:
        return _peer_copy(sizes, repeats, src_gpu, dst_gpu)
    torch.cuda.set_device(src_gpu)
    out = {}
    src = torch.empty(max(sizes) * BLOCK_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for n in sizes:
        nbytes = n * BLOCK_BYTES
        times = []
        for _ in range(repeats + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst[:nbytes].copy_(src[:nbytes])
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1000)
        out[n] = statistics.median(times[1:])
    del src, dst
    torch.cuda.empty_cache()
    return out


def _peer_copy(sizes: list[int], repeats: int, src_gpu: int, dst_gpu: int) -> dict[int, float]:
    """Wall-clock of a peer copy until both devices are idle (events of one device cannot
    time a copy that two devices take part in)."""
    import torch

    out = {}
    src = torch.empty(max(sizes) * BLOCK_BYTES, dtype=torch.uint8, device=f"cuda:{src_gpu}")
    dst = torch.empty_like(src, device=f"cuda:{dst_gpu}")
    for n in sizes:
        nbytes = n * BLOCK_BYTES
        times = []
        for _ in range(repeats + 1):
            torch.cuda.synchronize(src_gpu)
            torch.cuda.synchronize(dst_gpu)
            t0 = time.perf_counter()
            dst[:nbytes].copy_(src[:nbytes])
            torch.cuda.synchronize(src_gpu)
            torch.cuda.synchronize(dst_gpu)
            times.append(time.perf_counter() - t0)
        out[n] = statistics.median(times[1:])
    del src, dst
    torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------- in-process NIXL


def _kv_layout(total_blocks: int, gpu: int = 0):
    import torch

    torch.cuda.set_device(gpu)

    from pushsvc.state.layout import Layout, RegionSpec
    from pushsvc_connector.kvlayout import regions_of

    tensors = [torch.empty(2, total_blocks, BLOCK_SIZE, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
               for _ in range(LAYERS)]
    regions = []
    for i, t in enumerate(tensors):
        for r in regions_of(f"l{i}", t, 0, 0, total_blocks):
            regions.append(RegionSpec(t.data_ptr() + r.offset, r.block_len, r.num_blocks, r.stride, 0))
    return tensors, Layout(tuple(regions))


def _anchor_target(conn, total_blocks: int, ucx_mode: str = "peer", sgl: bool = False, gpu: int = 0) -> None:
    from pushsvc.engine.nixl import NixlEngine
    from pushsvc.state.layout import descriptor_table

    tensors, layout = _kv_layout(total_blocks, gpu)
    agent = NixlEngine(["UCX"], ucx_error_handling_mode=ucx_mode, sgl=sgl).create_agent("anchor-target")
    agent.register([(t.data_ptr(), t.numel() * t.element_size()) for t in tensors], "VRAM", gpu)
    conn.send((agent.metadata(), descriptor_table(layout, gpu), layout))
    agent.add_remote(conn.recv())
    while True:
        want = conn.recv()
        if want is None:
            break
        conn.send("armed")
        wanted = {tag.encode() for tag in want}  # one WRITE's tag, or a stream's
        seen: set[bytes] = set()
        while not wanted <= seen:
            for msgs in agent.notifs().values():
                seen.update(msgs)
        conn.send(time.perf_counter())
    agent.close()


def nixl_anchor(sizes: list[int], total_blocks: int, patterns: list[str], repeats: int,
                ucx_mode: str = "peer", sgl: bool = False, p_gpu: int = 0, d_gpu: int = 0,
                stream: tuple[int, list[int]] = (0, [])) -> dict:
    """One WRITE at a time of each size and pattern, timed from its post until the target
    saw its notification; then, for ``stream = (k, sizes)``, ``k`` WRITEs of contiguous
    blocks posted back to back (request i: blocks ``[i * n, (i + 1) * n)`` on both sides,
    one notification each), timed from the first post until the target saw all ``k``
    notifications. Keys: (pattern, n) and ("stream", n)."""
    from nixl_pair import timed_stream, timed_write  # benchmarks/
    from pushsvc.engine.nixl import NixlEngine
    from pushsvc.state.layout import descriptor_table, plan_write

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_anchor_target, args=(child, total_blocks, ucx_mode, sgl, d_gpu))
    proc.start()
    tensors, layout = _kv_layout(total_blocks, p_gpu)
    agent = NixlEngine(["UCX"], ucx_error_handling_mode=ucx_mode, sgl=sgl).create_agent("anchor-initiator")
    agent.register([(t.data_ptr(), t.numel() * t.element_size()) for t in tensors], "VRAM", p_gpu)
    meta, remote_descs, remote_layout = parent.recv()
    parent.send(agent.metadata())
    name = agent.add_remote(meta)
    local = agent.prep_local(descriptor_table(layout, p_gpu), "VRAM")
    remote = agent.prep_remote(name, remote_descs, "VRAM")
    out: dict = {}
    for pattern in patterns:
        for n in sizes:
            src_ids, dst_ids = block_sets(n, total_blocks, pattern, n)
            plan = plan_write(layout, remote_layout, [src_ids], [dst_ids])
            times = []
            for rep in range(repeats + 1):
                tag = f"{pattern}-{n}-{rep}"
                parent.send([tag])
                parent.recv()
                t0 = timed_write(agent, local, plan.src_indices, remote, plan.dst_indices, tag).start
                seen = parent.recv()
                if rep:
                    times.append(max(seen, time.perf_counter()) - t0)
            out[(pattern, n)] = statistics.median(times)
            print(f"  nixl in-process {pattern:10s} {n:5d} blocks: {out[(pattern, n)] * 1e3:8.3f} ms", flush=True)
    k, stream_sizes = stream
    for n in stream_sizes:
        plans = [plan_write(layout, remote_layout, [ids], [ids])
                 for ids in (list(range(i * n, (i + 1) * n)) for i in range(k))]
        times = []
        for rep in range(repeats + 1):
            tags = [f"stream-{n}-{rep}.{i}" for i in range(k)]
            parent.send(tags)
            parent.recv()
            t = timed_stream(agent, local, remote, [plan.src_indices for plan in plans], tags,
                             [plan.dst_indices for plan in plans])
            seen = parent.recv()
            if rep:
                times.append(max(seen, t.settled) - t.start)
        out[("stream", n)] = statistics.median(times)
        print(f"  nixl in-process stream {k} x {n:5d} blocks: {out[('stream', n)] * 1e3:8.3f} ms", flush=True)
    parent.send(None)
    proc.join(60)
    agent.close()
    return out
