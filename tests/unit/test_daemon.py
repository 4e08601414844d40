"""Daemon lifecycle and the HTTP health server, in-process over the fake engine."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import tempfile

import numpy as np
import pytest
from daemon_fixtures import (
    LONG_S,
    P_ENGINE,
    ZERO_TABLES,
    Worker,
    assert_tables_empty,
    daemon_config,
    expected_after_push,
    http_get,
    push_pair,
    running_daemon,
    wait_until,
)

from pushsvc.engine.fake import FakeEngine
from pushsvc.protocol import worker as wp
from pushsvc.server.daemon import Daemon

METRIC_NAMES = [
    "pushsvc_transfers",
    "pushsvc_transfer_bytes",
    "pushsvc_transfer_blocks",
    "pushsvc_transfer_seconds",
    "pushsvc_match_wait_seconds",
    "pushsvc_recv_seconds",
    "pushsvc_handshake_seconds",
    "pushsvc_handshakes",
    "pushsvc_failures",
    "pushsvc_leases_expired",
    "pushsvc_watchdog_expired",
    "pushsvc_malformed_inputs",
    "pushsvc_duplicates",
    "pushsvc_rejected_connections",
    "pushsvc_table_entries",
    "pushsvc_worker_connections",
    "pushsvc_peers",
    "pushsvc_agents",
    "pushsvc_inflight_writes",
    "pushsvc_worker_messages",
    "pushsvc_notifications",
]


# ---------------------------------------------------------------- lifecycle


@pytest.mark.asyncio
async def test_startup_and_shutdown_are_idempotent() -> None:
    base = tempfile.mkdtemp(prefix="ps")
    try:
        daemon = Daemon(daemon_config(f"{base}/rt", "life"), engine=FakeEngine())
        await daemon.shutdown()  # before startup: nothing to do, and startup still works after it
        assert not daemon.stopped
        await daemon.startup()
        port = daemon.service.peers.port
        await daemon.startup()
        assert daemon.service.peers.port == port
        assert os.path.exists(daemon.config.socket_path)
        status, _ = await http_get(daemon, "/healthz")
        assert status == 200
        await daemon.shutdown()
        await daemon.shutdown()
        assert daemon.stopped
        assert not os.path.exists(daemon.config.socket_path)
        assert not daemon.service.ranks.all()
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.asyncio
async def test_async_context_manager_and_serve_until_exit_requested() -> None:
    base = tempfile.mkdtemp(prefix="ps")
    try:
        async with Daemon(daemon_config(f"{base}/a", "ctx"), engine=FakeEngine()) as daemon:
            assert daemon.started and not daemon.stopped
        assert daemon.stopped

        daemon = Daemon(daemon_config(f"{base}/b", "srv"), engine=FakeEngine())
        task = asyncio.get_running_loop().create_task(daemon.serve(install_signals=False))
        await wait_until(lambda: daemon.started and daemon.health.port > 0, "serve() to start")
        daemon.request_exit()
        await asyncio.wait_for(task, 5.0)
        assert daemon.stopped
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------- health server


@pytest.mark.asyncio
async def test_healthz_and_readyz_track_worker_registration_and_shutdown() -> None:
    async with running_daemon(FakeEngine(), "ready") as daemon:
        assert await http_get(daemon, "/healthz") == (200, {"status": "ok"})
        status, body = await http_get(daemon, "/readyz")
        assert status == 200 and body["ready"] is True

        worker = Worker(daemon, "both")
        try:
            await worker.connect()
            status, body = await http_get(daemon, "/readyz")
            assert status == 503
            assert body["agents"] == 1 and body["agents_registered"] == 0

            await worker.register(4)
            status, body = await http_get(daemon, "/readyz")
            assert status == 200 and body["agents_registered"] == 1

            daemon.request_exit()
            status, body = await http_get(daemon, "/readyz")
            assert status == 503 and body["ready"] is False
            assert (await http_get(daemon, "/healthz"))[0] == 200
        finally:
            worker.close()


@pytest.mark.asyncio
async def test_metrics_names_every_metric() -> None:
    async with running_daemon(FakeEngine(), "metrics") as daemon:
        status, text = await http_get(daemon, "/metrics")
        assert status == 200
        for name in METRIC_NAMES:
            # Counters are exposed with their ``_total`` suffix.
            assert re.search(rf"^# TYPE {name}(_total)? (counter|gauge|histogram)$", text, re.MULTILINE), name


@pytest.mark.asyncio
async def test_info_reports_identity_ports_and_tables() -> None:
    async with running_daemon(FakeEngine(), "info") as daemon:
        _, before = await http_get(daemon, "/v1/info")
        worker = Worker(daemon, "producer", rank=0)
        try:
            await worker.start(4)
            status, info = await http_get(daemon, "/v1/info")
        finally:
            worker.close()
        assert "tp_size" not in before, "no worker yet: the engine's TP size is not known"
        assert info["tp_size"] == 1  # a proxy passes it to D as remote_tp_size
        assert status == 200
        assert info["engine_id"] == "info"
        assert info["daemon_id"] == daemon.daemon_id
        assert info["side_channel_port"] == daemon.service.peers.port > 0
        assert info["health_port"] == daemon.health.port
        assert info["socket_path"] == daemon.config.socket_path
        assert info["tables"] == ZERO_TABLES
        assert [(a["rank"], a["role"], a["registered"], a["worker_connected"]) for a in info["agents"]] == [
            (0, "producer", True, True)
        ]


# ---------------------------------------------------------------- draining


async def _held_push(pair) -> None:
    pair.fake.hold_writes = True
    pair.register_recv("cmpl-a-0-11111111", [3, 4])
    await wait_until(lambda: pair.p.info()["tables"]["p_registrations"] == 1, "the PUSH_REG to reach P")
    pair.send_ready("cmpl-a-0-22222222", [0, 1])
    await wait_until(lambda: pair.p.info()["tables"]["inflight"] == 1, "the WRITE to be posted")


@pytest.mark.asyncio
async def test_shutdown_waits_for_a_held_write_then_finishes() -> None:
    async with push_pair(p_config={"drain_timeout_s": LONG_S}) as pair:
        await _held_push(pair)
        shutdown = asyncio.get_running_loop().create_task(pair.p.shutdown())
        try:
            await wait_until(lambda: not pair.p.workers.listening, "the drain to start")
            status, body = await http_get(pair.p, "/readyz")
            assert status == 503 and body["socket_listening"] is False
            await pair.pw.quiet_for(0.2)
            assert not shutdown.done(), "shutdown must wait for the WRITE in flight"
            pair.fake.complete_held()
            # The worker connection outlives the drain, so P's worker still hears the outcome.
            await pair.pw.wait_for(wp.SendDone, "cmpl-a-0-22222222")
            await pair.dw.wait_for(wp.RecvDone, "cmpl-a-0-11111111")
            await asyncio.wait_for(asyncio.shield(shutdown), 5.0)
        finally:
            await shutdown
        assert np.array_equal(pair.dw.snapshot(), expected_after_push(pair.pw, pair.dw, [0, 1], [3, 4]))
        assert not any(name.startswith(P_ENGINE) for name in pair.fake.agents)
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_shutdown_gives_up_on_a_write_that_never_settles() -> None:
    async with push_pair(p_config={"drain_timeout_s": 0.3},
                         d_config={"peer_timeout_s": 1.0, "heartbeat_interval_s": 0.2}) as pair:
        await _held_push(pair)
        await asyncio.wait_for(pair.p.shutdown(), 5.0)
        assert pair.p.stopped
        assert pair.fake.held, "the WRITE never settled"
        assert not any(name.startswith(P_ENGINE) for name in pair.fake.agents), "P's agent is released anyway"
        # The WRITE was announced and P left without settling it: D holds the blocks
        # for its cancel grace rather than handing them back while bytes may land...
        await wait_until(lambda: pair.d.info()["peers"] == [], "D to see P leave")
        assert pair.d.info()["tables"]["d_pending"] == 1
        # ...and then fails the request instead of waiting for its watchdog.
        failed = await pair.dw.wait_for(wp.RecvFailed, "cmpl-a-0-11111111")
        assert "peer_lost" in failed.reason
        assert np.array_equal(pair.dw.snapshot(), pair.dw.initial)
        await assert_tables_empty(pair.p, pair.d)
        pair.fake.held.clear()  # P's memory is unmapped: the held WRITE must never run now


@pytest.mark.asyncio
async def test_an_authenticated_new_incarnation_of_p_frees_blocks_held_for_the_old_one_at_once() -> None:
    # A long grace, so only P's restart can end the hold within the test.
    async with push_pair(p_config={"drain_timeout_s": 0.3}, d_config={"peer_timeout_s": 60.0},
                         authenticated=True) as pair:
        await _held_push(pair)
        await asyncio.wait_for(pair.p.shutdown(), 5.0)
        await wait_until(lambda: pair.d.info()["peers"] == [], "D to see P leave")
        assert pair.d.info()["tables"]["d_pending"] == 1, "held while the old P may still write"
        secret = pair.p.config.side_channel_secret_file
        async with running_daemon(pair.fake, P_ENGINE, side_channel_secret_file=secret) as p2:
            pw2 = Worker(p2, "producer")
            await pw2.start(8)
            try:
                # D's next registration dials the new P; its hello shows the old one is dead.
                pair.register_recv("cmpl-b-0-11111111", [5, 6], remote_port=p2.service.peers.port)
                failed = await pair.dw.wait_for(wp.RecvFailed, "cmpl-a-0-11111111")
                assert "restarted" in failed.reason
                await wait_until(lambda: p2.info()["tables"]["p_registrations"] == 1, "the new P to get the PUSH_REG")
                pair.dw.send(wp.Evict(request_ids=["cmpl-b-0-11111111"]))
                await pair.dw.wait_for(wp.RecvFailed, "cmpl-b-0-11111111")
            finally:
                pw2.client.close()
        pair.fake.held.clear()
