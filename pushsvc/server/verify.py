"""KV verify mode: digests of the blocks a WRITE moved, compared on D.

P's daemon digests every source block of a WRITE (xxh3-64, in the order the WRITE pairs
blocks) and sends the digests with ``WriteStarted``; when the completion arrives, D's
daemon digests its destination blocks in the same order and compares. Both daemons read
the blocks through their own mapping of the workers' shared KV memory, without copying.
A mismatch fails the request and is counted; so is a WRITE whose digests never came.
"""

from __future__ import annotations

import ctypes

import numpy as np
import xxhash


def digest_blocks(descs: np.ndarray, indices: np.ndarray) -> bytes:
    """xxh3-64 of each descriptor's bytes, as little-endian u64s."""
    out = np.empty(len(indices), dtype="<u8")
    for i, idx in enumerate(indices):
        addr, length, _ = descs[idx]
        out[i] = xxhash.xxh3_64_intdigest((ctypes.c_char * int(length)).from_address(int(addr)))
    return out.tobytes()


def count_mismatches(expected: bytes, actual: bytes) -> int:
    """Blocks whose digests differ (every block, if the counts differ)."""
    if len(expected) != len(actual):
        return max(len(expected), len(actual)) // 8
    a = np.frombuffer(expected, dtype="<u8")
    b = np.frombuffer(actual, dtype="<u8")
    return int(np.count_nonzero(a != b))
