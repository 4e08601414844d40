"""The device-memory interface the daemon is written against (docs/gpu.md).

One ``DeviceMemory`` per daemon; one ``Device`` per GPU it touches, found by UUID. Every
method runs on the event loop and returns at once, except ``read_rows`` (verify mode's
bounded host copies) and ``synchronize`` (shutdown). A copy's completion is a ``CopyJob``
the progress loop polls. Failures raise ``DeviceError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pushsvc.state.landing import CopyRows


class DeviceBuffer(Protocol):
    """Device memory this process mapped (an import) or allocated; ``close`` gives it back."""

    address: int
    size: int

    def close(self) -> None: ...


class CopyJob(Protocol):
    def done(self) -> bool:
        """Whether the copy finished (never blocks)."""

    def wait(self) -> None:
        """Block until it finished (shutdown only)."""


RowSpace = object  # a view of device memory as rows of ``unit`` bytes, made by ``Device.row_space``
DeviceRows = object  # a ``CopyRows`` template resident on the device


class Device(Protocol):
    ordinal: int  # the device's number in this process (NIXL's device id)
    uuid: bytes

    def import_ipc(self, handle: bytes) -> DeviceBuffer:
        """Open another process's allocation from its CUDA IPC handle."""

    def allocate(self, nbytes: int) -> DeviceBuffer:
        """Allocate plain device memory owned by this process (a WRITE destination)."""

    def row_space(self, origin: int, nbytes: int, unit: int) -> RowSpace:
        """``nbytes`` from ``origin`` as rows of ``unit`` bytes (no copy, no ownership)."""

    def upload_rows(self, rows: CopyRows) -> DeviceRows: ...

    def gather(self, dst: RowSpace, rows: DeviceRows, blocks: np.ndarray, src: RowSpace, slots: np.ndarray) -> CopyJob:
        """Copy the rows of physical landing ``slots`` of ``src`` to the rows of the
        worker's physical ``blocks`` (pairwise) of ``dst``, as ``landing.copy_rows`` maps
        them, on this device's copy stream. Returns at once."""

    def read_rows(self, space: RowSpace, rows: np.ndarray) -> np.ndarray:
        """The bytes of ``rows`` of ``space`` on the host, in order (blocks until copied)."""

    def synchronize(self) -> None: ...


class DeviceMemory(Protocol):
    name: str

    def device(self, uuid: bytes) -> Device:
        """The device with this UUID (``DeviceError`` if this process does not see it)."""

    def usage(self) -> dict[str, int]:
        """Bytes held now: ``imported`` (workers' memory mapped) and ``allocated`` (owned)."""

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class RowView:
    """A range of device memory seen as rows: byte ``origin + i * unit`` starts row ``i``."""

    device: Device
    space: RowSpace
    origin: int
    unit: int
