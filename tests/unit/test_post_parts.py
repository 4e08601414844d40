"""Posting a WRITE in parts (``server/writes.py``): NIXL sends a part's notification only
when that part's state is checked and found done, so the parts posted earlier are checked
after each post; D hears of a landed part while later parts are still being posted."""

from __future__ import annotations

import numpy as np

from pushsvc.engine.base import XferState
from pushsvc.errors import TransferError
from pushsvc.protocol import notif
from pushsvc.server.writes import PushPlan, post_parts
from pushsvc.state.layout import Layout, RegionSpec, plan_write


def layout(base: int, regions: int = 8, blocks: int = 16, block_len: int = 64) -> Layout:
    return Layout(tuple(RegionSpec(base + r * blocks * block_len, block_len, blocks, block_len, 0)
                        for r in range(regions)), 1)


def push(parts: int) -> PushPlan:
    plan = plan_write(layout(1 << 20), layout(1 << 30), [[0, 1, 2, 3]], [[4, 5, 6, 7]])
    return PushPlan(plan, parts, b"", "local", np.zeros((0, 3), dtype=np.int64))


class RecordingAgent:
    """Behind the engine interface: a part is done once its state was checked ``lag``
    times; every call is recorded in order."""

    def __init__(self, lag: int = 1, fail_at: int = -1) -> None:
        self.calls: list[tuple[str, int]] = []
        self.checks: dict[int, int] = {}
        self.lag = lag
        self.fail_at = fail_at
        self.notes: list[bytes] = []

    def write(self, local, local_idx, remote, remote_idx, note: bytes):
        part = len(self.notes)
        if part == self.fail_at:
            raise TransferError("injected")
        self.notes.append(note)
        self.calls.append(("write", part))
        self.checks[part] = 0
        return part, XferState.PROC

    def state(self, handle: int) -> XferState:
        self.calls.append(("state", handle))
        self.checks[handle] += 1
        return XferState.DONE if self.checks[handle] >= self.lag else XferState.PROC

    def send_notif(self, remote: str, payload: bytes) -> None:  # pragma: no cover - no empty part here
        raise AssertionError("every part carries blocks")


def test_each_post_checks_the_parts_posted_before_it() -> None:
    agent = RecordingAgent(lag=1)
    handles, states, failed = post_parts(agent, "remote", "D", push(4), "req-1", 1)
    assert failed == "" and handles == [0, 1, 2, 3]
    # part 0 is checked right after part 1 went out (its notification goes to D then),
    # and not again once it reported done
    assert agent.calls == [("write", 0), ("write", 1), ("state", 0), ("write", 2), ("state", 1),
                           ("write", 3), ("state", 2)]
    assert states == [XferState.DONE, XferState.DONE, XferState.DONE, XferState.PROC]
    assert [notif.decode_notification(n)[2:] for n in agent.notes] == [(i, 4) for i in range(4)]


def test_a_part_still_moving_is_checked_again_after_the_next_post() -> None:
    agent = RecordingAgent(lag=2)
    handles, states, _ = post_parts(agent, "remote", "D", push(3), "req-1", 1)
    assert agent.calls == [("write", 0), ("write", 1), ("state", 0), ("write", 2), ("state", 0), ("state", 1)]
    assert states == [XferState.DONE, XferState.PROC, XferState.PROC]


def test_one_part_is_posted_without_a_check() -> None:
    agent = RecordingAgent()
    handles, states, _ = post_parts(agent, "remote", "D", push(1), "req-1", 1)
    assert agent.calls == [("write", 0)] and states == [XferState.PROC]


def test_a_part_that_fails_to_post_stops_posting_with_the_latest_states() -> None:
    agent = RecordingAgent(lag=1, fail_at=2)
    handles, states, failed = post_parts(agent, "remote", "D", push(4), "req-1", 1)
    assert failed == "injected" and handles == [0, 1]
    assert states == [XferState.DONE, XferState.PROC]  # part 0 checked after part 1's post
