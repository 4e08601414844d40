"""A TCP relay that notes when a client's bytes passed through it: between a front
(vllm-router) and a server, it tells when the front sent a request, apart from when the
server got round to it (on a shared host the server's own path, tokenizer, engine and
worker step, can take longer than the other server's whole prefill).

Bytes go through unchanged, both ways, one pair of threads per connection. What the client
sent is kept (for the test to search), up to ``KEEP_BYTES`` per connection.
"""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlsplit

KEEP_BYTES = 1 << 20
CHUNK = 65536


class _Seen:
    """What one connection's client sent: the bytes, and the wall time at which each
    received chunk ended."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.ends: list[tuple[int, float]] = []  # (offset after the chunk, time.time() on receipt)
        self._lock = threading.Lock()  # a chunk's bytes and its time are seen together

    def add(self, chunk: bytes, t: float) -> None:
        with self._lock:
            if len(self.data) < KEEP_BYTES:
                self.data += chunk
                self.ends.append((len(self.data), t))

    def arrived(self, marker: bytes) -> float | None:
        with self._lock:
            at = self.data.find(marker)
            if at < 0:
                return None
            end = at + len(marker)
            return next(t for offset, t in self.ends if offset >= end)


class Relay:
    """Listens on a free loopback port and relays each connection to ``target_url``'s host
    and port. ``url``: what to give the client in place of the target's."""

    def __init__(self, target_url: str) -> None:
        target = urlsplit(target_url)
        self._target = (target.hostname or "127.0.0.1", target.port or 80)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._seen: list[_Seen] = []
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()

    def arrived(self, marker: str) -> float | None:
        """The wall time (``time.time()``) at which the first client byte sequence holding
        ``marker`` had come in, or None if none did."""
        with self._lock:
            times = [t for seen in self._seen if (t := seen.arrived(marker.encode())) is not None]
        return min(times, default=None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets = [self._listener, *self._sockets]
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(self._target, timeout=10)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            seen = _Seen()
            with self._lock:
                if self._closed:
                    client.close()
                    server.close()
                    return
                self._seen.append(seen)
                self._sockets += [client, server]
            threading.Thread(target=_pump, args=(client, server, seen), daemon=True).start()
            threading.Thread(target=_pump, args=(server, client, None), daemon=True).start()


def _pump(source: socket.socket, sink: socket.socket, seen: _Seen | None) -> None:
    """Copy ``source`` to ``sink`` until either end closes; note each chunk in ``seen``."""
    try:
        while chunk := source.recv(CHUNK):
            if seen is not None:
                seen.add(chunk, time.time())
            sink.sendall(chunk)
    except OSError:
        pass
    finally:
        try:
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass
