"""KV verify mode: digests of the blocks a WRITE moved, compared on D.

P's daemon digests every source block of a WRITE (xxh3-64, in the order the WRITE pairs
blocks) and sends the digests with ``WriteStarted``; when the completion arrives, D's
daemon digests its destination blocks in the same order and compares. On CPU both daemons
read the blocks through their own mapping of the workers' shared KV memory, without
copying; on a GPU they read them through host copies (runs of adjacent blocks, ``HOST_COPY_BYTES``
at most), D after its landing copy, so the check covers it too.
A mismatch fails the request and is counted; so is a WRITE whose digests never came.
"""

from __future__ import annotations

import ctypes

import numpy as np
import xxhash

from pushsvc.devmem.base import Device

HOST_COPY_BYTES = 64 << 20


def digest_memory(descs: np.ndarray, indices: np.ndarray, device: Device | None) -> bytes:
    """Digests of the blocks ``descs[indices]``: in host memory, or on ``device``."""
    return digest_blocks(descs, indices) if device is None else digest_device_blocks(device, descs, indices)


def digest_device_blocks(device: Device, descs: np.ndarray, indices: np.ndarray) -> bytes:
    """The blocks copied to the host in runs (blocks adjacent in memory and in order go in
    one copy) of at most ``HOST_COPY_BYTES``, then digested."""
    out = np.empty(len(indices), dtype="<u8")
    i = 0
    while i < len(indices):
        start, total, _ = (int(x) for x in descs[indices[i]])
        lengths = [total]
        j = i + 1
        while j < len(indices):
            addr, length, _ = (int(x) for x in descs[indices[j]])
            if addr != start + total or total + length > HOST_COPY_BYTES:
                break
            lengths.append(length)
            total += length
            j += 1
        data = memoryview(device.read(start, total))
        at = 0
        for k, length in enumerate(lengths):
            out[i + k] = xxhash.xxh3_64_intdigest(data[at:at + length])
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
