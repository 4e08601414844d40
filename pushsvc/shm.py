"""Shared memory for KV caches on CPU: memfds, mapped by worker and daemon alike.

``SharedBuffer`` is a memfd plus a MAP_SHARED mapping. The worker creates one per KV
buffer (or re-backs an existing tensor's pages with ``rebind_pages``), sends the fd to
its daemon with SCM_RIGHTS, and the daemon maps the same pages and registers them with
NIXL: a WRITE from a peer lands directly in the worker's KV cache, no copy.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os

PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _round_up(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


class SharedBuffer:
    """A memfd of ``size`` bytes mapped read-write at ``address``."""

    __slots__ = ("fd", "size", "address", "_owns_map")

    def __init__(self, fd: int, size: int, address: int, owns_map: bool = True) -> None:
        self.fd = fd
        self.size = size
        self.address = address
        self._owns_map = owns_map

    @classmethod
    def create(cls, size: int, name: str = "pushsvc-kv") -> SharedBuffer:
        fd = new_memfd(name, _round_up(size))
        try:
            return cls(fd, size, map_fd(fd, _round_up(size)))
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int) -> SharedBuffer:
        """Map a received fd whole; takes ownership of ``fd``."""
        size = os.fstat(fd).st_size
        if size <= 0:
            raise OSError(f"fd {fd} has no pages to map")
        return cls(fd, size, map_fd(fd, size))

    def view(self):
        """A writable memoryview over the mapping (for tests and the demo)."""
        return (ctypes.c_char * self.size).from_address(self.address)

    def close(self) -> None:
        if self.address and self._owns_map:
            _libc.munmap(self.address, _round_up(self.size))
        self.address = 0
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __repr__(self) -> str:
        return f"<SharedBuffer fd={self.fd} size={self.size} addr={self.address:#x}>"


def new_memfd(name: str, size: int) -> int:
    """A memfd of ``size`` bytes sealed against shrinking: a daemon that maps it can
    never be made to fault (SIGBUS) by a truncation, so it maps only memfds so sealed."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_fd(fd: int, size: int, address: int = 0) -> int:
    flags = mmap.MAP_SHARED | (0x10 if address else 0)  # MAP_FIXED
    addr = _libc.mmap(address or None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of fd {fd} failed: {os.strerror(err)}")
    return addr


def rebind_pages(address: int, size: int, name: str = "pushsvc-kv") -> SharedBuffer:
    """Re-back ``size`` bytes of existing, page-aligned memory by a new memfd in place.

    The bytes are copied into the memfd, then the memfd is mapped MAP_FIXED over the
    same range, so every pointer into it (a torch tensor and its views) stays valid
    and now sees memory another process can map.
    """
    if address % PAGE:
        raise ValueError(f"address {address:#x} is not page aligned")
    length = _round_up(size)
    fd = new_memfd(name, length)
    try:
        tmp = map_fd(fd, length)
        ctypes.memmove(tmp, address, size)
        _libc.munmap(tmp, length)
        map_fd(fd, length, address)
    except BaseException:
        os.close(fd)
        raise
    # The range still belongs to its original allocator, which will free it.
    return SharedBuffer(fd, size, address, owns_map=False)
