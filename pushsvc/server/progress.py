"""The progress loop: the only code that polls NIXL.

With NIXL's progress thread off, transfers and notifications advance only when the
owner calls into the agent. One task does that for every agent: each pass drains
notifications, checks WRITE handles and runs the lease/watchdog timers. The pace
adapts: ``busy_interval`` while anything is in flight or waiting for a match,
``idle_interval`` otherwise. ``wake()`` (called on every worker message) runs a pass
at once, so new work never waits for a tick.
"""

from __future__ import annotations

import asyncio
from typing import Callable

import structlog

log = structlog.get_logger("pushsvc.progress")


class ProgressLoop:
    def __init__(self, step: Callable[[float], bool], busy_interval: float, idle_interval: float) -> None:
        self._step = step
        self.busy_interval = busy_interval
        self.idle_interval = idle_interval
        self._wakeup: asyncio.Future[None] | None = None
        self._woken = False
        self.passes = 0

    def wake(self) -> None:
        self._woken = True
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._woken = False
            self.passes += 1
            try:
                busy = self._step(loop.time())
            except Exception:
                # A bug in one pass must not stop transfers for everyone; it is logged
                # with its traceback and the next pass runs as usual.
                log.exception("progress_pass_failed")
                busy = True
            if self._woken:
                continue
            self._wakeup = loop.create_future()
            handle = loop.call_later(self.busy_interval if busy else self.idle_interval, self.wake)
            try:
                await self._wakeup
            finally:
                handle.cancel()
                self._wakeup = None
