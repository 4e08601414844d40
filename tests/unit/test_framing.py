"""Preamble and length-prefixed frames shared by both socket protocols."""

from __future__ import annotations

import socket
import struct
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pushsvc.errors import FrameTooLarge, ProtocolError, VersionMismatch
from pushsvc.protocol.framing import (
    HEADER,
    PREAMBLE,
    FrameBuffer,
    check_preamble,
    encode_preamble,
    frame,
    read_exact,
    read_frame,
)

# ---------------------------------------------------------------- preamble


def test_preamble_layout() -> None:
    data = encode_preamble(b"PSVW", 1, 7)
    assert data == b"PSVW\x00\x01\x00\x07"
    assert len(data) == PREAMBLE.size == 8


def test_preamble_round_trip_returns_minor() -> None:
    assert check_preamble(encode_preamble(b"PSVP", 3, 65535), b"PSVP", 3) == 65535
    assert check_preamble(encode_preamble(b"PSVP", 1, 0), b"PSVP", 1) == 0


def test_other_minor_is_accepted() -> None:
    assert check_preamble(encode_preamble(b"PSVW", 1, 9), b"PSVW", 1) == 9


def test_preamble_with_other_major_is_a_version_mismatch() -> None:
    with pytest.raises(VersionMismatch, match="major 2"):
        check_preamble(encode_preamble(b"PSVW", 2, 0), b"PSVW", 1)


def test_version_mismatch_is_a_protocol_error() -> None:
    assert issubclass(VersionMismatch, ProtocolError)
    assert issubclass(FrameTooLarge, ProtocolError)


def test_preamble_with_wrong_magic_is_rejected_before_version() -> None:
    data = encode_preamble(b"PSVP", 9, 0)
    with pytest.raises(ProtocolError, match="bad magic") as info:
        check_preamble(data, b"PSVW", 1)
    assert not isinstance(info.value, VersionMismatch)


@pytest.mark.parametrize("data", [b"", b"PSVW", b"PSVW\x00\x01\x00", b"PSVW\x00\x01\x00\x00\x00"])
def test_preamble_of_wrong_length_is_rejected(data: bytes) -> None:
    with pytest.raises(ProtocolError, match="short preamble"):
        check_preamble(data, b"PSVW", 1)


def test_http_request_is_not_a_preamble() -> None:
    with pytest.raises(ProtocolError, match="bad magic"):
        check_preamble(b"GET / HT", b"PSVW", 1)


# ---------------------------------------------------------------- frame


def test_frame_prefixes_big_endian_length() -> None:
    assert frame(b"abc") == b"\x00\x00\x00\x03abc"
    assert frame(b"") == b"\x00\x00\x00\x00"
    assert frame(b"x" * 256)[:4] == b"\x00\x00\x01\x00"


# ---------------------------------------------------------------- read_frame (blocking)


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    b.settimeout(5.0)
    yield a, b
    a.close()
    b.close()


def test_read_frame_returns_frames_in_order(pair) -> None:
    a, b = pair
    a.sendall(frame(b"one") + frame(b"") + frame(b"three"))
    assert [read_frame(b, 16) for _ in range(3)] == [b"one", b"", b"three"]


def test_read_frame_assembles_a_frame_sent_in_pieces(pair) -> None:
    a, b = pair
    data = frame(b"x" * 5000)

    def trickle() -> None:
        for i in range(0, len(data), 7):
            a.sendall(data[i : i + 7])

    writer = threading.Thread(target=trickle)
    writer.start()
    try:
        assert read_frame(b, 5000) == b"x" * 5000
    finally:
        writer.join()


def test_read_frame_refuses_an_oversized_length_before_reading_the_payload(pair) -> None:
    a, b = pair
    a.sendall(HEADER.pack(17) + b"p" * 17)
    with pytest.raises(FrameTooLarge, match="17 bytes exceeds cap 16"):
        read_frame(b, 16)
    # The payload was never read: it is all still in the socket.
    assert read_exact(b, 17) == b"p" * 17


def test_read_frame_at_end_of_stream_is_a_connection_error(pair) -> None:
    a, b = pair
    a.sendall(frame(b"abcdef")[:7])
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionError, match="closed after 3 of 6 bytes"):
        read_frame(b, 16)
    with pytest.raises(ConnectionError, match="closed after 0 of 4 bytes"):
        read_frame(b, 16)


def test_read_frame_times_out_with_the_sockets_timeout(pair) -> None:
    a, b = pair
    b.settimeout(0.05)
    a.sendall(HEADER.pack(4) + b"ab")
    with pytest.raises(TimeoutError):
        read_frame(b, 16)


# ---------------------------------------------------------------- FrameBuffer


def test_single_frame_in_one_feed() -> None:
    buf = FrameBuffer(1024)
    assert buf.feed(frame(b"hello")) == [b"hello"]
    assert buf.pending == 0


def test_several_frames_in_one_feed() -> None:
    buf = FrameBuffer(1024)
    data = frame(b"one") + frame(b"") + frame(b"three") + frame(b"4")
    assert buf.feed(data) == [b"one", b"", b"three", b"4"]
    assert buf.pending == 0


def test_trailing_partial_frame_waits_for_more() -> None:
    buf = FrameBuffer(1024)
    data = frame(b"first") + frame(b"second")
    assert buf.feed(data[:-3]) == [b"first"]
    assert buf.pending > 0
    assert buf.feed(data[-3:]) == [b"second"]
    assert buf.pending == 0


def test_empty_feed_returns_nothing() -> None:
    buf = FrameBuffer(16)
    assert buf.feed(b"") == []
    assert buf.pending == 0


def test_zero_length_frame() -> None:
    buf = FrameBuffer(0)
    assert buf.feed(frame(b"")) == [b""]


def test_split_at_every_byte_boundary() -> None:
    payloads = [b"a", b"", b"bc" * 40, bytes(range(256)), b"z"]
    stream = b"".join(frame(p) for p in payloads)
    for cut in range(len(stream) + 1):
        buf = FrameBuffer(4096)
        got = buf.feed(stream[:cut]) + buf.feed(stream[cut:])
        assert got == payloads, cut
        assert buf.pending == 0


def test_byte_at_a_time() -> None:
    payloads = [b"hello", b"", b"world!" * 3]
    stream = b"".join(frame(p) for p in payloads)
    buf = FrameBuffer(64)
    got: list[bytes] = []
    for i in range(len(stream)):
        got += buf.feed(stream[i : i + 1])
    assert got == payloads


def test_returned_payloads_are_bytes_copies() -> None:
    buf = FrameBuffer(64)
    (payload,) = buf.feed(frame(b"abc"))
    assert type(payload) is bytes
    buf.feed(frame(b"xyz"))
    assert payload == b"abc"


def test_frame_of_exactly_the_cap_is_accepted() -> None:
    buf = FrameBuffer(10)
    assert buf.feed(frame(b"0123456789")) == [b"0123456789"]


def test_oversized_prefix_is_rejected_before_payload_arrives() -> None:
    buf = FrameBuffer(10)
    with pytest.raises(FrameTooLarge, match="11 bytes exceeds cap 10"):
        buf.feed(HEADER.pack(11))
    assert buf.pending <= HEADER.size  # nothing of the payload was waited for or kept


def test_lying_prefix_costs_nothing() -> None:
    buf = FrameBuffer(1 << 20)
    with pytest.raises(FrameTooLarge):
        buf.feed(struct.pack(">I", 0xFFFFFFFF))


def test_oversized_prefix_split_across_feeds() -> None:
    buf = FrameBuffer(100)
    header = HEADER.pack(101)
    assert buf.feed(header[:2]) == []
    with pytest.raises(FrameTooLarge):
        buf.feed(header[2:])


def test_oversized_frame_after_good_ones_in_one_feed() -> None:
    buf = FrameBuffer(8)
    with pytest.raises(FrameTooLarge):
        buf.feed(frame(b"ok") + HEADER.pack(9) + b"x" * 9)


def test_buffer_stays_unusable_after_oversized_frame() -> None:
    buf = FrameBuffer(8)
    with pytest.raises(FrameTooLarge):
        buf.feed(HEADER.pack(9))
    with pytest.raises(FrameTooLarge):
        buf.feed(frame(b"ok"))


def test_pending_counts_buffered_bytes() -> None:
    buf = FrameBuffer(64)
    buf.feed(b"\x00\x00")
    assert buf.pending == 2
    buf.feed(b"\x00\x05ab")  # header complete, 2 of 5 payload bytes
    assert buf.pending == 2
    assert buf.feed(b"cde") == [b"abcde"]
    assert buf.pending == 0


def test_repr_shows_state() -> None:
    buf = FrameBuffer(64)
    buf.feed(b"\x00\x00\x00\x05ab")
    assert repr(buf) == "<FrameBuffer pending=2 need=5 max=64>"


@settings(max_examples=300, deadline=None)
@given(
    payloads=st.lists(st.binary(max_size=300), max_size=8),
    cuts=st.lists(st.integers(0, 3000), max_size=10),
)
def test_any_chunking_yields_the_same_frames(payloads: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(frame(p) for p in payloads)
    points = sorted({0, len(stream), *(c for c in cuts if c <= len(stream))})
    buf = FrameBuffer(300)
    got: list[bytes] = []
    for a, b in zip(points, points[1:]):
        got += buf.feed(stream[a:b])
    assert got == payloads
    assert buf.pending == 0
