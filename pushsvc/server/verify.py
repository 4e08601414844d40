"""KV verify mode: digests of the blocks a WRITE moved, compared on D.

P's daemon digests every source block of a WRITE (xxh3-64, in the order the WRITE pairs
blocks) and sends the digests with ``WriteStarted``; when the completion arrives, D's
daemon digests its destination blocks in the same order and compares. On CPU both daemons
read the blocks through their own mapping of the workers' shared KV memory, without
copying; on a GPU they read them through bounded host copies (``HOST_COPY_BYTES`` at a
time, gathered on the device), D after its landing copy, so the check covers it too.
A mismatch fails the request and is counted; so is a WRITE whose digests never came.
"""

from __future__ import annotations

import ctypes

import numpy as np
import xxhash

from pushsvc.devmem.base import RowView

HOST_COPY_BYTES = 64 << 20


def digest_memory(descs: np.ndarray, indices: np.ndarray, view: RowView | None) -> bytes:
    """Digests of the blocks ``descs[indices]``: in host memory, or on the device of ``view``."""
    return digest_blocks(descs, indices) if view is None else digest_device_blocks(view, descs, indices)


def digest_device_blocks(view: RowView, descs: np.ndarray, indices: np.ndarray) -> bytes:
    out = np.empty(len(indices), dtype="<u8")
    i = 0
    while i < len(indices):
        rows: list[np.ndarray] = []
        sizes: list[int] = []
        total = 0
        j = i
        while j < len(indices) and (not sizes or total + int(descs[indices[j]][1]) <= HOST_COPY_BYTES):
            addr, length, _ = (int(x) for x in descs[indices[j]])
            first = (addr - view.origin) // view.unit
            rows.append(np.arange(first, first + length // view.unit, dtype=np.int64))
            sizes.append(length)
            total += length
            j += 1
        data = view.device.read_rows(view.space, np.concatenate(rows))
        at = 0
        for k, length in enumerate(sizes):
            out[i + k] = xxhash.xxh3_64_intdigest(data[at:at + length].tobytes())
            at += length
        i = j
    return out.tobytes()


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
