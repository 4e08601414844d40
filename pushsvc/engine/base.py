"""The transfer-engine interface the daemon is written against.

One ``Agent`` per registered worker rank. Every method is synchronous and cheap (it
posts work or polls); the daemon's single event loop is the only caller, so
implementations need no locking. Failures raise ``TransferError``.
"""

from __future__ import annotations

from enum import Enum
from typing import Protocol

import numpy as np

# Opaque handles an agent hands out and takes back; nothing else looks inside them.
DListHandle = object
XferHandle = object


class XferState(Enum):
    DONE = "DONE"
    PROC = "PROC"
    ERR = "ERR"


class Agent(Protocol):
    name: str

    def register(self, buffers: list[tuple[int, int]], mem_type: str, device: int = 0) -> None:
        """Register (address, length) buffers once, for every backend."""

    def metadata(self) -> bytes:
        """Serialized agent metadata, sent to peers in the side-channel hello."""

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer agent's metadata; returns its agent name."""

    def remove_remote(self, name: str) -> None: ...

    def prep_local(self, descs: np.ndarray, mem_type: str) -> DListHandle:
        """Prepare the local descriptor list (Nx3 address/length/device)."""

    def prep_remote(self, remote: str, descs: np.ndarray, mem_type: str) -> DListHandle: ...

    def release_dlist(self, handle: DListHandle) -> None: ...

    def write(
        self, local: DListHandle, local_idx: np.ndarray, remote: DListHandle, remote_idx: np.ndarray, notif: bytes
    ) -> tuple[XferHandle, XferState]:
        """Create and post a WRITE carrying ``notif``; returns the handle and its first state."""

    def state(self, xfer: XferHandle) -> XferState: ...

    def release(self, xfer: XferHandle) -> None: ...

    def send_notif(self, remote: str, payload: bytes) -> None: ...

    def notifs(self) -> dict[str, list[bytes]]:
        """New notifications since the last call, by sender agent name."""

    def handles(self) -> dict[str, int]:
        """Live handles by kind (registrations, dlists, xfers, remote_agents): 0 each
        once everything was released."""

    def close(self) -> None:
        """Release every handle still held, then the agent's memory registrations."""


class Engine(Protocol):
    name: str

    def create_agent(self, name: str) -> Agent: ...
