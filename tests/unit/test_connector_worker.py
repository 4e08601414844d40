"""PushWorker (the connector's worker side) against a real in-process daemon: events
become vLLM's finished sets, and losing the daemon fails nothing silently."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile

import pytest
from daemon_fixtures import BLOCK_LEN, D_ENGINE, daemon_config, kv_regions, wait_until

from pushsvc.engine.fake import FakeEngine
from pushsvc.protocol import worker as wp
from pushsvc.server.daemon import Daemon
from pushsvc.shm import SharedBuffer
from pushsvc_connector.metadata import PushsvcMetadata
from pushsvc_connector.worker import PushWorker

NUM_BLOCKS = 16


def _registration(rid: str, blocks: list[int]) -> wp.RegisterRecv:
    # P's side channel is a closed port: the daemon's handshake fails, promptly.
    return wp.RegisterRecv(request_id=rid, local_block_ids=[blocks], remote_engine_id="prefill",
                           remote_host="127.0.0.1", remote_port=1)


async def _finished(worker: PushWorker, timeout: float = 5.0) -> tuple[set[str], set[str]]:
    sending: set[str] = set()
    recving: set[str] = set()

    def got_any() -> bool:
        s, r = worker.get_finished()
        sending.update(s)
        recving.update(r)
        return bool(sending or recving)

    await wait_until(got_any, "the worker to report a finished transfer", timeout)
    return sending, recving


@pytest.fixture
def silent_port():
    """A loopback listener that accepts and never answers: handshakes with it hang
    until their timeout, keeping registrations pending."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    yield srv.getsockname()[1]
    srv.close()


@pytest.fixture
def base():
    path = tempfile.mkdtemp(prefix="pw")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.asyncio
async def test_failed_receive_reports_finished_with_load_errors(base) -> None:
    daemon = Daemon(daemon_config(f"{base}/rt", D_ENGINE), engine=FakeEngine())
    await daemon.startup()
    buf = SharedBuffer.create(2 * NUM_BLOCKS * BLOCK_LEN)
    worker = PushWorker(socket_path=daemon.config.socket_path, rank=0, tp_size=1, role="consumer",
                        connect_timeout_s=5.0)
    try:
        await asyncio.to_thread(worker.register, [buf], kv_regions(NUM_BLOCKS), 1)
        worker.start_step(PushsvcMetadata(recvs={"r1": _registration("r1", [3, 5])}))
        sending, recving = await _finished(worker)
        assert (sending, recving) == (set(), {"r1"})
        assert worker.take_load_errors() == {3, 5}
        assert worker.take_load_errors() == set()
    finally:
        worker.close()
        await daemon.shutdown()


@pytest.mark.asyncio
async def test_daemon_loss_fails_in_flight_and_reconnects(base, silent_port) -> None:
    config = daemon_config(f"{base}/rt", D_ENGINE, watchdog_s=60.0)
    daemon = Daemon(config, engine=FakeEngine())
    await daemon.startup()
    buf = SharedBuffer.create(2 * NUM_BLOCKS * BLOCK_LEN)
    worker = PushWorker(socket_path=config.socket_path, rank=0, tp_size=1, role="both", connect_timeout_s=5.0,
                        reconnect_interval_s=0.05)
    try:
        await asyncio.to_thread(worker.register, [buf], kv_regions(NUM_BLOCKS), 1)
        # A registration whose handshake with P never completes, and a send.
        reg = wp.RegisterRecv(request_id="waiting", local_block_ids=[[7]], remote_engine_id="prefill",
                              remote_host="127.0.0.1", remote_port=silent_port)
        sent = wp.SendReady(request_id="sent", block_ids=[[1, 2]])
        worker.start_step(PushsvcMetadata(recvs={"waiting": reg}, sends={"sent": sent}))
        await wait_until(lambda: daemon.info()["tables"]["d_pending"] == 1 and daemon.info()["tables"]["p_staged"] == 1,
                         "the daemon to track both requests")
        await daemon.shutdown()  # the daemon goes away with both in flight
        sending, recving = await _finished(worker)
        assert sending == {"sent"} and recving == {"waiting"}
        assert worker.take_load_errors() == {7}
        # New work fails fast while the daemon is away.
        worker.start_step(PushsvcMetadata(recvs={"meanwhile": _registration("meanwhile", [9])}))
        assert worker.get_finished() == (set(), {"meanwhile"})
        assert worker.take_load_errors() == {9}
        # The daemon comes back on the same socket: the worker reconnects by itself
        # and registers the same shared memory again.
        again = Daemon(config, engine=FakeEngine())
        await again.startup()
        try:
            # get_finished reconnects, which blocks until this loop's daemon answers:
            # run it off the loop, as vLLM's worker thread would.
            for _ in range(100):
                await asyncio.to_thread(worker.get_finished)
                if worker.welcome is not None:
                    break
                await asyncio.sleep(0.02)
            assert worker.welcome is not None and worker.welcome.daemon_id == again.daemon_id
            await wait_until(lambda: bool(again.service.ranks) and again.service.ranks[0].ready,
                             "the KV memory to be registered again")
            assert again.service.ranks[0].buffers[0].size == os.fstat(buf.fd).st_size  # the same memfd
        finally:
            await again.shutdown()
    finally:
        worker.close()
        await daemon.shutdown()


@pytest.mark.asyncio
async def test_evicted_receive_releases_blocks_without_load_errors(base, silent_port) -> None:
    daemon = Daemon(daemon_config(f"{base}/rt", D_ENGINE), engine=FakeEngine())
    await daemon.startup()
    buf = SharedBuffer.create(2 * NUM_BLOCKS * BLOCK_LEN)
    worker = PushWorker(socket_path=daemon.config.socket_path, rank=0, tp_size=1, role="consumer",
                        connect_timeout_s=5.0)
    try:
        await asyncio.to_thread(worker.register, [buf], kv_regions(NUM_BLOCKS), 1)
        never = wp.RegisterRecv(request_id="gone", local_block_ids=[[4]], remote_engine_id="prefill",
                                remote_host="127.0.0.1", remote_port=silent_port)
        worker.start_step(PushsvcMetadata(recvs={"gone": never}))
        worker.start_step(PushsvcMetadata(evictions=["gone"]))
        sending, recving = await _finished(worker)
        assert recving == {"gone"}
        assert worker.take_load_errors() == set()  # the request was aborted, not failed
    finally:
        worker.close()
        await daemon.shutdown()


@pytest.mark.asyncio
async def test_idle_wait_after_the_client_saw_the_daemon_close_reports_the_loss(base, silent_port) -> None:
    # The client closes its socket as soon as it reads the daemon's EOF (events that came
    # with it are returned first) and reports the loss on its next poll. An idle engine
    # step in between must not select on the closed socket: that raised inside vLLM's
    # engine step and killed the engine.
    daemon = Daemon(daemon_config(f"{base}/rt", D_ENGINE, watchdog_s=60.0), engine=FakeEngine())
    await daemon.startup()
    buf = SharedBuffer.create(2 * NUM_BLOCKS * BLOCK_LEN)
    worker = PushWorker(socket_path=daemon.config.socket_path, rank=0, tp_size=1, role="consumer",
                        connect_timeout_s=5.0)
    try:
        await asyncio.to_thread(worker.register, [buf], kv_regions(NUM_BLOCKS), 1)
        reg = wp.RegisterRecv(request_id="waiting", local_block_ids=[[4]], remote_engine_id="prefill",
                              remote_host="127.0.0.1", remote_port=silent_port)
        worker.start_step(PushsvcMetadata(recvs={"waiting": reg}))
        await wait_until(lambda: daemon.info()["tables"]["d_pending"] == 1, "the daemon to track the request")
        worker.client.close()  # as after an EOF read together with events
        assert worker.get_finished(wait_s=0.01) == (set(), {"waiting"})
        assert worker.take_load_errors() == {4}
    finally:
        worker.close()
        await daemon.shutdown()


@pytest.mark.asyncio
async def test_match_key_goes_only_to_a_daemon_that_knows_it(base, silent_port, monkeypatch) -> None:
    daemon = Daemon(daemon_config(f"{base}/rt", D_ENGINE), engine=FakeEngine())
    await daemon.startup()
    buf = SharedBuffer.create(2 * NUM_BLOCKS * BLOCK_LEN)
    worker = PushWorker(socket_path=daemon.config.socket_path, rank=0, tp_size=1, role="both",
                        connect_timeout_s=5.0)
    try:
        await asyncio.to_thread(worker.register, [buf], kv_regions(NUM_BLOCKS), 1)
        sent: list = []
        real_send = worker.client.send
        monkeypatch.setattr(worker.client, "send", lambda msg: (sent.append(msg), real_send(msg)))

        def step(rid: str, block: int) -> None:
            reg = wp.RegisterRecv(request_id=f"{rid}-d", local_block_ids=[[block]], remote_engine_id="prefill",
                                  remote_host="127.0.0.1", remote_port=silent_port, match_key=f"key-{rid}")
            ready = wp.SendReady(request_id=f"{rid}-p", block_ids=[[block + 1]], match_key=f"key-{rid}")
            worker.start_step(PushsvcMetadata(recvs={reg.request_id: reg}, sends={ready.request_id: ready}))

        assert worker.client.supports(wp.MATCH_KEY_MINOR)  # this daemon speaks 1.1
        step("new", 3)
        assert [m.match_key for m in sent] == ["key-new", "key-new"]
        worker.client.daemon_minor = 0  # as if the daemon spoke 1.0, which refuses the field
        step("old", 6)
        assert [type(m).__name__ for m in sent[2:]] == ["RegisterRecv", "SendReady"]
        assert [m.match_key for m in sent[2:]] == ["", ""]
        assert [m.request_id for m in sent[2:]] == ["old-d", "old-p"]
    finally:
        worker.close()
        await daemon.shutdown()
