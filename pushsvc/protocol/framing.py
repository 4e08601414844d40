"""Length-prefixed frames shared by the Unix-socket and side-channel protocols.

A connection starts with an 8-byte preamble: a 4-byte magic naming the protocol and a
big-endian u16 major and u16 minor version. Nothing else is decoded until the majors
agree. After it, every frame is a big-endian u32 length followed by that many bytes of
msgpack. The length is checked against the cap before a single payload byte is
buffered, so a lying prefix costs nothing.
"""

from __future__ import annotations

import struct

import msgspec

from pushsvc.errors import FrameTooLarge, ProtocolError, VersionMismatch

# Everything a msgspec decoder raises on hostile bytes. msgspec reports invalid UTF-8
# in a map key as UnicodeDecodeError rather than DecodeError (found by fuzzing).
DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError)

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
