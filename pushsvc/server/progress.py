"""The progress loop: the only code that polls NIXL.

With NIXL's progress thread off, transfers and notifications advance only when the
owner calls into the agent. One task does that for every agent: each pass drains
notifications, checks WRITE handles and runs the lease/watchdog timers. The pace
adapts to what the pass reports:

* ``Pace.HOT``: a WRITE is moving (ours, or the peer's into us, announced over the
  side channel). Passes run back to back, yielding to the loop in between. Measured:
  a WRITE completes only when *both* agents make progress, so a 64 KiB push takes
  ~1 ms when the target polls every 0.5 ms and ~0.05 ms when it polls continuously.
  Hot passes last only as long as the transfer (bounded by ``hot_max_s``). Before each
  one the loop offers its CPU to any other process waiting for it (``yield_cpu``,
  ``sched_yield``; nothing happens where none waits): the side channel's wake-up puts
  D's daemon on the CPU of P's daemon, which is then still posting, and two loops
  spinning on one CPU otherwise take turns only at the scheduler's time slice
  (docs/architecture.md, "Why a hot pace").
* ``Pace.BUSY``: registrations or blocks wait for their match: ``busy_interval``.
* ``Pace.IDLE``: nothing tracked: ``idle_interval``.

``wake()`` (called on every worker message) runs a pass at once, so new work never
waits for a tick. Every pass is timed and handed to ``observe`` with the pace it chose
(``pushsvc_progress_pass_seconds``): how long the loop was held between two chances to
see a notification, a worker message or a finished copy.

Busy polling (``spin_s > 0``: ``poll_spin_s``, off by default): for ``spin_s`` after each
wake, while ``tracking()`` says a request is still tracked, passes that would wait for a
timer run back to back instead, as hot ones do. Between a request's arrival and its push
the loop then never sleeps, and the push finds it awake and its CPU too, at the cost of
a core for as long as requests wait (docs/architecture.md, "Busy polling while requests
wait"). ``spun`` is told how long each spun pass held the loop, the turn after
it included (``pushsvc_progress_spin_seconds_total``).
"""

from __future__ import annotations

import asyncio
import enum
import os
import time
from typing import Callable

import structlog

log = structlog.get_logger("pushsvc.progress")


class Pace(enum.IntEnum):
    IDLE = 0
    BUSY = 1
    HOT = 2


def keep_cpu() -> None:
    """``yield_cpu`` where yielding is off (``poll_hot_yield = false``): keep the CPU."""


def unobserved(pace: Pace, seconds: float) -> None:
    """``observe`` where nothing records the passes."""


def nothing_tracked() -> bool:
    """``tracking`` where busy polling is off."""
    return False


def unrecorded(seconds: float) -> None:
    """``spun`` where nothing records busy polling."""


class ProgressLoop:
    def __init__(self, step: Callable[[float], Pace], busy_interval: float, idle_interval: float,
                 yield_cpu: Callable[[], None] = os.sched_yield,
                 observe: Callable[[Pace, float], None] = unobserved, spin_s: float = 0.0,
                 tracking: Callable[[], bool] = nothing_tracked, spun: Callable[[float], None] = unrecorded) -> None:
        self._step = step
        self.yield_cpu = yield_cpu  # before each hot or spun pass (a no-op where that is off)
        self._observe = observe  # each pass: the pace it chose, its wall-clock seconds
        self.busy_interval = busy_interval
        self.idle_interval = idle_interval
        self.spin_s = spin_s  # busy polling after each wake; 0: off
        self._tracking = tracking  # a request is tracked: worth spinning for
        self._spun = spun  # seconds the loop spun, after each spun pass
        self._spin_until = 0.0  # time.monotonic() until which it may spin
        self._wakeup: asyncio.Future[None] | None = None
        self._woken = False

    def wake(self) -> None:
        """New work: a pass runs at once (and busy polling, where on, may go on for
        ``spin_s`` from now)."""
        if self.spin_s:
            self._spin_until = time.monotonic() + self.spin_s
        self._rouse()

    def _rouse(self) -> None:
        self._woken = True
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        spinning_since: float | None = None  # the start of the last pass, if it chose to spin
        while True:
            self._woken = False
            started = time.perf_counter()
            if spinning_since is not None:
                self._spun(started - spinning_since)
                spinning_since = None
            try:
                pace = self._step(loop.time())
            except Exception:
                # A bug in one pass must not stop transfers for everyone; it is logged
                # with its traceback and the next pass runs as usual.
                log.exception("progress_pass_failed")
                pace = Pace.BUSY
            self._observe(pace, time.perf_counter() - started)
            if pace is Pace.HOT:
                self.yield_cpu()  # another process on this CPU runs first, if one waits
                await asyncio.sleep(0)  # let sockets and timers run, then poll again
                continue
            if self._spinning():
                spinning_since = started  # this pass and the turn of the loop after it
                self.yield_cpu()
                await asyncio.sleep(0)
                continue
            if self._woken:
                continue
            self._wakeup = loop.create_future()
            handle = loop.call_later(self.busy_interval if pace is Pace.BUSY else self.idle_interval, self._rouse)
            try:
                await self._wakeup
            finally:
                handle.cancel()
                self._wakeup = None

    def _spinning(self) -> bool:
        """Busy polling: on, within ``spin_s`` of the last wake, a request still tracked."""
        return bool(self.spin_s) and time.monotonic() < self._spin_until and self._tracking()
