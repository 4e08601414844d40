"""How long a large host-memory push holds P's daemon: the worker's ``Ping`` round trips
through P's event loop while P pushes, for each ``post_slice_mib`` asked for.

Over TCP NIXL's post moves a WRITE's bytes before it returns, so a WRITE posted whole holds
P's loop for its whole length; posted in slices, for one slice at a time
(docs/architecture.md, "UCX transports"). For each slice size a fresh daemon pair pushes
``--size`` bytes ``--repeats`` times (after one warm-up) while P's worker pings its daemon
back to back (waiting in ``select()`` for each answer: not a third busy process on a small
host).

    python benchmarks/loop_stall.py [--size 256M] [--slices 0,64,16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import select
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import daemon_push  # noqa: E402

from pushsvc.protocol import worker as wp  # noqa: E402


def one_push(pair: daemon_push.Pair, size: int, block_len: int) -> tuple[float, list[float]]:
    """One push of ``size`` bytes: its seconds (worker to worker) and the ping round trips."""
    rid, t0 = pair.start(size // block_len)
    rtts: list[float] = []
    done = False
    while not done:
        sent = time.perf_counter()
        pair.pc.send(wp.Ping(token=len(rtts)))
        pong = False
        while not pong:
            select.select([pair.pc], [], [], 1.0)  # block like an engine between steps, not spin
            for e in pair.pc.poll():
                pong = pong or (isinstance(e, wp.Pong) and e.token == len(rtts))
                done = done or (isinstance(e, (wp.SendDone, wp.SendFailed)) and e.request_id == rid)
        rtts.append(time.perf_counter() - sent)
    daemon_push._wait([pair.dc], rid)
    return time.perf_counter() - t0, rtts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="256M")
    ap.add_argument("--block-len", default="64K")
    ap.add_argument("--slices", default="0,64,16", help="post_slice_mib values, MiB (0: one post)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    size, block_len = daemon_push._size(args.size), daemon_push._size(args.block_len)
    print("| post_slice_mib | push ms (median) | worst ping ms (median over pushes) | pings per push |")
    print("|---:|---:|---:|---:|")
    for mib in args.slices.split(","):
        os.environ["PUSHSVC_POST_SLICE_MIB"] = mib  # the daemons read it
        pair = daemon_push.Pair(size, block_len)
        try:
            runs = [one_push(pair, size, block_len) for _ in range(args.repeats + 1)][1:]
        finally:
            pair.close()
        print(f"| {mib} | {statistics.median(t for t, _ in runs) * 1e3:.1f} "
              f"| {statistics.median(max(r) for _, r in runs) * 1e3:.2f} "
              f"| {statistics.median(len(r) for _, r in runs):.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
