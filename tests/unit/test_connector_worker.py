"""PushWorker (the connector's worker side) against a real in-process daemon: events
become vLLM's finished sets, a lost connection holds what is in flight until the daemon
reports it or is known gone, and a daemon's refusal is never silent."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Callable

import pytest
from daemon_fixtures import BLOCK_LEN, D_ENGINE, daemon_config, kv_regions, wait_until

from pushsvc.engine.fake import FakeEngine
from pushsvc.errors import DaemonRefused
from pushsvc.protocol import worker as wp
from pushsvc.server.daemon import Daemon
from pushsvc.shm import SharedBuffer
from pushsvc_connector.kvshare import KVShare
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
        await asyncio.to_thread(worker.register, KVShare(kv_regions(NUM_BLOCKS), buffers=[buf]))
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
        await asyncio.to_thread(worker.register, KVShare(kv_regions(NUM_BLOCKS), buffers=[buf]))
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
            await wait_until(lambda: 0 in again.service.ranks.current and again.service.ranks.current[0].ready,
                             "the KV memory to be registered again")
            assert again.service.ranks.current[0].memory.buffers[0].size == os.fstat(buf.fd).st_size  # the same memfd
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
        await asyncio.to_thread(worker.register, KVShare(kv_regions(NUM_BLOCKS), buffers=[buf]))
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
async def test_idle_wait_after_the_client_saw_the_daemon_close_notices_the_loss(base, silent_port) -> None:
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
        await asyncio.to_thread(worker.register, KVShare(kv_regions(NUM_BLOCKS), buffers=[buf]))
        reg = wp.RegisterRecv(request_id="waiting", local_block_ids=[[4]], remote_engine_id="prefill",
                              remote_host="127.0.0.1", remote_port=silent_port)
        worker.start_step(PushsvcMetadata(recvs={"waiting": reg}))
        await wait_until(lambda: daemon.info()["tables"]["d_pending"] == 1, "the daemon to track the request")
        worker.client.close()  # as after an EOF read together with events
        assert worker.get_finished(wait_s=0.01) == (set(), set())  # held: the daemon is still there
        assert worker.welcome is None and "held=1" in repr(worker)
    finally:
        worker.close()
        await daemon.shutdown()


@contextlib.asynccontextmanager
async def _recording_worker(base: str, role: str, monkeypatch) -> AsyncIterator[tuple[Daemon, PushWorker, list]]:
    """A daemon and a registered PushWorker of ``role``; the list collects what the worker sends."""
    daemon = Daemon(daemon_config(f"{base}/rt", D_ENGINE), engine=FakeEngine())
    await daemon.startup()
    buf = SharedBuffer.create(2 * NUM_BLOCKS * BLOCK_LEN)
    worker = PushWorker(socket_path=daemon.config.socket_path, rank=0, tp_size=1, role=role, connect_timeout_s=5.0)
    try:
        await asyncio.to_thread(worker.register, KVShare(kv_regions(NUM_BLOCKS), buffers=[buf]))
        sent: list = []
        real_send = worker.client.send
        monkeypatch.setattr(worker.client, "send", lambda msg: (sent.append(msg), real_send(msg)))
        yield daemon, worker, sent
    finally:
        worker.close()
        await daemon.shutdown()


@pytest.mark.asyncio
async def test_match_key_goes_only_to_a_daemon_that_knows_it(base, silent_port, monkeypatch) -> None:
    async with _recording_worker(base, "both", monkeypatch) as (_daemon, worker, sent):

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


@pytest.mark.asyncio
async def test_what_the_worker_hands_vllm_is_reported_to_a_daemon_that_knows_it(base, monkeypatch) -> None:
    async with _recording_worker(base, "consumer", monkeypatch) as (daemon, worker, sent):
        assert worker.client.supports(wp.REPORTED_MINOR)
        before = time.monotonic()
        worker.start_step(PushsvcMetadata(recvs={"r1": _registration("r1", [3])}))
        assert await _finished(worker) == (set(), {"r1"})
        [report] = [m for m in sent if isinstance(m, wp.Reported)]
        assert (report.sending, report.recving) == ([], ["r1"]) and before <= report.at <= time.monotonic()
        await wait_until(lambda: "finished_recving" in daemon.service.timelines.recent(1)[0]["events_ms"],
                         "the daemon to add the moment to r1's timeline")
        assert worker.get_finished() == (set(), set()) and len(sent) == 2, "nothing to report: nothing sent"
        worker.client.daemon_minor = wp.REPORTED_MINOR - 1  # as if the daemon spoke 1.3, which refuses it
        worker.start_step(PushsvcMetadata(recvs={"r2": _registration("r2", [4])}))
        assert await _finished(worker) == (set(), {"r2"})
        assert [type(m).__name__ for m in sent[2:]] == ["RegisterRecv"]


# ---------------------------------------------------------------- connection loss


async def _step_off_loop(worker: PushWorker, done: Callable[[set[str], set[str]], bool], what: str,
                         timeout: float = 5.0) -> tuple[set[str], set[str]]:
    """Step the worker until ``done(sending, recving)``, off the event loop: a reconnect
    blocks until this loop's daemon answers, as it would in vLLM's worker thread."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    sending: set[str] = set()
    recving: set[str] = set()
    while True:
        s, r = await asyncio.to_thread(worker.get_finished)
        sending |= s
        recving |= r
        if done(sending, recving):
            return sending, recving
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; got {sending}, {recving}")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def _in_flight(base: str, silent_port: int, **overrides) -> AsyncIterator[tuple[Daemon, PushWorker]]:
    """A daemon and a connected worker with one receive ("waiting": P's handshake never
    completes) and one send ("sent": no D registers) outstanding."""
    config = daemon_config(f"{base}/rt", D_ENGINE, **overrides)
    daemon = Daemon(config, engine=FakeEngine())
    await daemon.startup()
    buf = SharedBuffer.create(2 * NUM_BLOCKS * BLOCK_LEN)
    worker = PushWorker(socket_path=config.socket_path, rank=0, tp_size=1, role="both", connect_timeout_s=5.0,
                        reconnect_interval_s=0.05)
    try:
        await asyncio.to_thread(worker.register, KVShare(kv_regions(NUM_BLOCKS), buffers=[buf]))
        reg = wp.RegisterRecv(request_id="waiting", local_block_ids=[[7]], remote_engine_id="prefill",
                              remote_host="127.0.0.1", remote_port=silent_port)
        sent = wp.SendReady(request_id="sent", block_ids=[[1, 2]])
        worker.start_step(PushsvcMetadata(recvs={"waiting": reg}, sends={"sent": sent}))
        await wait_until(lambda: daemon.info()["tables"]["d_pending"] == 1
                         and daemon.info()["tables"]["p_staged"] == 1, "the daemon to track both requests")
        yield daemon, worker
    finally:
        worker.close()
        buf.close()
        await daemon.shutdown()


async def _vanish(daemon: Daemon) -> None:
    """The daemon goes away without a word to its workers (as a killed one does): their
    connections and the socket file go first, then the rest of it."""
    daemon.workers.close()
    await daemon.shutdown()


def _notice_loss(worker: PushWorker) -> tuple[set[str], set[str]]:
    """The step on which the worker notices the connection is gone (it reconnects on a later one)."""
    for _ in range(1000):
        got = worker.get_finished()
        if worker.welcome is None:
            return got
        time.sleep(0.002)
    raise AssertionError("the worker did not notice the lost connection")


def _both_reported(sending: set[str], recving: set[str]) -> bool:
    return sending == {"sent"} and recving == {"waiting"}


def _counts(worker: PushWorker) -> dict:
    stats = worker.take_stats()
    return stats.to_dict() if stats is not None else {}


@pytest.mark.asyncio
async def test_lost_connection_holds_requests_until_no_daemon_listens(base, silent_port) -> None:
    """Regression: a lost connection reported every outstanding request at once (D's blocks
    back to vLLM, P's freed) although a live daemon may still write into or read them."""
    async with _in_flight(base, silent_port) as (daemon, worker):
        await _vanish(daemon)  # closes the socket file, then the connection
        assert _notice_loss(worker) == (set(), set()), "reported before anyone knew the daemon was gone"
        # The next attempt finds no socket: the daemon is gone, nothing can land.
        assert _both_reported(*await _step_off_loop(worker, _both_reported, "the held requests' release"))
        assert worker.take_load_errors() == {7}
        assert _counts(worker) == {"daemon_disconnects": {"": 1}, "held_requests": {"": 2},
                                   "released_requests": {"daemon_gone": 2}}


@pytest.mark.asyncio
async def test_with_cuda_kv_ds_held_requests_wait_out_the_grace_ps_go_at_once(base, silent_port,
                                                                              monkeypatch) -> None:
    """A same-host P daemon may still copy into D's blocks after D's daemon went away (it
    copies only while it heard from D's daemon within its fence): D's held requests keep
    their blocks for ``IPC_RELEASE_GRACE_S``; P's, which nothing writes into, go at once."""
    from pushsvc_connector import worker as worker_module

    monkeypatch.setattr(worker_module, "IPC_RELEASE_GRACE_S", 0.6)
    monkeypatch.setattr(KVShare, "kind", property(lambda self: "cuda"))
    async with _in_flight(base, silent_port) as (daemon, worker):
        await _vanish(daemon)
        assert _notice_loss(worker) == (set(), set())
        gone = time.monotonic()
        sending, recving = await _step_off_loop(worker, lambda s, r: s == {"sent"}, "P's release")
        assert recving == set() and time.monotonic() - gone < 0.6
        sending, recving = await _step_off_loop(worker, lambda s, r: r == {"waiting"}, "D's release after the grace")
        assert time.monotonic() - gone >= 0.6, "D's blocks went back before the grace ran out"
        assert worker.take_load_errors() == {7}
        assert _counts(worker)["released_requests"] == {"daemon_gone": 2}


@pytest.mark.asyncio
async def test_refused_connect_releases_held_requests(base, silent_port) -> None:
    """A killed daemon leaves its socket file behind: connecting is refused (ECONNREFUSED)."""
    async with _in_flight(base, silent_port) as (daemon, worker):
        path = daemon.config.socket_path
        await _vanish(daemon)
        assert _notice_loss(worker) == (set(), set())
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(path)  # a socket file nobody accepts on
        try:
            assert _both_reported(*await _step_off_loop(worker, _both_reported, "the held requests' release"))
        finally:
            stale.close()
            os.unlink(path)
        assert worker.take_load_errors() == {7}
        assert _counts(worker)["released_requests"] == {"daemon_gone": 2}


@pytest.mark.asyncio
async def test_new_daemon_incarnation_releases_held_requests(base, silent_port) -> None:
    async with _in_flight(base, silent_port) as (daemon, worker):
        await _vanish(daemon)
        again = Daemon(daemon.config, engine=FakeEngine())  # same socket, new daemon id
        await again.startup()
        try:
            assert _notice_loss(worker) == (set(), set())
            assert _both_reported(*await _step_off_loop(worker, _both_reported, "the held requests' release"))
            assert worker.welcome is not None and worker.welcome.daemon_id == again.daemon_id != daemon.daemon_id
            assert worker.take_load_errors() == {7}
            assert _counts(worker)["released_requests"] == {"daemon_restarted": 2}
        finally:
            await again.shutdown()


async def _reconnect_to_the_same_daemon(daemon: Daemon, worker: PushWorker) -> tuple[set[str], set[str]]:
    """Break the connection (the daemon lives on) and step until the worker is back;
    returns what it reported meanwhile, all of it from the daemon, nothing released."""
    worker.client._sock.shutdown(socket.SHUT_RDWR)  # the connection breaks, the daemon lives on
    assert _notice_loss(worker) == (set(), set())
    sending, recving = await _step_off_loop(worker, lambda s, r: worker.welcome is not None, "the worker to reconnect")
    assert worker.welcome.daemon_id == daemon.daemon_id
    return sending, recving


@pytest.mark.asyncio
async def test_same_daemon_keeps_held_requests_until_the_backstop(base, silent_port, caplog) -> None:
    async with _in_flight(base, silent_port) as (daemon, worker):
        daemon.service.outbox._keep_s = 0.05  # what it keeps for the worker is gone before it is back
        worker.client._sock.shutdown(socket.SHUT_RDWR)
        assert _notice_loss(worker) == (set(), set())
        await wait_until(lambda: daemon.service.outbox.kept == 0 and not daemon.info()["retiring_agents"],
                         "the daemon to end the requests and forget their events")
        assert await _step_off_loop(worker, lambda s, r: worker.welcome is not None,
                                    "the worker to reconnect") == (set(), set())
        for _ in range(20):
            assert worker.get_finished() == (set(), set())
            await asyncio.sleep(0.01)
        # The scheduler's backstop releases them (the daemon never reported them).
        worker.start_step(PushsvcMetadata(expired_recvs=["waiting"], expired_sends=["sent"]))
        assert worker.get_finished() == ({"sent"}, {"waiting"})
        assert worker.take_load_errors() == {7}
        assert _counts(worker)["released_requests"] == {"backstop": 2}
        assert any("backstop" in r.getMessage() and "released" in r.getMessage() for r in caplog.records)


@pytest.mark.asyncio
async def test_backstop_while_connected_evicts_and_waits_for_the_daemon(base, silent_port) -> None:
    """Regression: a backstop expiry reported the request at once, freeing blocks a WRITE
    might still be using; now the daemon's answer to the eviction frees them."""
    async with _in_flight(base, silent_port) as (daemon, worker):
        worker.start_step(PushsvcMetadata(expired_recvs=["waiting"], expired_sends=["sent"]))
        assert worker.get_finished() == (set(), set())  # the daemon has not answered yet
        assert _both_reported(*await _step_off_loop(worker, _both_reported, "the daemon's answer to the eviction"))
        assert worker.take_load_errors() == {7}  # failed, not aborted: vLLM must not use the blocks' contents
        assert daemon.info()["tables"]["d_pending"] == daemon.info()["tables"]["p_staged"] == 0


@pytest.mark.asyncio
async def test_lost_connection_after_the_backstop_fired_releases_at_once(base, silent_port) -> None:
    async with _in_flight(base, silent_port) as (daemon, worker):
        worker.start_step(PushsvcMetadata(expired_sends=["sent"]))
        worker.client._sock.shutdown(socket.SHUT_RDWR)
        assert _notice_loss(worker) == ({"sent"}, set())  # no second backstop would come for it
        assert "held=1" in repr(worker)  # the receive is held


@pytest.mark.asyncio
async def test_work_arriving_while_disconnected_fails_fast(base, silent_port) -> None:
    async with _in_flight(base, silent_port) as (daemon, worker):
        worker.client._sock.shutdown(socket.SHUT_RDWR)
        _notice_loss(worker)
        reg = _registration("meanwhile", [9])
        worker.start_step(PushsvcMetadata(recvs={"meanwhile": reg},
                                          sends={"p-meanwhile": wp.SendReady(request_id="p-meanwhile",
                                                                             block_ids=[[3]])}))
        assert worker.get_finished() == ({"p-meanwhile"}, {"meanwhile"})
        assert worker.take_load_errors() == {9}


# ---------------------------------------------------------------- daemon refusals


@pytest.mark.asyncio
@pytest.mark.parametrize(("role", "meta", "expected"), [
    ("consumer", PushsvcMetadata(sends={"p": wp.SendReady(request_id="p", block_ids=[[1]])}), ({"p"}, set())),
    ("producer", PushsvcMetadata(recvs={"d": _registration("d", [5])}), (set(), {"d"})),
])
async def test_daemon_error_for_a_tracked_request_ends_it_at_once(base, role, meta, expected) -> None:
    daemon = Daemon(daemon_config(f"{base}/rt", D_ENGINE), engine=FakeEngine())
    await daemon.startup()
    buf = SharedBuffer.create(2 * NUM_BLOCKS * BLOCK_LEN)
    worker = PushWorker(socket_path=daemon.config.socket_path, rank=0, tp_size=1, role=role,
                        connect_timeout_s=5.0)
    try:
        await asyncio.to_thread(worker.register, KVShare(kv_regions(NUM_BLOCKS), buffers=[buf]))
        worker.start_step(meta)  # refused for the worker's role: Error with the request id
        assert await _finished(worker) == expected
        assert worker.take_load_errors() == ({5} if role == "producer" else set())
    finally:
        worker.close()
        await daemon.shutdown()


@pytest.mark.asyncio
async def test_daemon_refusing_the_worker_at_start_up_fails_registration(base) -> None:
    """Regression: a second worker for a connected rank (pipeline or data parallelism on
    one daemon) was refused by the daemon, and the refusal was retried silently: vLLM ran
    with every transfer failing."""
    daemon = Daemon(daemon_config(f"{base}/rt", D_ENGINE), engine=FakeEngine())
    await daemon.startup()
    bufs = [SharedBuffer.create(2 * NUM_BLOCKS * BLOCK_LEN) for _ in range(2)]
    first, second = (PushWorker(socket_path=daemon.config.socket_path, rank=0, tp_size=1, role="consumer",
                                connect_timeout_s=5.0) for _ in range(2))
    try:
        await asyncio.to_thread(first.register, KVShare(kv_regions(NUM_BLOCKS), buffers=[bufs[0]]))
        with pytest.raises(DaemonRefused, match="TP rank 0.*rank 0 already has a connected worker"):
            await asyncio.to_thread(second.register, KVShare(kv_regions(NUM_BLOCKS), buffers=[bufs[1]]))
        assert first.welcome is not None
    finally:
        first.close()
        second.close()
        await daemon.shutdown()


def test_daemon_not_there_yet_is_retried_later(base) -> None:
    worker = PushWorker(socket_path=f"{base}/absent.sock", rank=0, tp_size=1, role="consumer",
                        connect_timeout_s=1.0)
    buf = SharedBuffer.create(2 * NUM_BLOCKS * BLOCK_LEN)
    try:
        worker.register(KVShare(kv_regions(NUM_BLOCKS), buffers=[buf]))  # no exception: vLLM starts, the worker retries
        assert worker.welcome is None
    finally:
        worker.close()


@pytest.mark.asyncio
async def test_same_daemon_delivers_the_final_events_of_held_requests(base, silent_port) -> None:
    """The daemon's side of connection loss: it withdrew the old connection's requests
    (neither could have been touched by a WRITE yet) and keeps their final events for the
    same process, which hears them on its new connection; the worker released nothing."""
    async with _in_flight(base, silent_port) as (daemon, worker):
        before = await _reconnect_to_the_same_daemon(daemon, worker)
        after = await _step_off_loop(worker, lambda s, r: _both_reported(s | before[0], r | before[1]),
                                     "the held requests' final events")
        assert _both_reported(before[0] | after[0], before[1] | after[1])
        assert worker.take_load_errors() == {7}
        assert "released_requests" not in _counts(worker)  # the daemon reported them, nobody released them
