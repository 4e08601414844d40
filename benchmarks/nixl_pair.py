"""Baseline: the same WRITE done in-process with NIXL, no daemon.

Two processes, each owning its memory and a NIXL agent (progress thread off, as in the
daemon). The initiator prepares block descriptors once, then for each size posts one
WRITE with a notification and polls until DONE; the target polls for the notification
and reports when it saw it. Both read ``time.perf_counter()`` (CLOCK_MONOTONIC, one clock
for every process on a host), so "notified" is measured from the post to the moment the
target saw the notification, with no pipe round trip in it.
Run as ``python nixl_pair.py [sizes] [block_len]`` (it spawns the target itself); prints JSON lines.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
import time
from typing import NamedTuple

import numpy as np

from pushsvc.engine.base import XferState
from pushsvc.engine.nixl import NixlEngine
from pushsvc.shm import SharedBuffer
from pushsvc.state.layout import Layout, RegionSpec, descriptor_table, plan_write


def _layout(buf: SharedBuffer, block_len: int, blocks: int, regions: int = 1) -> Layout:
    """``regions`` regions (a model's layers' K and V) of ``blocks`` blocks each; a block
    id spans all of them, ``block_len // regions`` bytes in each."""
    part = block_len // regions
    return Layout(tuple(RegionSpec(buf.address + r * blocks * part, part, blocks, part) for r in range(regions)))


def _target(conn, total: int, block_len: int, ucx_mode: str, regions: int) -> None:
    agent = NixlEngine(["UCX"], ucx_error_handling_mode=ucx_mode).create_agent("bench-target")
    buf = SharedBuffer.create(total)
    agent.register([(buf.address, buf.size)], "DRAM")
    layout = _layout(buf, block_len, total // block_len, regions)
    conn.send((agent.metadata(), descriptor_table(layout)))
    peer_meta = conn.recv()
    agent.add_remote(peer_meta)
    # Between measurements the target blocks on the pipe; once told which notification to
    # expect it spins on its agent (no progress thread: UCX connection set-up and
    # notification delivery advance only while both sides call into their agents).
    seen: set[bytes] = set()
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        wanted = {tag.encode() for tag in cmd}  # one WRITE's tag, or a stream's
        conn.send("armed")
        while not wanted <= seen:
            for msgs in agent.notifs().values():
                seen.update(msgs)
        seen_at = time.perf_counter()
        seen -= wanted
        conn.send(seen_at)


class Timed(NamedTuple):
    """``time.perf_counter()`` at the moments of one WRITE, or of a stream of them."""

    start: float  # just before the (first) post
    posted: float  # the (last) post returned (over tcp the bytes moved inside it)
    settled: float  # no longer in progress (every one of them)


def timed_write(agent, local, src_idx, remote, dst_idx, tag: str) -> Timed:
    """Post one WRITE with notification ``tag``, spin until it settles, release it."""
    return timed_stream(agent, local, remote, [src_idx], [tag], [dst_idx])


def timed_stream(agent, local, remote, src_idxs: list, tags: list[str], dst_idxs: list | None = None) -> Timed:
    """Post one WRITE per index array back to back (to the same indices remotely unless
    ``dst_idxs``), each with its notification, then spin until all settled."""
    t0 = time.perf_counter()
    handles = [agent.write(local, src, remote, dst, tag.encode())
               for src, dst, tag in zip(src_idxs, dst_idxs or src_idxs, tags)]
    posted = time.perf_counter()
    for handle, state in handles:
        while state is XferState.PROC:
            state = agent.state(handle)
    t1 = time.perf_counter()
    for handle, _ in handles:
        agent.release(handle)
    return Timed(t0, posted, t1)


def run(sizes: list[int], block_len: int, repeats: int, ucx_mode: str = "peer", regions: int = 1,
        total: int = 0, stream: int = 0) -> list[dict]:
    """``total``: the buffer size (default the largest size). With several regions it sets
    how far apart a block's pieces lie: adjacent pieces NIXL merges into one descriptor.
    With ``stream`` > 1, each measurement is ``stream`` WRITEs of ``size`` posted back to
    back (WRITE i: blocks ``[i * n, (i + 1) * n)`` on both sides, a notification each),
    timed from the first post until all settled (``write_s``) and until the target saw
    every notification (``notified_s``); ``post_s`` then covers all the posts."""
    k = max(1, stream)
    total = max(total, *(k * size for size in sizes))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, total, block_len, ucx_mode, regions))
    proc.start()
    agent = NixlEngine(["UCX"], ucx_error_handling_mode=ucx_mode).create_agent("bench-initiator")
    buf = SharedBuffer.create(total)
    agent.register([(buf.address, buf.size)], "DRAM")
    meta, remote_descs = parent.recv()
    parent.send(agent.metadata())
    name = agent.add_remote(meta)
    layout = _layout(buf, block_len, total // block_len, regions)
    local = agent.prep_local(descriptor_table(layout), "DRAM")
    remote = agent.prep_remote(name, remote_descs, "DRAM")
    out = []
    for size in sizes:
        n = size // block_len
        idxs = [plan_write(layout, layout, [list(range(i * n, (i + 1) * n))],
                           [list(range(i * n, (i + 1) * n))]).src_indices for i in range(k)]
        times, notif_times, post_times = [], [], []
        for rep in range(repeats + 1):
            tags = [f"bench-{size}-{rep}.{i}" for i in range(k)]
            parent.send(tags)
            parent.recv()  # "armed": the target is polling for these notifications
            t = timed_stream(agent, local, remote, idxs, tags)
            seen_at = parent.recv()
            if rep:  # the first is a warm-up (connection set-up)
                times.append(t.settled - t.start)
                notif_times.append(max(t.settled, seen_at) - t.start)
                post_times.append(t.posted - t.start)
        out.append({"size": size, "blocks": n, "block_len": block_len, "stream": k, "write_s": float(np.median(times)),
                    "notified_s": float(np.median(notif_times)), "post_s": float(np.median(post_times))})
    parent.send(None)
    proc.join(30)
    return out


if __name__ == "__main__":
    sizes = [int(s) for s in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1 << 20, 16 << 20, 256 << 20]
    for row in run(sizes, int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 16, 5):
        print(json.dumps(row))
