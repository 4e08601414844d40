"""The progress loop's pacing: hot passes back to back, each after giving the CPU away;
busy and idle passes on their timers; a wake runs a pass at once; a failing pass does
not stop the loop. The daemon yields only where ``poll_hot_yield`` is on."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import pytest
from daemon_fixtures import daemon_config

from pushsvc.engine.fake import FakeEngine
from pushsvc.server.daemon import Daemon
from pushsvc.server.progress import Pace, ProgressLoop, keep_cpu


class Script:
    """A pass function that reports the paces of ``paces`` in turn (then IDLE) and
    records, per pass, the loop time and how often the CPU was yielded before it."""

    def __init__(self, paces: list[Pace]) -> None:
        self.paces = list(paces)
        self.times: list[float] = []
        self.yields_before: list[int] = []
        self.yields = 0

    def step(self, now: float) -> Pace:
        self.times.append(now)
        self.yields_before.append(self.yields)
        return self.paces.pop(0) if self.paces else Pace.IDLE

    def yield_cpu(self) -> None:
        self.yields += 1


@contextlib.asynccontextmanager
async def _running(loop: ProgressLoop):
    task = asyncio.get_running_loop().create_task(loop.run())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _until(done, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not done():
            await asyncio.sleep(0.001)


async def _run_until(loop: ProgressLoop, done, timeout: float = 5.0) -> None:
    async with _running(loop):
        await _until(done, timeout)


@pytest.mark.asyncio
async def test_hot_passes_run_back_to_back_each_after_yielding_the_cpu() -> None:
    script = Script([Pace.HOT, Pace.HOT, Pace.HOT, Pace.IDLE])
    loop = ProgressLoop(script.step, busy_interval=10.0, idle_interval=10.0, yield_cpu=script.yield_cpu)
    await _run_until(loop, lambda: len(script.times) >= 4)
    # The three passes after a hot one came without a timer (10 s here) ...
    assert len(script.times) == 4
    # ... and each of them only after the CPU was offered to whoever else may run on it.
    assert script.yields_before == [0, 1, 2, 3]


@pytest.mark.asyncio
async def test_busy_and_idle_passes_do_not_yield_and_wait_for_their_timers() -> None:
    script = Script([Pace.BUSY, Pace.BUSY, Pace.IDLE])
    loop = ProgressLoop(script.step, busy_interval=0.05, idle_interval=10.0, yield_cpu=script.yield_cpu)
    await _run_until(loop, lambda: len(script.times) >= 3)
    await asyncio.sleep(0.1)  # the idle pace's timer (10 s) must not have fired
    assert len(script.times) == 3
    gaps = [b - a for a, b in zip(script.times, script.times[1:])]
    assert all(g >= 0.04 for g in gaps), gaps  # the busy timer, not back to back
    assert script.yields == 0


@pytest.mark.asyncio
async def test_a_wake_runs_a_pass_at_once_without_yielding() -> None:
    script = Script([])
    loop = ProgressLoop(script.step, busy_interval=10.0, idle_interval=10.0, yield_cpu=script.yield_cpu)
    async with _running(loop):
        await _until(lambda: script.times)
        loop.wake()
        await _until(lambda: len(script.times) >= 2)
    assert script.times[1] - script.times[0] < 5.0  # not the 10 s idle timer
    assert script.yields == 0


@pytest.mark.asyncio
async def test_a_failing_pass_is_logged_and_the_loop_goes_on_at_the_busy_pace() -> None:
    calls: list[float] = []

    def step(now: float) -> Pace:
        calls.append(now)
        if len(calls) == 1:
            raise RuntimeError("a bug in one pass")
        return Pace.IDLE

    loop = ProgressLoop(step, busy_interval=0.02, idle_interval=10.0, yield_cpu=keep_cpu)
    await _run_until(loop, lambda: len(calls) >= 2)
    assert calls[1] - calls[0] >= 0.015  # retried at the busy pace, not back to back


@pytest.mark.parametrize("setting", [True, False])
def test_the_daemon_yields_on_hot_passes_unless_configured_off(tmp_path, setting: bool) -> None:
    daemon = Daemon(daemon_config(str(tmp_path / "rt"), "yields", poll_hot_yield=setting), engine=FakeEngine())
    assert daemon.progress.yield_cpu is (os.sched_yield if setting else keep_cpu)


@pytest.mark.asyncio
async def test_each_pass_is_observed_with_the_pace_it_chose_and_how_long_it_held_the_loop() -> None:
    seen: list[tuple[Pace, float]] = []
    paces = [Pace.HOT, Pace.BUSY, Pace.IDLE]

    def step(now: float) -> Pace:
        if len(seen) == 1:
            time.sleep(0.02)  # the second pass holds the loop
        return paces[min(len(seen), 2)]

    loop = ProgressLoop(step, busy_interval=0.001, idle_interval=10.0, yield_cpu=keep_cpu,
                        observe=lambda pace, s: seen.append((pace, s)))
    await _run_until(loop, lambda: len(seen) >= 3)
    assert [p for p, _ in seen[:3]] == paces
    assert seen[1][1] >= 0.02 > seen[0][1]


@pytest.mark.asyncio
async def test_a_failing_pass_is_observed_as_busy() -> None:
    seen: list[Pace] = []

    def step(now: float) -> Pace:
        if not seen:
            raise RuntimeError("a bug in one pass")
        return Pace.IDLE

    loop = ProgressLoop(step, busy_interval=0.001, idle_interval=10.0, yield_cpu=keep_cpu,
                        observe=lambda pace, s: seen.append(pace))
    await _run_until(loop, lambda: len(seen) >= 2)
    assert seen[:2] == [Pace.BUSY, Pace.IDLE]


@pytest.mark.asyncio
async def test_the_daemon_exports_each_pass_by_pace(tmp_path) -> None:
    daemon = Daemon(daemon_config(str(tmp_path / "rt"), "passes"), engine=FakeEngine())

    def passes(pace: str) -> float:
        return daemon.metrics.registry.get_sample_value("pushsvc_progress_pass_seconds_count", {"pace": pace})

    async with _running(daemon.progress):
        await _until(lambda: passes("idle") >= 1)
        daemon.progress.wake()
        await _until(lambda: passes("idle") >= 2)
    assert passes("hot") == passes("busy") == 0  # every pace's series exists from the start
    assert daemon.metrics.registry.get_sample_value("pushsvc_progress_pass_seconds_sum", {"pace": "idle"}) > 0


class Tracked:
    """``tracking`` for busy polling: whether a request is tracked, set by the test."""

    def __init__(self, value: bool) -> None:
        self.value = value

    def __call__(self) -> bool:
        return self.value


@pytest.mark.asyncio
async def test_busy_polling_spins_after_a_wake_while_a_request_is_tracked() -> None:
    script = Script([Pace.BUSY] * 1000)
    spun: list[float] = []
    loop = ProgressLoop(script.step, busy_interval=10.0, idle_interval=10.0, yield_cpu=script.yield_cpu,
                        spin_s=30.0, tracking=Tracked(True), spun=spun.append)
    async with _running(loop):
        await _until(lambda: script.times)
        loop.wake()
        await _until(lambda: len(script.times) >= 50)
    # Busy passes came back to back, not on their 10 s timer, each after the CPU was offered ...
    assert script.yields >= 48
    # ... and every spun pass was counted with the time it held the loop.
    assert len(spun) >= 48 and all(s >= 0 for s in spun)


@pytest.mark.asyncio
async def test_busy_polling_stops_when_nothing_is_tracked() -> None:
    script = Script([Pace.BUSY] * 1000)
    tracked = Tracked(True)
    loop = ProgressLoop(script.step, busy_interval=10.0, idle_interval=10.0, yield_cpu=script.yield_cpu,
                        spin_s=30.0, tracking=tracked)
    async with _running(loop):
        loop.wake()
        await _until(lambda: len(script.times) >= 20)
        tracked.value = False
        await asyncio.sleep(0.01)
        settled = len(script.times)
        await asyncio.sleep(0.1)
        assert len(script.times) == settled  # back on the 10 s busy timer


@pytest.mark.asyncio
async def test_busy_polling_ends_spin_s_after_the_last_wake_and_timers_do_not_renew_it() -> None:
    script = Script([Pace.BUSY] * 100_000)
    spun: list[float] = []
    loop = ProgressLoop(script.step, busy_interval=0.02, idle_interval=10.0, yield_cpu=keep_cpu,
                        spin_s=0.05, tracking=Tracked(True), spun=spun.append)
    async with _running(loop):
        loop.wake()
        await asyncio.sleep(0.3)
        spinning_ended = len(spun)
        ticks = len(script.times)
        await asyncio.sleep(0.2)
    assert spinning_ended > 10  # it spun after the wake ...
    assert len(spun) == spinning_ended  # ... but not after its window, though the busy timer woke it
    assert 3 <= len(script.times) - ticks <= 15  # every 20 ms from then on


@pytest.mark.asyncio
async def test_busy_polling_off_or_without_a_wake_keeps_the_timers() -> None:
    for spin_s, woken in ((0.0, True), (30.0, False)):
        script = Script([Pace.BUSY] * 1000)
        loop = ProgressLoop(script.step, busy_interval=10.0, idle_interval=10.0, yield_cpu=script.yield_cpu,
                            spin_s=spin_s, tracking=Tracked(True))
        async with _running(loop):
            await _until(lambda: script.times)
            if woken:
                loop.wake()
                await _until(lambda: len(script.times) >= 2)
            await asyncio.sleep(0.1)
        assert len(script.times) == (2 if woken else 1), spin_s
        assert script.yields == 0


def test_the_daemon_busy_polls_as_configured(tmp_path) -> None:
    daemon = Daemon(daemon_config(str(tmp_path / "rt"), "spins", poll_spin_s=2.5), engine=FakeEngine())
    assert daemon.progress.spin_s == 2.5
    assert not daemon.service.tracking()  # nothing tracked: nothing to spin for
    assert daemon.metrics.registry.get_sample_value("pushsvc_progress_spin_seconds_total") == 0
