"""What P's finished block ids cost, listed (worker protocol before 1.7) and packed (1.7),
side by side in one run, for a 32-layer model's 64 regions (each layer's K and V).

Per request size, medians of ``--runs`` warm calls of the functions the daemon runs
(``pushsvc.protocol.worker``, ``pushsvc.state.layout``):

* ``encode``: the worker's client building and encoding the ``SendReady`` (packing included);
* ``decode+check``: P's daemon decoding it and checking the ids against its layout;
* ``+pairs``: ... and pairing them with D's for a same-host copy (``pair_blocks``);
* ``+plan``: ... or planning the NIXL WRITE (``plan_write``, which checks both sides again).

D's ids (its ``PUSH_REG``, there before P's blocks) as P's daemon keeps them: a group of
over 64 ids as an array, made once the ``PUSH_REG``'s sender is known (``layout.id_arrays``); one
more row pairs packed ids with D's ids as lists, as the daemon did before.

    python benchmarks/block_ids.py [--blocks 64,256,1024,4096] [--runs 500] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from pushsvc.protocol import worker as wp
from pushsvc.state.layout import Layout, RegionSpec, check_block_ids, id_arrays, pair_blocks, plan_write

REGIONS = 64  # 32 layers, K and V
BLOCK_BYTES = 32 << 10  # 16 tokens x 8 KV heads x 128 dims x bf16
BLOCKS_PER_REGION = 16384


def _layout() -> Layout:
    return Layout(tuple(RegionSpec(base=i * BLOCKS_PER_REGION * BLOCK_BYTES, block_len=BLOCK_BYTES,
                                   num_blocks=BLOCKS_PER_REGION, stride=BLOCK_BYTES) for i in range(REGIONS)))


def _median_us(fn: Callable[[], object], runs: int) -> float:
    for _ in range(min(50, runs)):
        fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def measure(blocks: int, packed: bool, runs: int, d_lists: bool = False) -> dict[str, float]:
    layout = _layout()
    p_ids = list(range(7, 7 + 2 * blocks, 2))  # scattered: every other block
    d_ids = [list(range(BLOCKS_PER_REGION - blocks, BLOCKS_PER_REGION))]
    if not d_lists:
        d_ids = id_arrays(d_ids)

    def encode() -> bytes:
        groups = wp.pack_ids([p_ids]) if packed else [p_ids]
        return wp.encode(wp.SendReady(request_id="cmpl-0", block_ids=groups, match_key="k"))

    data = encode()

    def decode_check():
        ids = wp.unpack_ids(wp.worker_decoder.decode(data).block_ids)
        check_block_ids(layout, ids, "finished blocks")
        return ids

    return {
        "encode_us": _median_us(encode, runs),
        "decode_check_us": _median_us(decode_check, runs),
        "pairs_us": _median_us(lambda: pair_blocks(layout, layout, decode_check(), d_ids), runs),
        "plan_us": _median_us(lambda: plan_write(layout, layout, decode_check(), d_ids), runs),
        "wire_bytes": len(data),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", default="64,256,1024,4096")
    ap.add_argument("--runs", type=int, default=500)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for blocks in (int(b) for b in args.blocks.split(",")):
        for packed, d_lists in ((False, False), (True, False), (True, True)):
            rows.append({"blocks": blocks, "ids": "packed" if packed else "listed",
                         "d_ids": "lists" if d_lists else "as kept", **measure(blocks, packed, args.runs, d_lists)})
    print(f"P's finished block ids, {REGIONS} regions, medians of {args.runs} (us)\n")
    print("| blocks | P's ids | D's ids | wire bytes | worker: encode | daemon: decode+check | +pairs (same host) "
          "| +plan (NIXL) |")
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['blocks']} | {r['ids']} | {r['d_ids']} | {r['wire_bytes']} | {r['encode_us']:.1f} "
              f"| {r['decode_check_us']:.1f} "
              f"| {r['pairs_us']:.1f} | {r['plan_us']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"when": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
