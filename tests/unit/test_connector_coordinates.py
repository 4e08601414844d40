"""DaemonCoordinates: P's daemon coordinates for the params P returns, looked up without
ever blocking vLLM's scheduler thread."""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator

import pytest
from daemon_fixtures import P_ENGINE, daemon_config, wait_until

from pushsvc.client import DescribeExchange
from pushsvc.engine.fake import FakeEngine
from pushsvc.errors import DaemonNotListening
from pushsvc.server.daemon import Daemon
from pushsvc_connector.coordinates import DaemonCoordinates


@pytest.fixture
def base() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="pc")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_get_never_blocks_on_a_daemon_that_accepts_and_never_answers(base) -> None:
    """Regression: get() asked the daemon with a blocking describe (up to 0.5 s, once a
    second) on vLLM's scheduler thread."""
    path = f"{base}/silent.sock"
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(path)
    silent.listen(512)  # connections complete in the backlog; nobody ever answers
    coords = None
    try:
        # Construction may wait, bounded by timeout_s; a get() that asked the daemon the
        # blocking way would wait as long every time, so the bound below is far below it
        # (a scheduling hiccup on a busy host is not mistaken for a blocking call).
        coords = DaemonCoordinates(path, 1, timeout_s=0.25, refresh_s=0.0)
        slowest = 0.0
        deadline = time.monotonic() + 1.0  # several refresh exchanges started and abandoned
        calls = 0
        while time.monotonic() < deadline:
            started = time.perf_counter()
            assert coords.get() is None
            slowest = max(slowest, time.perf_counter() - started)
            calls += 1
            time.sleep(0.001)
        assert slowest < 0.1, f"get() took {slowest * 1e3:.1f} ms (a blocking ask waits 250 ms)"
        assert calls > 100
    finally:
        if coords is not None:
            coords.close()
        silent.close()


@pytest.mark.asyncio
async def test_coordinates_follow_a_restarted_daemon(base) -> None:
    config = daemon_config(f"{base}/rt", P_ENGINE)
    daemon = Daemon(config, engine=FakeEngine())
    await daemon.startup()
    try:
        coords = await asyncio.to_thread(DaemonCoordinates, config.socket_path, 2, refresh_s=0.0)
        assert coords.get() == {"remote_engine_id": P_ENGINE, "remote_host": config.advertised_host,
                                "remote_port": daemon.service.peers.port, "remote_tp_size": 2}
        old_port = daemon.service.peers.port
    finally:
        await daemon.shutdown()
    assert coords.get()["remote_port"] == old_port  # the last answer, while nobody answers
    again = Daemon(daemon_config(f"{base}/rt", P_ENGINE, side_channel_port=_free_port(other_than=old_port)),
                   engine=FakeEngine())
    await again.startup()
    try:
        # Each get() only advances the exchange; this loop's daemon answers in between.
        await wait_until(lambda: coords.get()["remote_port"] == again.service.peers.port,
                         "the restarted daemon's side-channel port")
    finally:
        coords.close()
        await again.shutdown()


def _free_port(other_than: int) -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port != other_than:
            return port


def test_nothing_listening_is_reported_at_once(base) -> None:
    with pytest.raises(DaemonNotListening):
        DescribeExchange(f"{base}/absent.sock")
    coords = DaemonCoordinates(f"{base}/absent.sock", 1, refresh_s=0.0)
    assert coords.get() is None
