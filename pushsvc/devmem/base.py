"""The device-memory interface the daemon is written against (docs/gpu.md).

One ``DeviceMemory`` per daemon; one ``Device`` per GPU it touches, found by UUID; one
``Copier`` per rank with a landing buffer. Every method runs on the event loop and
returns at once, except ``Device.read`` (verify mode's host copies) and ``synchronize``
(shutdown). A copy's completion is a ``CopyJob`` the progress loop polls. Failures raise
``DeviceError``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from pushsvc.state.landing import CopyPlan, SlotRun


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


class Copier(Protocol):
    """The copies of one rank's landing buffer into its worker's KV, as ``plan`` says."""

    plan: CopyPlan
    nbytes: int  # device memory it holds (its copy table and slot map)

    def map(self, group: int, slots: np.ndarray, blocks: np.ndarray) -> SlotRun:
        """Set the slot -> block map of physical ``slots`` (one ascending run) of ``group``
        to the worker's physical ``blocks``, pairwise, on the device's copy stream (before
        any later copy). Done when the slots are granted, so that a part's copy, on the path
        a WRITE's completion waits for, only launches. ``DeviceError`` for pairs
        ``check_pairs`` refuses for any entry of the group."""

    def launch(self, run: SlotRun, first: int, count: int) -> CopyJob:
        """Copy the pairs ``run`` mapped for entries ``first .. first + count`` of the plan
        (of ``run``'s group), on the device's copy stream. Returns at once; ``DeviceError``
        for entries ``check_launch`` refuses."""

    def close(self) -> None:
        """Give its memory back (no copy of it may be in flight)."""


class PairCopier(Protocol):
    """P's copies from its rank's KV into one same-host D's KV, both mapped here
    (``CopyPlan.build_pairs``)."""

    plan: CopyPlan
    nbytes: int  # device memory it holds (its copy table)

    def launch(self, group: int, src: np.ndarray, dst: np.ndarray, entries: tuple[int, int] | None = None) -> CopyJob:
        """Copy source block ``src[i]`` to destination block ``dst[i]`` in every entry of
        ``group`` (or the run ``entries`` = (first, count) of them: a layer's regions), on
        the device's copy stream. Returns at once; ``DeviceError`` for entries not of
        ``group`` (``group_entries``) and pairs ``check_pair_ids`` refuses."""

    def close(self) -> None:
        """Give its memory back (no copy of it may be in flight)."""


class DeviceEvent(Protocol):
    """Another process's interprocess event, opened here (layer-wise push: a worker
    records it after a layer's kernels)."""

    def done(self) -> bool:
        """Whether the work before its last record finished (never blocks)."""

    def close(self) -> None: ...


class Device(Protocol):
    ordinal: int  # the device's number in this process (NIXL's device id)
    uuid: bytes

    def import_event(self, handle: bytes) -> DeviceEvent:
        """Open another process's interprocess event from its CUDA IPC handle."""

    def import_ipc(self, handle: bytes) -> DeviceBuffer:
        """Open another process's allocation from its CUDA IPC handle."""

    def allocate(self, nbytes: int) -> DeviceBuffer:
        """Allocate plain device memory owned by this process (a WRITE destination)."""

    def copier(self, plan: CopyPlan) -> Copier: ...

    def pair_copier(self, plan: CopyPlan) -> PairCopier: ...

    def read(self, address: int, nbytes: int) -> bytes:
        """``nbytes`` of device memory from ``address``, on the host (blocks until copied)."""

    def synchronize(self) -> None: ...


class DeviceMemory(Protocol):
    name: str

    def device(self, uuid: bytes) -> Device:
        """The device with this UUID (``DeviceError`` if this process does not see it)."""

    def usage(self) -> dict[str, int]:
        """Bytes held now: ``imported`` (workers' memory mapped) and ``allocated`` (owned)."""

    def close(self) -> None: ...
