"""The transfer benchmarks' streams (``benchmarks/daemon_push.py --stream``): pushes back
to back through two real daemons land each request's bytes in its own blocks, and the
in-process anchor posts as many WRITEs back to back and waits for every notification."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import daemon_push  # noqa: E402
import nixl_pair  # noqa: E402

pytestmark = pytest.mark.nixl

BLOCK = 64 << 10


def test_a_stream_of_pushes_lands_each_request_in_its_own_blocks() -> None:
    """Two streams of 3 pushes of 4 blocks: after each, D's blocks hold P's bytes of that
    moment, block for block (push i of a stream: blocks [4 i, 4 i + 4) on both sides)."""
    n, k = 4, 3
    pair = daemon_push.Pair(n * k * BLOCK, BLOCK)
    try:
        src, dst = pair.pbuf.view(), pair.dbuf.view()
        for stream in range(2):
            for b in range(n * k):  # every block of P's KV its own pattern, new each stream
                src[b * BLOCK:(b + 1) * BLOCK] = bytes([16 * stream + b + 1]) * BLOCK
            assert pair.push_stream(n, k) > 0
            assert bytes(dst[:n * k * BLOCK]) == bytes(src[:n * k * BLOCK])
        assert pair.seq == 2 * k
    finally:
        pair.close()


def test_the_in_process_anchor_streams_as_many_writes() -> None:
    rows = nixl_pair.run([BLOCK, 4 * BLOCK], BLOCK, 2, stream=4)
    assert [(r["size"], r["stream"]) for r in rows] == [(BLOCK, 4), (4 * BLOCK, 4)]
    for r in rows:
        assert 0 < r["post_s"] <= r["write_s"] <= r["notified_s"]
