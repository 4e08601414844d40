"""The worker-facing Unix socket of one in-process daemon: access, framing, hostile
input, and what ``DaemonClient`` makes of it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
from collections.abc import AsyncIterator

import msgspec
import pytest
from daemon_fixtures import (
    WAIT_S,
    Worker,
    kv_regions,
    metric,
    running_daemon,
    wait_until,
)

from pushsvc.client import DaemonClient
from pushsvc.engine.fake import FakeEngine
from pushsvc.errors import DaemonNotListening, DaemonRefused, DaemonUnavailable, PushsvcError
from pushsvc.protocol import worker as wp
from pushsvc.protocol.framing import (
    HEADER,
    PREAMBLE,
    FrameBuffer,
    check_preamble,
    encode_preamble,
    frame,
)
from pushsvc.server.daemon import Daemon
from pushsvc.shm import SharedBuffer

ENGINE = "unit"


@contextlib.asynccontextmanager
async def daemon(**overrides) -> AsyncIterator[Daemon]:
    async with running_daemon(FakeEngine(), ENGINE, **overrides) as d:
        yield d


class RawConn:
    """A worker connection with nothing checked on our side: bytes and fds as given."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.frames = FrameBuffer(1 << 24)
        self.queue: list[bytes] = []

    @classmethod
    async def open(cls, path: str) -> RawConn:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, path)
        except BaseException:
            sock.close()
            raise
        conn = cls(sock)
        check_preamble(await conn.recv_exact(PREAMBLE.size), wp.MAGIC, wp.MAJOR)
        return conn

    @classmethod
    async def hello(cls, path: str, engine_id: str = ENGINE, rank: int = 0) -> RawConn:
        conn = await cls.open(path)
        await conn.send(encode_preamble(wp.MAGIC, wp.MAJOR, wp.MINOR)
                        + frame(wp.encode(wp.Hello(engine_id=engine_id, rank=rank, tp_size=1, role="both"))))
        assert isinstance(await conn.recv_msg(), wp.Welcome)
        return conn

    async def send(self, data: bytes) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def send_msg(self, msg) -> None:
        await self.send(frame(wp.encode(msg)))

    async def recv_exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(self.sock, n - len(buf)), WAIT_S)
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return buf

    async def recv_msg(self):
        """The next daemon message, or None once the daemon closed the connection."""
        loop = asyncio.get_running_loop()
        while not self.queue:
            data = await asyncio.wait_for(loop.sock_recv(self.sock, 1 << 16), WAIT_S)
            if not data:
                return None
            self.queue += self.frames.feed(data)
        return wp.daemon_decoder.decode(self.queue.pop(0))

    async def closed_by_daemon(self) -> list:
        """Read until the daemon closes; return what it said first."""
        said = []
        while (msg := await self.recv_msg()) is not None:
            said.append(msg)
        return said

    def close(self) -> None:
        self.sock.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# ---------------------------------------------------------------- access


@pytest.mark.asyncio
async def test_socket_is_0600_and_runtime_dir_0700() -> None:
    async with daemon() as d:
        assert stat.S_ISSOCK(os.stat(d.config.socket_path).st_mode)
        assert stat.S_IMODE(os.stat(d.config.socket_path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(d.config.runtime_dir).st_mode) == 0o700


@pytest.mark.asyncio
@pytest.mark.parametrize(("group", "mode"), [("", 0o600), (str(os.getgid()), 0o660)])
async def test_socket_has_its_final_mode_at_bind_and_is_never_chmodded(
        monkeypatch: pytest.MonkeyPatch, group: str, mode: int) -> None:
    """The umask at bind() gives the mode: no chmod that would leave a window with wider
    permissions. Every mode change during startup is recorded; none may touch the socket."""
    changes: list[object] = []
    real_chmod, real_fchmod = os.chmod, os.fchmod
    monkeypatch.setattr(os, "chmod", lambda path, *a, **kw: (changes.append(os.fspath(path)), real_chmod(path, *a, **kw)))
    # An fchmod is recorded as the path its descriptor was opened on.
    monkeypatch.setattr(os, "fchmod", lambda fd, *a, **kw: (changes.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                            real_fchmod(fd, *a, **kw)))
    async with daemon(socket_group=group) as d:
        st = os.stat(d.config.socket_path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == mode
        if group:
            assert st.st_gid == int(group)
        assert d.config.socket_path not in changes
        assert changes == [d.config.runtime_dir]  # the directory only


# ---------------------------------------------------------------- slow and flooding clients


def raw_connect(path: str) -> socket.socket:
    """A blocking connect that does not yield to the loop: the daemon sees the connection
    only at the next loop iteration, with whatever was sent on it by then."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    return sock


@pytest.mark.asyncio
async def test_connection_without_hello_is_closed_at_the_deadline_and_counted() -> None:
    async with daemon(worker_hello_timeout_s=0.3) as d:
        silent = await RawConn.open(d.config.socket_path)
        half = await RawConn.open(d.config.socket_path)
        good = Worker(d, "both")
        try:
            await half.send(encode_preamble(wp.MAGIC, wp.MAJOR, wp.MINOR))  # preamble, then nothing
            await good.connect()
            for conn in (silent, half):
                said = await conn.closed_by_daemon()
                assert [(type(m), m.code) for m in said] == [(wp.Error, "hello_timeout")]
            assert metric(d, "pushsvc_rejected_connections_total", listener="unix", reason="hello_timeout") == 2
            await asyncio.sleep(0.5)  # past the deadline: the worker that said hello stays
            await good.ping(1)
            assert len(d.workers.conns) == 1 and len(d.workers.pending) == 0
        finally:
            silent.close()
            half.close()
            good.close()


@pytest.mark.asyncio
async def test_pending_cap_drops_the_oldest_and_a_real_worker_still_gets_in() -> None:
    async with daemon(max_pending_workers=4, worker_hello_timeout_s=60.0) as d:
        idle = [await RawConn.open(d.config.socket_path) for _ in range(10)]
        good = Worker(d, "both")
        try:
            for conn in idle[:6]:
                said = await conn.closed_by_daemon()
                assert [(type(m), m.code) for m in said] == [(wp.Error, "pending_overflow")]
            await wait_until(lambda: len(d.workers.pending) == 4, "four pending connections")
            assert metric(d, "pushsvc_rejected_connections_total", listener="unix", reason="pending_overflow") == 6
            await good.connect()
            await good.ping(1)
            # The worker's hello pushed out one more idle connection, never itself.
            assert metric(d, "pushsvc_rejected_connections_total", listener="unix", reason="pending_overflow") == 7
            assert len(d.workers.pending) == 3 and d.service.ranks.current[0].conn is not None
        finally:
            for conn in idle:
                conn.close()
            good.close()


@pytest.mark.asyncio
async def test_a_hello_already_sent_is_read_before_its_connection_could_be_dropped() -> None:
    async with daemon(max_pending_workers=2, worker_hello_timeout_s=60.0) as d:
        hello = frame(wp.encode(wp.Hello(engine_id=ENGINE, rank=0, tp_size=1, role="both")))
        first = raw_connect(d.config.socket_path)
        first.sendall(encode_preamble(wp.MAGIC, wp.MAJOR, wp.MINOR) + hello)
        # Two newer connections arrive in the same loop iteration: the first one is the
        # oldest pending when the cap is exceeded, but its hello is waiting in its buffer.
        others = [raw_connect(d.config.socket_path) for _ in range(2)]
        conn = RawConn(first)
        first.setblocking(False)
        try:
            check_preamble(await conn.recv_exact(PREAMBLE.size), wp.MAGIC, wp.MAJOR)
            assert isinstance(await conn.recv_msg(), wp.Welcome)
            assert metric(d, "pushsvc_rejected_connections_total", listener="unix", reason="pending_overflow") == 0
            assert len(d.workers.pending) == 2
        finally:
            conn.close()
            for s in others:
                s.close()


# ---------------------------------------------------------------- hostile framing


@pytest.mark.asyncio
async def test_wrong_magic_closes_only_that_connection() -> None:
    async with daemon() as d:
        good = Worker(d, "both")
        try:
            await good.connect()
            bad = await RawConn.open(d.config.socket_path)
            try:
                await bad.send(encode_preamble(b"HTTP", wp.MAJOR, wp.MINOR) + b"GET / HTTP/1.1\r\n\r\n")
                said = await bad.closed_by_daemon()
            finally:
                bad.close()
            assert [type(m) for m in said] == [wp.Error]
            assert "magic" in said[0].message
            assert metric(d, "pushsvc_malformed_inputs_total", source="worker", reason="frame") == 1
            await wait_until(lambda: len(d.workers.conns) == 1, "the bad connection to be forgotten")
            await good.ping(1)
        finally:
            good.close()


@pytest.mark.asyncio
async def test_oversized_length_prefix_closes_without_buffering() -> None:
    async with daemon(max_worker_frame=4096) as d:
        conn = await RawConn.hello(d.config.socket_path)
        try:
            # Announce a 1 GiB frame and send a little of it: the daemon must not wait for
            # (or buffer) the rest; it gives up as soon as it has read the header.
            await conn.send(HEADER.pack(1 << 30) + b"x" * 100)
            said = await conn.closed_by_daemon()
        finally:
            conn.close()
        assert [type(m) for m in said] == [wp.Error]
        assert "exceeds" in said[0].message
        assert metric(d, "pushsvc_malformed_inputs_total", source="worker", reason="frame") == 1
        await wait_until(lambda: not d.workers.conns, "the connection to be forgotten")
        # The rank retired with its connection and, with nothing in flight, was released.
        assert 0 not in d.service.ranks.current and not d.service.ranks.retiring


@pytest.mark.asyncio
async def test_malformed_payload_after_hello_gets_error_and_connection_lives() -> None:
    async with daemon() as d:
        conn = await RawConn.hello(d.config.socket_path)
        try:
            for payload in (b"\xc1\xc1 not msgpack",  # not msgpack at all
                            msgspec.msgpack.encode({"t": "ping", "token": -1}),  # out of bounds
                            msgspec.msgpack.encode({"t": "no-such-message"}),  # unknown tag
                            b"\x81\xa6\x00\x00\x00\x00\x00\x80\x01",  # map key not UTF-8
                            msgspec.msgpack.encode({"t": "register_kv", "memory": {"t": "memfd", "count": 1},
                                                    "regions": [{"buffer": 0, "offset": 0, "block_len": 4096,
                                                                 "num_blocks": 2, "block_stride": 1024}]})):  # overlap
                await conn.send(frame(payload))
                error = await conn.recv_msg()
                assert isinstance(error, wp.Error) and error.code == "decode", error
            await conn.send_msg(wp.Ping(token=42))
            assert await conn.recv_msg() == wp.Pong(token=42)
        finally:
            conn.close()
        assert metric(d, "pushsvc_malformed_inputs_total", source="worker", reason="decode") == 5


@pytest.mark.asyncio
@pytest.mark.parametrize("payload", [wp.encode(wp.Ping(token=1)), b"\xc1garbage"], ids=["ping", "garbage"])
async def test_message_before_hello_closes(payload: bytes) -> None:
    async with daemon() as d:
        conn = await RawConn.open(d.config.socket_path)
        try:
            await conn.send(encode_preamble(wp.MAGIC, wp.MAJOR, wp.MINOR) + frame(payload))
            said = await conn.closed_by_daemon()
        finally:
            conn.close()
        assert [type(m) for m in said] == [wp.Error]
        assert not d.service.ranks.all(), "no rank exists without a hello"


# ---------------------------------------------------------------- hello and registration


@pytest.mark.asyncio
async def test_hello_with_wrong_engine_id_is_refused() -> None:
    async with daemon() as d:
        conn = await RawConn.open(d.config.socket_path)
        try:
            await conn.send(encode_preamble(wp.MAGIC, wp.MAJOR, wp.MINOR)
                            + frame(wp.encode(wp.Hello(engine_id="someone-else", rank=0, tp_size=1, role="both"))))
            said = await conn.closed_by_daemon()
        finally:
            conn.close()
        assert [type(m) for m in said] == [wp.Error]
        assert "engine id" in said[0].message
        assert not d.service.ranks.all()
        client = DaemonClient(d.config.socket_path, engine_id="someone-else", rank=0, tp_size=1, role="both",
                              timeout_s=WAIT_S)
        try:
            with pytest.raises(PushsvcError):
                await asyncio.to_thread(client.connect)
        finally:
            client.close()


@pytest.mark.asyncio
async def test_client_refusal_names_the_reason() -> None:
    """Regression: the daemon's Error and its close race; poll() once dropped the Error
    and reported only a lost connection, and a refused connect() kept the dead socket."""
    async with daemon() as d:
        client = DaemonClient(d.config.socket_path, engine_id="someone-else", rank=0, tp_size=1, role="both",
                              timeout_s=WAIT_S)
        try:
            for _ in range(10):  # the Error and the close race; every attempt must name the reason
                with pytest.raises(DaemonRefused, match="engine id"):
                    await asyncio.to_thread(client.connect)
                assert not client.connected, "a refused client must not keep the dead socket"
        finally:
            client.close()


@pytest.mark.asyncio
@pytest.mark.parametrize(("count", "sent"), [(2, 1), (1, 0)])
async def test_register_kv_with_fd_count_mismatch_is_an_error(count: int, sent: int) -> None:
    async with daemon() as d:
        conn = await RawConn.hello(d.config.socket_path)
        buf = SharedBuffer.create(2 * 4 * 64)
        try:
            before = open_fds()
            msg = wp.RegisterKV(memory=wp.MemfdBuffers(count=count), regions=kv_regions(4))
            if sent:
                socket.send_fds(conn.sock, [frame(wp.encode(msg))], [buf.fd] * sent)
            else:
                await conn.send_msg(msg)
            error = await conn.recv_msg()
            assert isinstance(error, wp.Error)
            assert f"expected {count} fds, got {sent}" in error.message
            assert open_fds() == before, "the daemon must close fds it did not accept"
            assert not d.service.ranks.current[0].ready
            await conn.send_msg(wp.Ping(token=5))
            assert await conn.recv_msg() == wp.Pong(token=5)
        finally:
            conn.close()
            buf.close()


@pytest.mark.asyncio
async def test_second_worker_for_a_connected_rank_is_refused() -> None:
    async with daemon() as d:
        first = Worker(d, "both")
        second = Worker(d, "both")
        try:
            await first.start(4)
            with pytest.raises(PushsvcError):
                await second.connect()
            assert d.service.ranks.current[0].conn is not None
            assert d.info()["agents"][0]["registered"]
            await first.ping(3)
        finally:
            first.close()
            second.close()


@pytest.mark.asyncio
async def test_rank_can_reconnect_after_its_worker_left() -> None:
    async with daemon() as d:
        first = Worker(d, "both")
        try:
            await first.connect()
        finally:
            first.close()
        await wait_until(lambda: 0 not in d.service.ranks.current, "the daemon to notice the worker left")
        again = Worker(d, "both")
        try:
            await again.connect()
            await again.ping(9)
        finally:
            again.close()


# ---------------------------------------------------------------- client behaviour


@pytest.mark.asyncio
async def test_poll_returns_nothing_without_blocking_when_idle() -> None:
    async with daemon() as d:
        worker = Worker(d, "both")
        try:
            await worker.connect()
            await worker.ping(1)
            # In a thread, so a poll that blocked would fail the test instead of hanging the loop.
            polls = await asyncio.wait_for(asyncio.to_thread(lambda: [worker.client.poll() for _ in range(1000)]),
                                           WAIT_S)
            assert polls == [[]] * len(polls)
            await worker.ping(2)
        finally:
            worker.close()


@pytest.mark.asyncio
async def test_poll_delivers_each_event_once() -> None:
    """Regression: poll() once aliased its backlog and returned every event twice."""
    async with daemon() as d:
        client = DaemonClient(d.config.socket_path, engine_id=ENGINE, rank=0, tp_size=1, role="both",
                              timeout_s=WAIT_S)
        try:
            await asyncio.to_thread(client.connect)
            client.send(wp.Ping(token=1))
            events: list = []
            await wait_until(lambda: bool(events.extend(client.poll()) or any(isinstance(e, wp.Pong) for e in events)),
                             "the Pong")
            for _ in range(10):
                events += client.poll()
            client.send(wp.Ping(token=2))
            await wait_until(lambda: bool(events.extend(client.poll()) or len(events) > 1), "the second Pong")
            for _ in range(10):
                events += client.poll()
            assert events == [wp.Pong(token=1), wp.Pong(token=2)]
        finally:
            client.close()


@pytest.mark.asyncio
async def test_client_reports_daemon_unavailable_when_daemon_stops() -> None:
    async with daemon() as d:
        worker = Worker(d, "both")
        try:
            await worker.connect()
            await d.shutdown()

            def lost() -> bool:
                try:
                    worker.client.poll()
                except DaemonUnavailable:
                    return True
                return False

            await wait_until(lost, "the client to notice the daemon stopped")
            assert not worker.client.connected
            with pytest.raises(DaemonUnavailable):
                worker.client.poll()
            with pytest.raises(DaemonUnavailable):
                worker.client.send(wp.Ping(token=1))
            with pytest.raises(DaemonUnavailable):
                await worker.connect()
        finally:
            worker.close()


def test_client_tells_a_missing_or_dead_daemon_from_one_that_does_not_answer(tmp_path) -> None:
    """Nothing listening (no socket file, or a file nobody accepts on: a killed daemon's)
    is ``DaemonNotListening``; a listener that never answers is only unavailable."""
    path = str(tmp_path / "d.sock")
    client = DaemonClient(path, engine_id="", rank=0, tp_size=1, role="both", timeout_s=0.2)
    with pytest.raises(DaemonNotListening, match="no daemon listening"):
        client.connect()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)  # bound, never listening: ECONNREFUSED
    try:
        with pytest.raises(DaemonNotListening):
            client.connect()
    finally:
        stale.close()
    os.unlink(path)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(path)
    silent.listen(1)
    try:
        with pytest.raises(DaemonUnavailable) as info:
            client.connect()
        assert not isinstance(info.value, DaemonNotListening)
        assert not client.connected
    finally:
        silent.close()


@pytest.mark.asyncio
async def test_hello_without_engine_id_takes_the_daemons() -> None:
    async with daemon() as d:
        client = DaemonClient(d.config.socket_path, engine_id="", rank=0, tp_size=1, role="both", timeout_s=WAIT_S)
        try:
            welcome = await asyncio.to_thread(client.connect)
            assert welcome.engine_id == d.config.engine_id
            assert d.service.ranks.current[0].agent.name.startswith(f"{d.config.engine_id}/r0/")
        finally:
            client.close()


@pytest.mark.asyncio
async def test_worker_gone_before_its_welcome_does_not_keep_the_rank() -> None:
    import socket as socket_mod

    async with daemon() as d:
        # A worker whose connect timed out: hello sent, gone before the welcome.
        raw = socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM)
        raw.connect(d.config.socket_path)
        raw.sendall(encode_preamble(wp.MAGIC, wp.MAJOR, wp.MINOR)
                    + frame(wp.encode(wp.Hello(engine_id="", rank=0, tp_size=1, role="both"))))
        raw.close()
        await wait_until(lambda: not d.workers.conns, "the daemon to drop the dead connection")
        client = DaemonClient(d.config.socket_path, engine_id="", rank=0, tp_size=1, role="both", timeout_s=WAIT_S)
        try:
            welcome = await asyncio.to_thread(client.connect)
            assert welcome.engine_id == d.config.engine_id
        finally:
            client.close()


@pytest.mark.asyncio
async def test_a_worker_that_cannot_be_written_to_is_detached_on_the_next_turn_not_inside_the_send() -> None:
    """A send runs inside whatever pass tells the worker something, and closing the
    connection detaches its rank, whose tables that pass may be walking: a failed send
    closes the connection on the next turn of the loop."""
    async with daemon() as d:
        worker = Worker(d, "both")
        await worker.connect()
        (conn,) = d.workers.conns
        peer = socket.socket(fileno=os.dup(worker.client._sock.fileno()))
        peer.shutdown(socket.SHUT_RDWR)  # the worker's end goes away; its EOF not read yet
        peer.close()
        for _ in range(2):  # a pass telling the worker two things
            conn.send(wp.Pong(token=1))
            assert 0 in d.service.ranks.current, "detached inside the send"
        await wait_until(lambda: 0 not in d.service.ranks.current, "the rank detached once the pass is over")
        assert not d.workers.conns
        worker.close()
