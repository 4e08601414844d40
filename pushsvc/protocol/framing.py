"""Length-prefixed frames shared by the Unix-socket and side-channel protocols.

A connection starts with an 8-byte preamble: a 4-byte magic naming the protocol and a
big-endian u16 major and u16 minor version. Nothing else is decoded until the majors
agree. After it, every frame is a big-endian u32 length followed by that many bytes of
msgpack. The length is checked against the cap before a single payload byte is
buffered, so a lying prefix costs nothing.
"""

from __future__ import annotations

import socket
import struct

import msgspec

from pushsvc.errors import FrameTooLarge, MalformedInput, ProtocolError, VersionMismatch

# Everything a msgspec decoder raises on hostile bytes. msgspec reports invalid UTF-8
# in a map key as UnicodeDecodeError rather than DecodeError, and nesting deeper than
# the interpreter's recursion limit (about a thousand bytes of 0x91, in a field or in
# an unknown key it has to skip) as RecursionError from its depth guard (both found
# by fuzzing).
DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError)

PREAMBLE = struct.Struct(">4sHH")
HEADER = struct.Struct(">I")


def encode_preamble(magic: bytes, major: int, minor: int) -> bytes:
    return PREAMBLE.pack(magic, major, minor)


def check_preamble(data: bytes, magic: bytes, major: int) -> int:
    """Validate a peer's preamble; return its minor version."""
    if len(data) != PREAMBLE.size:
        raise ProtocolError("short preamble")
    got_magic, got_major, got_minor = PREAMBLE.unpack(data)
    if got_magic != magic:
        raise ProtocolError(f"bad magic {got_magic!r}, expected {magic!r}")
    if got_major != major:
        raise VersionMismatch(f"protocol major {got_major}, this side speaks {major}")
    return got_minor


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def read_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly ``n`` bytes from a blocking socket (its timeout applies to each
    ``recv``). An end of stream before that raises ``ConnectionError``."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def read_frame(sock: socket.socket, max_frame: int) -> bytes:
    """Read one frame from a blocking socket and return its payload.

    The length prefix is checked against ``max_frame`` before a payload byte is read:
    a larger one raises ``FrameTooLarge`` (the stream is then unusable). An end of
    stream before the frame is complete raises ``ConnectionError``; the socket's
    timeout raises ``TimeoutError``. For the blocking set-up exchanges only; steady
    state reading goes through ``FrameBuffer``.
    """
    (length,) = HEADER.unpack(read_exact(sock, HEADER.size))
    if length > max_frame:
        raise FrameTooLarge(f"frame of {length} bytes exceeds cap {max_frame}")
    return read_exact(sock, length)


class FrameBuffer:
    """Incremental frame splitter for non-blocking sockets.

    ``feed`` appends received bytes and returns every complete payload. A frame whose
    announced length exceeds ``max_frame`` raises ``FrameTooLarge`` as soon as its
    header is seen; the buffer is then unusable and the connection should be closed.
    """

    __slots__ = ("_buf", "_max", "_need")

    def __init__(self, max_frame: int) -> None:
        self._buf = bytearray()
        self._max = max_frame
        self._need = -1  # payload length of the frame being read; -1 = header pending

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        out: list[bytes] = []
        buf = self._buf
        pos = 0
        while True:
            if self._need < 0:
                if len(buf) - pos < HEADER.size:
                    break
                (length,) = HEADER.unpack_from(buf, pos)
                if length > self._max:
                    raise FrameTooLarge(f"frame of {length} bytes exceeds cap {self._max}")
                pos += HEADER.size
                self._need = length
            if len(buf) - pos < self._need:
                break
            out.append(bytes(buf[pos : pos + self._need]))
            pos += self._need
            self._need = -1
        if pos:
            del buf[:pos]
        return out

    @property
    def pending(self) -> int:
        return len(self._buf)

    def __repr__(self) -> str:
        return f"<FrameBuffer pending={len(self._buf)} need={self._need} max={self._max}>"


class CountingDecoder:
    """The typed decoder of one source of untrusted frames, counting every rejection.

    ``frame_length`` checks a header against the cap, ``decode`` turns a payload into a
    message; each refusal increments ``pushsvc_malformed_inputs{source, reason}`` once
    (reasons ``too_large`` and ``decode``) and then raises ``MalformedInput``, so the
    caller only decides what happens to the connection. Pure apart from the counter:
    the fuzz tests drive it without a socket.
    """

    __slots__ = ("source", "max_frame", "_decoder", "_too_large", "_malformed")

    def __init__(self, decoder: msgspec.msgpack.Decoder, *, source: str, max_frame: int, malformed) -> None:
        self.source = source
        self.max_frame = max_frame
        self._decoder = decoder
        self._too_large = malformed.labels(source, "too_large")
        self._malformed = malformed.labels(source, "decode")

    def frame_length(self, header: bytes) -> int:
        (length,) = HEADER.unpack(header)
        if length > self.max_frame:
            self._too_large.inc()
            raise MalformedInput(f"{self.source} frame of {length} bytes exceeds cap {self.max_frame}")
        return length

    def decode(self, payload: bytes):
        try:
            return self._decoder.decode(payload)
        except DECODE_ERRORS as exc:
            self._malformed.inc()
            raise MalformedInput(f"malformed {self.source} message: {exc}") from None

    def __repr__(self) -> str:
        return f"<CountingDecoder {self.source} max={self.max_frame}>"
