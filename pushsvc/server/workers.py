"""The worker-facing Unix socket: access control, framing, fd passing.

Sockets are driven with ``add_reader``/``add_writer`` rather than asyncio streams
because memory registration carries file descriptors (SCM_RIGHTS), which streams cannot
receive. A connection moves through ``ConnState`` in one place (``_advance``):

    PREAMBLE -> HELLO -> READY -> CLOSED

A bad frame payload gets an ``Error`` reply and a counter and the connection lives on;
a bad preamble, an oversized length prefix or a protocol violation before hello closes
that one connection. Nothing a worker sends can stop the daemon serving others.

Admission is by ``SO_PEERCRED`` (and ``SO_PEERGROUPS``) against an ``AccessPolicy``.
Connections that have not finished their hello are "pending": each has
``worker_hello_timeout_s`` to do so, and at most ``max_pending_workers`` wait at once;
beyond that the oldest gives way (after reading whatever it already sent), so idle or
flooding clients cannot keep a real worker out.
"""

from __future__ import annotations

import array
import asyncio
import enum
import grp
import os
import socket
import struct
from typing import Any, Protocol

import msgspec
import structlog

from pushsvc.errors import DeviceError, LayoutError, ProtocolError, TransferError
from pushsvc.metrics import Metrics
from pushsvc.protocol import worker as wp
from pushsvc.protocol.framing import DECODE_ERRORS, PREAMBLE, FrameBuffer, check_preamble, encode_preamble, frame
from pushsvc.server.access import AccessPolicy, PendingQueue
from pushsvc.server.ranks import Rank, WorkerLink

log = structlog.get_logger("pushsvc.workers")

_RECV_BYTES = 1 << 16
_MAX_FDS_PER_MSG = wp.MAX_FDS
_CMSG_SPACE = socket.CMSG_SPACE(_MAX_FDS_PER_MSG * 4)
_UCRED = struct.Struct("3i")
# Not exported by Python's socket module; Linux >= 4.13. The groups are those the peer had
# at connect(), which /proc/<pid>/status (the fallback) cannot promise.
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_MAX_PEER_GROUPS = 1024
# Accepts per wake-up of the listening socket: a connect flood then shares each loop
# iteration with the connections (and the health server) already there.
_ACCEPTS_PER_WAKEUP = 16
_BACKLOG = 128


class WorkerHandler(Protocol):
    """What a worker connection asks of the push service."""

    def describe(self) -> wp.Welcome: ...
    def attach_worker(self, conn: WorkerLink, hello: wp.Hello) -> tuple[Rank, wp.Welcome]: ...
    def detach_worker(self, rank: Rank) -> None: ...
    def register_kv(self, rank: Rank, msg: wp.RegisterKV, fds: list[int]) -> wp.KVRegistered: ...
    def on_worker_message(self, rank: Rank, msg: wp.WorkerMessage) -> None: ...


class ConnState(enum.Enum):
    PREAMBLE = "preamble"
    HELLO = "hello"
    READY = "ready"
    CLOSED = "closed"


class WorkerConn:
    """One worker connection. ``send`` never blocks: bytes queue until writable."""

    def __init__(self, server: WorkerServer, sock: socket.socket, uid: int, pid: int) -> None:
        self.server = server
        self.sock = sock
        self.uid = uid
        self.pid = pid
        self.state = ConnState.PREAMBLE
        self.minor = 0  # the worker's protocol minor, from its preamble
        self.rank: Rank | None = None
        self._pre = b""
        self._frames = FrameBuffer(server.max_frame)
        self._fds: list[int] = []
        self._out = bytearray()
        self._writing = False

    # ------------------------------------------------------------------ reading

    def on_readable(self) -> None:
        try:
            data, anc, flags, _ = self.sock.recvmsg(_RECV_BYTES, _CMSG_SPACE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close("recv error")
            return
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                self._fds.extend(fds)
        if flags & socket.MSG_CTRUNC or len(self._fds) > _MAX_FDS_PER_MSG:
            self._reject("too_many_fds", "more file descriptors than one registration may carry", fatal=True)
            return
        if not data:
            self.close("peer closed")
            return
        try:
            if self.state is ConnState.PREAMBLE:
                data = self._read_preamble(data)
            for payload in self._frames.feed(data):
                if self.state is ConnState.CLOSED:
                    return
                self._dispatch(payload)
        except ProtocolError as exc:
            self._reject("frame", str(exc), fatal=True)

    def _read_preamble(self, data: bytes) -> bytes:
        self._pre += data
        if len(self._pre) < PREAMBLE.size:
            return b""
        self.minor = check_preamble(self._pre[: PREAMBLE.size], wp.MAGIC, wp.MAJOR)
        rest = self._pre[PREAMBLE.size :]
        self._pre = b""
        self.state = ConnState.HELLO
        return rest

    def _dispatch(self, payload: bytes) -> None:
        try:
            msg = wp.worker_decoder.decode(payload)
        except DECODE_ERRORS as exc:
            # Framing is intact, so the connection can go on after telling the worker.
            self._reject("decode", f"malformed message: {exc}", fatal=self.state is ConnState.HELLO)
            return
        request_id = getattr(msg, "request_id", "")
        try:
            self._advance(msg)
        except (ProtocolError, LayoutError, TransferError, DeviceError, OSError) as exc:
            self._reject(type(exc).__name__, str(exc), fatal=self.state is ConnState.HELLO, request_id=request_id)
        except Exception as exc:
            # A bug here must cost one message, not the daemon: log it with its
            # traceback, answer the worker, keep serving.
            log.exception("worker_message_failed", rank=self._rank_number, request_id=request_id)
            self._reject("internal", f"{type(exc).__name__}: {exc}", fatal=self.state is ConnState.HELLO,
                         request_id=request_id)

    def _advance(self, msg: wp.WorkerMessage) -> None:
        service = self.server.service
        if self.state is ConnState.HELLO and isinstance(msg, wp.Describe):
            self.send(service.describe())
            self._flush()
            self.close("described")
        elif self.state is ConnState.HELLO:
            if not isinstance(msg, wp.Hello):
                raise ProtocolError(f"expected hello, got {type(msg).__name__}")
            self.rank, welcome = service.attach_worker(self, msg)
            # READY before the welcome goes out: if the worker is already gone, the
            # failed send closes a READY connection, which detaches it from its rank.
            self.state = ConnState.READY
            self.server.pending.discard(self)
            log.info("worker_connected", rank=msg.rank, role=msg.role, pid=self.pid, uid=self.uid)
            self.send(welcome)
        elif isinstance(msg, wp.Hello):
            raise ProtocolError("hello sent twice")
        elif self.rank is None:
            raise ProtocolError(f"{type(msg).__name__} before hello")
        elif isinstance(msg, wp.RegisterKV):
            # The fds ride on this frame's first bytes; any received since belong to it.
            fds, self._fds = self._fds, []
            try:
                self.send(service.register_kv(self.rank, msg, fds))
            finally:
                for fd in fds:
                    os.close(fd)
        else:
            service.on_worker_message(self.rank, msg)

    # ------------------------------------------------------------------ writing

    def send(self, msg: msgspec.Struct) -> None:
        if self.state is ConnState.CLOSED:
            return
        self._out += frame(wp.encode(msg))
        if not self._writing:
            self._flush()

    def send_raw(self, data: bytes) -> None:
        self._out += data
        self._flush()

    def _flush(self) -> None:
        try:
            while self._out:
                n = self.sock.send(self._out)
                del self._out[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self.close("send error", detach_soon=True)
            return
        loop = self.server.loop
        if self._out and not self._writing:
            self._writing = True
            loop.add_writer(self.sock.fileno(), self._on_writable)
        elif not self._out and self._writing:
            self._writing = False
            loop.remove_writer(self.sock.fileno())

    def _on_writable(self) -> None:
        self._flush()

    # ------------------------------------------------------------------ closing

    def _reject(self, reason: str, message: str, *, fatal: bool, request_id: str = "") -> None:
        self.server.metrics.malformed.labels("worker", reason).inc()
        log.warning("worker_input_rejected", reason=reason, error=message[:300], pid=self.pid,
                    rank=self._rank_number, request_id=request_id or None)
        self.send(wp.Error(code=reason, message=message[:1000], request_id=request_id))
        if fatal:
            self._flush()
            self.close(reason)

    def _close_fds(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()

    def close(self, reason: str = "", *, detach_soon: bool = False) -> None:
        """Close now; with ``detach_soon`` (a send failed) the rank is detached on the loop's
        next turn: a send runs inside the pass that tells the worker something, and
        detaching changes the rank's tables, which that pass may be walking."""
        if self.state is ConnState.CLOSED:
            return
        was_ready = self.state is ConnState.READY
        self.state = ConnState.CLOSED
        loop = self.server.loop
        loop.remove_reader(self.sock.fileno())
        if self._writing:
            loop.remove_writer(self.sock.fileno())
        self._close_fds()
        self.sock.close()
        self.server.forget(self)
        if was_ready and self.rank is not None:
            if detach_soon:
                self.server.loop.call_soon(self._detach, reason)
            else:
                self._detach(reason)

    def _detach(self, reason: str) -> None:
        assert self.rank is not None
        self.server.service.detach_worker(self.rank)
        log.info("worker_disconnected", reason=reason, pid=self.pid, rank=self._rank_number)

    @property
    def _rank_number(self) -> int | None:
        return self.rank.number if self.rank is not None else None

    def __repr__(self) -> str:
        return f"<WorkerConn pid={self.pid} state={self.state.value} out={len(self._out)}>"


class WorkerServer:
    def __init__(self, *, path: str, service: WorkerHandler, metrics: Metrics, max_frame: int,
                 allowed_uids: list[int], allowed_gids: list[int], group: str, max_connections: int,
                 hello_timeout_s: float, max_pending: int) -> None:
        self.path = path
        self.service = service
        self.metrics = metrics
        self.max_frame = max_frame
        self.gid = resolve_group(group) if group else None
        self.policy = AccessPolicy.build(own_uid=os.getuid(), allowed_uids=allowed_uids,
                                         allowed_gids=allowed_gids, socket_gid=self.gid)
        self.max_connections = max_connections
        self.conns: set[WorkerConn] = set()
        self.pending: PendingQueue[WorkerConn] = PendingQueue(max_pending, hello_timeout_s)
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self._sock: socket.socket | None = None
        self._expiry: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        if os.path.exists(self.path):
            _remove_stale_socket(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        # The umask gives the socket its final mode at bind time: no window in which
        # it exists with wider permissions.
        old = os.umask(0o117 if self.gid is not None else 0o177)
        try:
            sock.bind(self.path)
        finally:
            os.umask(old)
        if self.gid is not None:
            os.chown(self.path, -1, self.gid)
        # Short on purpose: in a connect flood a deep queue makes every newcomer wait
        # behind thousands of dead connections; a full one refuses with EAGAIN, which
        # DaemonClient retries until its timeout (measured: benchmarks/flood.py).
        sock.listen(_BACKLOG)
        self._sock = sock
        self.loop.add_reader(sock.fileno(), self._on_accept)

    @property
    def listening(self) -> bool:
        return self._sock is not None

    def _on_accept(self) -> None:
        assert self._sock is not None
        for _ in range(_ACCEPTS_PER_WAKEUP):
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.error("accept_failed", error=str(exc))
                return
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        reason = ""
        if not self.policy.admits(uid, _peer_groups(sock, pid, gid)):
            reason = "not_allowed"
        elif len(self.conns) >= self.max_connections:
            reason = "too_many_connections"
        if reason:
            self._refuse(reason, uid=uid, gid=gid, pid=pid)
            sock.close()
            return
        sock.setblocking(False)
        conn = WorkerConn(self, sock, uid, pid)
        self.conns.add(conn)
        self.metrics.worker_connections.set(len(self.conns))
        conn.send_raw(encode_preamble(wp.MAGIC, wp.MAJOR, wp.MINOR))
        if conn.state is ConnState.CLOSED:
            return  # the client left before our preamble could go out
        self.loop.add_reader(sock.fileno(), conn.on_readable)
        deadline = self.pending.add(conn, self.loop.time())
        if self._expiry is None:
            self._expiry = self.loop.call_at(deadline, self._expire_pending)
        self._make_room()

    def _make_room(self) -> None:
        """Drop the oldest pending connections beyond the cap. A worker whose hello is
        already in its socket buffer is read first, so it becomes READY instead."""
        while self.pending.over_cap():
            oldest = self.pending.oldest()
            assert oldest is not None
            oldest.on_readable()
            if oldest in self.pending:
                self._drop_pending(oldest, "pending_overflow")

    def _expire_pending(self) -> None:
        self._expiry = None
        for conn in self.pending.expired(self.loop.time()):
            self._drop_pending(conn, "hello_timeout")
        deadline = self.pending.next_deadline()
        if deadline is not None:
            self._expiry = self.loop.call_at(deadline, self._expire_pending)

    def _drop_pending(self, conn: WorkerConn, reason: str) -> None:
        self._refuse(reason, uid=conn.uid, pid=conn.pid, state=conn.state.value)
        # A real worker caught by this learns why instead of seeing a bare EOF.
        conn.send(wp.Error(code=reason, message="no hello in time" if reason == "hello_timeout"
                           else "too many connections waiting for their hello"))
        conn.close(reason)

    def _refuse(self, reason: str, **fields: Any) -> None:
        self.metrics.rejected_connections.labels("unix", reason).inc()
        log.warning("worker_rejected", reason=reason, **fields)

    def forget(self, conn: WorkerConn) -> None:
        self.conns.discard(conn)
        self.pending.discard(conn)
        self.metrics.worker_connections.set(len(self.conns))

    def stop_listening(self) -> None:
        if self._sock is not None:
            self.loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.stop_listening()
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        for conn in list(self.conns):
            conn.close("daemon shutdown")

    def __repr__(self) -> str:
        return f"<WorkerServer {self.path} conns={len(self.conns)} pending={len(self.pending)}>"


def _peer_groups(sock: socket.socket, pid: int, gid: int) -> set[int]:
    """Primary and supplementary groups of the peer (SO_PEERCRED gives only the primary
    one): from SO_PEERGROUPS, else from /proc/<pid>/status."""
    groups = {gid}
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, _MAX_PEER_GROUPS * 4)
    except OSError:
        return groups | _proc_groups(pid)
    groups.update(array.array("I", raw[: len(raw) - len(raw) % 4]))
    return groups


def _proc_groups(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return set()


def resolve_group(group: str) -> int:
    return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid


def _remove_stale_socket(path: str) -> None:
    """Refuse to steal a live daemon's socket; remove one left by a dead daemon."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)
        return
    finally:
        probe.close()
    raise OSError(f"another daemon is listening on {path}")
