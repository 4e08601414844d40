"""The worker-side client of the daemon: no thread, no NIXL, no blocking after setup.

``connect`` and ``register_kv`` block (bounded by a timeout): they run once, when the
worker starts. After that ``send`` only appends to a buffer and writes what the socket
takes now, and ``poll`` drains whatever events arrived: with none pending it is one
failed non-blocking ``recv`` (a few microseconds), which is why the vLLM connector can
call it every engine step.
"""

from __future__ import annotations

import os
import select
import socket
import time
from typing import Sequence

import msgspec

from pushsvc.errors import DaemonNotListening, DaemonRefused, DaemonUnavailable, ProtocolError
from pushsvc.protocol import worker as wp
from pushsvc.protocol.framing import (
    DECODE_ERRORS,
    PREAMBLE,
    FrameBuffer,
    check_preamble,
    encode_preamble,
    frame,
    read_exact,
    read_frame,
)

_RECV_BYTES = 1 << 16
# A Welcome is a few hundred bytes; anything near this is not one.
_DESCRIBE_MAX_FRAME = 1 << 20


class DaemonClient:
    def __init__(self, socket_path: str, *, engine_id: str, rank: int, tp_size: int, role: wp.Role,
                 timeout_s: float = 10.0, max_frame: int = 16 << 20, pp_rank: int = 0, pp_size: int = 1) -> None:
        self.socket_path = socket_path
        # A pipeline stage is said only where there are several (1.5; a daemon before 1.5
        # refuses the hello of such a worker as naming fields it does not know).
        self.hello = wp.Hello(engine_id=engine_id, rank=rank, tp_size=tp_size, role=role, pid=os.getpid(),
                              pp_rank=pp_rank, pp_size=pp_size)
        self.timeout_s = timeout_s
        self.welcome: wp.Welcome | None = None
        # The daemon's protocol minor, from its preamble: what this client may send it
        # (a field newer than the daemon's minor would be refused as unknown).
        self.daemon_minor = 0
        self._max_frame = max_frame
        self._sock: socket.socket | None = None
        self._frames = FrameBuffer(max_frame)
        self._out = bytearray()
        self._backlog: list[wp.DaemonMessage] = []
        self._eof: BaseException | None = None  # the connection ended; raised after queued events

    # ------------------------------------------------------------------ setup (blocking)

    def connect(self) -> wp.Welcome:
        """Connect and say hello; the daemon's ``Welcome``. Raises ``DaemonNotListening``
        when nothing listens on the socket, ``DaemonRefused`` when the daemon refuses the
        hello, ``DaemonUnavailable`` for anything else that ends the attempt."""
        self.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(self.timeout_s)
        try:
            _connect(sock, self.socket_path, time.monotonic() + self.timeout_s)
            sock.sendall(encode_preamble(wp.MAGIC, wp.MAJOR, wp.MINOR) + frame(wp.encode(self.hello)))
            minor = check_preamble(read_exact(sock, PREAMBLE.size), wp.MAGIC, wp.MAJOR)
        except (OSError, ProtocolError) as exc:
            sock.close()
            raise DaemonUnavailable(f"cannot connect to daemon at {self.socket_path}: {exc}") from None
        sock.setblocking(False)
        self._sock = sock
        self.daemon_minor = minor
        self._frames = FrameBuffer(self._max_frame)
        self._out.clear()
        self._backlog.clear()
        self._eof = None
        try:
            welcome = self._wait_for(wp.Welcome)
        except BaseException:
            self.close()
            raise
        self.welcome = welcome
        return welcome

    def register_kv(self, fds: Sequence[int], regions: list[wp.Region], blocks_per_logical: int = 1,
                    memory: wp.CudaIpcBuffers | None = None, layer_events: list[bytes] | None = None
                    ) -> wp.KVRegistered:
        """Share the KV memory: memfds (sent with the frame), or CUDA IPC handles (and, for
        layer-wise push, the handles of the worker's layer events)."""
        if memory is not None and not self.supports(wp.CUDA_IPC_MINOR):
            raise DaemonRefused(f"the daemon speaks worker protocol {wp.MAJOR}.{self.daemon_minor}; CUDA KV memory "
                                f"needs {wp.MAJOR}.{wp.CUDA_IPC_MINOR} (upgrade the daemon)")
        if layer_events and not self.supports(wp.LAYERWISE_MINOR):
            raise DaemonRefused(f"the daemon speaks worker protocol {wp.MAJOR}.{self.daemon_minor}; layer-wise push "
                                f"needs {wp.MAJOR}.{wp.LAYERWISE_MINOR} (upgrade the daemon)")
        if not self.supports(wp.HEADS_MINOR):  # an older daemon refuses the field (and takes no P of higher TP)
            regions = [msgspec.structs.replace(r, heads=0, replicated=False) for r in regions]
        msg = wp.RegisterKV(memory=memory or wp.MemfdBuffers(count=len(fds)), regions=regions,
                            blocks_per_logical=blocks_per_logical, layer_events=list(layer_events or []))
        data = frame(wp.encode(msg))
        sock = self._require()
        self._flush_blocking()
        sock.setblocking(True)
        try:
            sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
            if sent < len(data):
                sock.sendall(data[sent:])
        except OSError as exc:
            self._lost(exc)
        finally:
            if self._sock is not None:
                sock.setblocking(False)
        return self._wait_for(wp.KVRegistered)

    # ------------------------------------------------------------------ steady state

    def supports(self, minor: int) -> bool:
        """Whether the connected daemon speaks worker protocol 1.``minor`` or later."""
        return self.daemon_minor >= minor

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def fileno(self) -> int:
        """The socket's fd, readable when events are waiting (for select/epoll users)."""
        return self._require().fileno()

    def send(self, msg: msgspec.Struct) -> None:
        """Queue ``msg``; write what the socket accepts now. Never blocks. P's finished
        blocks go packed to a daemon that takes them so (1.7, ``wp.pack_ids``)."""
        if isinstance(msg, (wp.SendReady, wp.SendStart)) and self.daemon_minor >= wp.PACKED_IDS_MINOR and any(
                len(ids) >= wp.PACK_MIN_IDS for ids in msg.block_ids):
            msg = msgspec.structs.replace(msg, block_ids=wp.pack_ids(msg.block_ids))
        self._out += frame(wp.encode(msg))
        self._flush()

    def poll(self) -> list[wp.DaemonMessage]:
        """Every event that arrived since the last call (an empty list if none).

        When the daemon goes away, the events it sent before are returned first; the
        next call raises ``DaemonUnavailable``.
        """
        events: list[wp.DaemonMessage] = []
        if self._backlog:
            events, self._backlog = self._backlog, events
        if self._eof is not None:
            if events:
                return events
            self._lost(self._eof)
        sock = self._require()
        if self._out:
            self._flush()
        while True:
            try:
                data = sock.recv(_RECV_BYTES)
            except (BlockingIOError, InterruptedError):
                return events
            except OSError as exc:
                data, self._eof = b"", exc
            if not data:
                self._eof = self._eof or ConnectionError("daemon closed the connection")
                self.close()
                if events:
                    return events
                self._lost(self._eof)
            try:
                for payload in self._frames.feed(data):
                    events.append(wp.daemon_decoder.decode(payload))
            except (ProtocolError, *DECODE_ERRORS) as exc:
                self._lost(exc)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    # ------------------------------------------------------------------ internals

    def _require(self) -> socket.socket:
        if self._sock is None:
            raise DaemonUnavailable(f"not connected to daemon at {self.socket_path}")
        return self._sock

    def _lost(self, exc: BaseException | None):
        self.close()
        self._eof = None
        raise DaemonUnavailable(f"connection to daemon lost{': ' + str(exc) if exc else ''}")

    def _flush(self) -> None:
        sock = self._require()
        try:
            while self._out:
                n = sock.send(self._out)
                del self._out[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            self._lost(exc)

    def _flush_blocking(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while self._out:
            self._flush()
            if self._out:
                if time.monotonic() > deadline:
                    self._lost(TimeoutError("daemon is not reading"))
                select.select([], [self._require()], [], 0.05)

    def _wait_for(self, kind: type) -> wp.DaemonMessage:
        """Block until a ``kind`` message arrives; keep other events for ``poll``."""
        deadline = time.monotonic() + self.timeout_s
        held: list[wp.DaemonMessage] = []
        try:
            while True:
                events = self.poll()
                for i, event in enumerate(events):
                    if isinstance(event, kind):
                        held.extend(events[i + 1:])  # what came in the same read, after the reply
                        return event
                    if isinstance(event, wp.Error) and not event.request_id:
                        raise DaemonRefused(f"daemon refused: {event.code}: {event.message}")
                    held.append(event)
                left = deadline - time.monotonic()
                if left <= 0:
                    self._lost(TimeoutError(f"no {kind.__name__} from daemon within {self.timeout_s}s"))
                select.select([self._require()], [], [], left)
        finally:
            self._backlog = held + self._backlog

    def __repr__(self) -> str:
        return f"<DaemonClient {self.socket_path} rank={self.hello.rank} connected={self.connected} out={len(self._out)}>"


def describe_daemon(socket_path: str, timeout_s: float = 2.0) -> wp.Welcome:
    """Who the daemon at ``socket_path`` is (engine id, side-channel address), without
    registering as a worker. Blocking, bounded by ``timeout_s``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout_s)
    try:
        _connect(sock, socket_path, time.monotonic() + timeout_s)
        sock.sendall(encode_preamble(wp.MAGIC, wp.MAJOR, wp.MINOR) + frame(wp.encode(wp.Describe())))
        check_preamble(read_exact(sock, PREAMBLE.size), wp.MAGIC, wp.MAJOR)
        msg = wp.daemon_decoder.decode(read_frame(sock, _DESCRIBE_MAX_FRAME))
    except (OSError, ProtocolError, *DECODE_ERRORS) as exc:
        raise DaemonUnavailable(f"cannot describe daemon at {socket_path}: {exc}") from None
    finally:
        sock.close()
    if not isinstance(msg, wp.Welcome):
        raise DaemonUnavailable(f"daemon at {socket_path} answered {type(msg).__name__}")
    return msg


class DescribeExchange:
    """One ``Describe`` over a non-blocking socket, for callers that must never block
    (vLLM's scheduler thread). The constructor connects (on a Unix socket this
    completes or fails at once) and queues the request; each ``poll`` writes and reads
    what the socket takes now and returns the daemon's ``Welcome`` once it is complete.
    Every call returns at once: how long to wait for an answer is the caller's choice
    (``close`` abandons the exchange). Failures raise ``DaemonUnavailable``
    (``DaemonNotListening`` when nothing listens) and close the socket."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            sock.connect(socket_path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise DaemonNotListening(f"no daemon listening at {socket_path}: {exc}") from None
        except OSError as exc:  # BlockingIOError: the listen backlog is full
            sock.close()
            raise DaemonUnavailable(f"cannot describe daemon at {socket_path}: {exc}") from None
        self._sock: socket.socket | None = sock
        self._out = bytearray(encode_preamble(wp.MAGIC, wp.MAJOR, wp.MINOR) + frame(wp.encode(wp.Describe())))
        self._preamble = b""
        self._frames = FrameBuffer(_DESCRIBE_MAX_FRAME)

    def poll(self) -> wp.Welcome | None:
        """The daemon's ``Welcome`` once it arrived, else None (asked again later)."""
        if self._sock is None:
            raise DaemonUnavailable(f"describe exchange with {self.socket_path} is closed")
        try:
            if self._out:
                del self._out[: self._sock.send(self._out)]
            while True:
                data = self._sock.recv(_RECV_BYTES)
                if not data:
                    raise ConnectionError("daemon closed the connection before answering")
                if len(self._preamble) < PREAMBLE.size:
                    need = PREAMBLE.size - len(self._preamble)
                    self._preamble += data[:need]
                    data = data[need:]
                    if len(self._preamble) < PREAMBLE.size:
                        continue
                    check_preamble(self._preamble, wp.MAGIC, wp.MAJOR)
                for payload in self._frames.feed(data):
                    msg = wp.daemon_decoder.decode(payload)
                    if not isinstance(msg, wp.Welcome):
                        raise ProtocolError(f"daemon answered {type(msg).__name__}")
                    self.close()
                    return msg
        except (BlockingIOError, InterruptedError):
            return None
        except (OSError, ProtocolError, *DECODE_ERRORS) as exc:
            self.close()
            raise DaemonUnavailable(f"cannot describe daemon at {self.socket_path}: {exc}") from None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __repr__(self) -> str:
        return f"<DescribeExchange {self.socket_path} open={self._sock is not None} out={len(self._out)}>"


def _connect(sock: socket.socket, path: str, deadline: float) -> None:
    """``connect`` that waits while the daemon's listen backlog is full: a socket with a
    timeout is non-blocking underneath, and for AF_UNIX a full backlog then fails at once
    with EAGAIN instead of waiting (a connect flood by another client would refuse us).
    A missing socket file or one nobody accepts on raises ``DaemonNotListening``."""
    pause = 0.001
    while True:
        try:
            sock.connect(path)
            return
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise DaemonNotListening(f"no daemon listening at {path}: {exc}") from None
        except BlockingIOError:
            if time.monotonic() + pause > deadline:
                raise TimeoutError("the daemon's listen backlog stayed full") from None
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

