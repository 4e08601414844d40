"""An in-process engine for unit tests: real bytes, no NIXL.

Agents created by one ``FakeEngine`` see each other by name. A WRITE copies every
descriptor pair with memmove at post time and queues its notification at the target,
so tests check the same bytes the real engine would move. ``fail_next_write`` and
``hold_writes`` let tests drive the failure and in-flight paths.
"""

from __future__ import annotations

import ctypes
from collections import defaultdict
from typing import Any

import numpy as np

from pushsvc.engine.base import XferState
from pushsvc.errors import TransferError


class _Xfer:
    __slots__ = ("state", "run")

    def __init__(self, run) -> None:
        self.state = XferState.PROC
        self.run = run


class FakeAgent:
    def __init__(self, engine: FakeEngine, name: str) -> None:
        self.engine = engine
        self.name = name
        self.buffers: list[tuple[int, int]] = []
        self.remotes: set[str] = set()
        self.inbox: dict[str, list[bytes]] = defaultdict(list)
        self.live: set[int] = set()
        self.dlists: set[int] = set()
        self.registrations = 0
        self.closed = False

    def register(self, buffers: list[tuple[int, int]], mem_type: str, device: int = 0) -> None:
        self.buffers.extend(buffers)
        self.registrations += 1

    def metadata(self) -> bytes:
        return b"fake:" + self.name.encode()

    def add_remote(self, metadata: bytes) -> str:
        if not metadata.startswith(b"fake:"):
            raise TransferError("not fake agent metadata")
        name = metadata[5:].decode()
        self.remotes.add(name)
        return name

    def remove_remote(self, name: str) -> None:
        self.remotes.discard(name)

    def covers(self, descs: np.ndarray) -> bool:
        """Whether every descriptor lies inside memory this agent registered (NIXL refuses
        to prepare one that does not: NIXL_ERR_NOT_FOUND)."""
        if not len(descs):
            return True
        starts = descs[:, 0].astype(np.int64)
        ends = starts + descs[:, 1].astype(np.int64)
        inside = np.zeros(len(descs), dtype=bool)
        for base, size in self.buffers:
            inside |= (starts >= base) & (ends <= base + size)
        return bool(inside.all())

    def prep_local(self, descs: np.ndarray, mem_type: str) -> Any:
        if not self.covers(descs):
            raise TransferError("NIXL_ERR_NOT_FOUND: local descriptors outside registered memory")
        handle = (self.name, np.array(descs, copy=True))
        self.dlists.add(id(handle))
        return handle

    def prep_remote(self, remote: str, descs: np.ndarray, mem_type: str) -> Any:
        if remote not in self.remotes:
            raise TransferError(f"unknown remote agent {remote}")
        target = self.engine.agents.get(remote)
        if target is not None and not target.covers(descs):
            raise TransferError(f"NIXL_ERR_NOT_FOUND: descriptors of {remote} outside its registered memory")
        handle = (remote, np.array(descs, copy=True))
        self.dlists.add(id(handle))
        return handle

    def release_dlist(self, handle: Any) -> None:
        self.dlists.discard(id(handle))

    def write(self, local, local_idx, remote, remote_idx, notif: bytes):
        target_name, dst = remote
        _, src = local
        if self.engine.fail_next_write:
            self.engine.fail_next_write -= 1
            raise TransferError("injected WRITE failure")
        if len(local_idx) != len(remote_idx):
            raise TransferError("descriptor count mismatch")

        def run() -> None:
            for i, j in zip(local_idx, remote_idx):
                s_addr, s_len, _ = src[i]
                d_addr, d_len, _ = dst[j]
                if s_len != d_len:
                    raise TransferError("descriptor length mismatch")
                ctypes.memmove(int(d_addr), int(s_addr), int(s_len))
            if self.engine.corrupt_writes and len(remote_idx):
                self.engine.corrupt_writes -= 1
                byte = ctypes.c_ubyte.from_address(int(dst[remote_idx[0]][0]))
                byte.value ^= 0xFF
            target = self.engine.agents.get(target_name)
            if target is not None and notif:
                target.inbox[self.name].append(notif)

        xfer = _Xfer(run)
        self.live.add(id(xfer))
        if self.engine.hold_writes:
            self.engine.held.append(xfer)
            return xfer, XferState.PROC
        run()
        xfer.state = XferState.DONE
        return xfer, XferState.DONE

    def state(self, xfer: _Xfer) -> XferState:
        return xfer.state

    def release(self, xfer: _Xfer) -> None:
        self.live.discard(id(xfer))

    def send_notif(self, remote: str, payload: bytes) -> None:
        target = self.engine.agents.get(remote)
        if remote not in self.remotes or target is None:
            raise TransferError(f"cannot notify unknown agent {remote}")
        if remote in self.engine.unreachable:
            raise TransferError(f"injected notification failure to {remote}")
        target.inbox[self.name].append(payload)

    def notifs(self) -> dict[str, list[bytes]]:
        if not self.inbox:
            return {}
        out = dict(self.inbox)
        self.inbox.clear()
        return out

    def handles(self) -> dict[str, int]:
        return {"registrations": self.registrations, "dlists": len(self.dlists), "xfers": len(self.live),
                "remote_agents": len(self.remotes)}

    def close(self) -> None:
        self.closed = True
        self.live.clear()
        self.dlists.clear()
        self.remotes.clear()
        self.buffers.clear()
        self.registrations = 0
        self.engine.agents.pop(self.name, None)


class FakeEngine:
    name = "fake"

    def __init__(self) -> None:
        self.agents: dict[str, FakeAgent] = {}
        self.fail_next_write = 0
        self.corrupt_writes = 0  # flip one byte of the next N WRITEs' destinations
        self.hold_writes = False
        self.unreachable: set[str] = set()  # agents a notification cannot reach (send_notif raises)
        self.held: list[_Xfer] = []

    def create_agent(self, name: str) -> FakeAgent:
        if name in self.agents:
            raise TransferError(f"agent {name} exists")
        agent = self.agents[name] = FakeAgent(self, name)
        return agent

    def complete_held(self, error: bool = False) -> None:
        for xfer in self.held:
            if error:
                xfer.state = XferState.ERR
            else:
                xfer.run()
                xfer.state = XferState.DONE
        self.held.clear()
