"""Fuzz the worker socket's decoder through a real in-process daemon (fake engine, real
Unix socket): every input is one frame a worker sends, in the hello phase (a fresh
connection each) and after hello (one long-lived connection).

The oracle is the protocol's contract, checked input by input from the daemon's replies:

* a payload the protocol's decoder refuses gets ``Error{code: "decode"}``; before hello
  the connection then closes, after hello it lives on;
* a well-formed message is handled by type: ``Ping`` gets its ``Pong``, ``Evict``,
  ``Reported`` and ``StepSaved`` get nothing, ``RegisterRecv``/``SendReady``/``SendStart``
  without registered KV get ``RecvFailed``/``SendFailed``, a message out of place (and
  ``LayerSaved`` for a layer the worker never registered) gets an ``Error``; before hello only ``Hello``
  (``Welcome``) and ``Describe`` (``Welcome``, close) are accepted;
* every refusal the worker hears of is counted once in
  ``pushsvc_malformed_inputs{source="worker"}``, and nothing is ever counted as
  ``internal`` (an exception the daemon did not expect).
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import msgspec
import pytest
from daemon_fixtures import running_daemon
from fuzzing import Driven, batches, examples_for, fuzz_settings, seeds, structs
from hypothesis import given
from hypothesis import strategies as st

from pushsvc.engine.fake import FakeEngine
from pushsvc.protocol import worker as wp
from pushsvc.protocol.framing import PREAMBLE, FrameBuffer, check_preamble, encode_preamble, frame
from pushsvc.server.daemon import Daemon

# A failing batch of big inputs has a big repr; Hypothesis warns about it, which would
# hide the failure behind the warning.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:Generating overly large repr")]

ENGINE = "fuzz"
SENTINEL = 0x5A5A_5A5A_0000_0000  # Ping tokens of our own, after every fuzz input
WAIT_S = 30.0  # a liveness bound, not a speed claim
FAILED = (wp.Error, wp.RecvFailed, wp.SendFailed)  # the replies that tell of a refusal


class RawWorker:
    """A worker connection that sends whatever bytes it is given."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.frames = FrameBuffer(1 << 24)
        self.pending: list[Any] = []
        self.eof = False

    @classmethod
    async def open(cls, path: str) -> RawWorker:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, path)
        conn = cls(sock)
        check_preamble(await conn._exact(PREAMBLE.size), wp.MAGIC, wp.MAJOR)
        return conn

    async def _exact(self, n: int) -> bytes:
        loop = asyncio.get_running_loop()
        buf = b""
        while len(buf) < n:
            chunk = await loop.sock_recv(self.sock, n - len(buf))
            if not chunk:
                raise ConnectionError("closed during preamble")
            buf += chunk
        return buf

    async def send(self, data: bytes) -> None:
        try:
            await asyncio.get_running_loop().sock_sendall(self.sock, data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed by the daemon after a fatal refusal: the replies tell

    async def next(self) -> Any:
        """The next message from the daemon, or None at EOF."""
        loop = asyncio.get_running_loop()
        while not self.pending:
            if self.eof:
                return None
            try:
                data = await asyncio.wait_for(loop.sock_recv(self.sock, 1 << 16), WAIT_S)
            except ConnectionResetError:
                data = b""
            if not data:
                self.eof = True
                continue
            self.pending += [wp.daemon_decoder.decode(p) for p in self.frames.feed(data)]
        return self.pending.pop(0)

    async def until_pong(self, token: int) -> tuple[list[Any], bool]:
        """Every message before ``Pong(token)``, and whether it came (False: EOF first)."""
        out = []
        while True:
            msg = await self.next()
            if msg is None:
                return out, False
            if isinstance(msg, wp.Pong) and msg.token == token:
                return out, True
            out.append(msg)

    def close(self) -> None:
        self.sock.close()


def _reference(payload: bytes) -> Any:
    try:
        return wp.worker_decoder.decode(payload)
    except Exception:  # the reference: whatever the protocol's decoder refuses
        return None


def _counts(daemon: Daemon) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in daemon.metrics.malformed.collect():
        for s in metric.samples:
            if s.name.endswith("_total") and s.labels["source"] == "worker":
                out[s.labels["reason"]] = s.value
    return out


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}


def _check_ready(payload: bytes, replies: list[Any], counts: dict[str, int]) -> None:
    """The replies to one input after hello, against the reference decoder."""
    msg = _reference(payload)
    if msg is None:
        assert len(replies) == 1 and isinstance(replies[0], wp.Error) and replies[0].code == "decode", replies
        counts["decode"] += 1
    elif isinstance(msg, wp.Ping):
        assert replies == [wp.Pong(token=msg.token)]
    elif isinstance(msg, (wp.Evict, wp.Reported, wp.StepSaved)):
        assert replies == []
    elif isinstance(msg, wp.RegisterRecv):
        assert len(replies) == 1 and isinstance(replies[0], wp.RecvFailed), replies
        assert replies[0].request_id == msg.request_id
    elif isinstance(msg, (wp.SendReady, wp.SendStart)):
        assert len(replies) == 1 and isinstance(replies[0], wp.SendFailed), replies
        assert replies[0].request_id == msg.request_id
    else:  # Hello again, Describe, RegisterKV without its fds
        assert len(replies) == 1 and isinstance(replies[0], wp.Error) and replies[0].code != "decode", replies
    counts["refused"] += sum(isinstance(r, FAILED) for r in replies)
    counts["accepted"] += msg is not None


def test_worker_decoder_fuzz_after_hello(fuzz_cases: int) -> None:
    env = Driven(running_daemon(FakeEngine(), ENGINE))
    counts = {"inputs": 0, "accepted": 0, "decode": 0, "refused": 0}
    worker: list[RawWorker] = []
    hello = encode_preamble(wp.MAGIC, wp.MAJOR, wp.MINOR) + frame(
        wp.encode(wp.Hello(engine_id=ENGINE, rank=0, tp_size=1, role="both")))

    async def connect() -> RawWorker:
        conn = await RawWorker.open(env.value.config.socket_path)
        await conn.send(hello)
        assert isinstance(await conn.next(), wp.Welcome)
        return conn

    async def run(batch: list[bytes]) -> None:
        if not worker:
            worker.append(await connect())
        conn = worker[0]
        before = _counts(env.value)
        data = b"".join(frame(p) + frame(wp.encode(wp.Ping(token=SENTINEL + i))) for i, p in enumerate(batch))
        sender = asyncio.ensure_future(conn.send(data))
        batch_counts = dict.fromkeys(counts, 0)
        for i, payload in enumerate(batch):
            replies, alive = await conn.until_pong(SENTINEL + i)
            assert alive, f"the daemon closed a ready connection after {payload!r}: {replies}"
            _check_ready(payload, replies, batch_counts)
        await sender
        delta = _delta(before, _counts(env.value))
        assert "internal" not in delta, delta
        assert delta.get("decode", 0) == batch_counts["decode"], (delta, batch_counts)
        assert sum(delta.values()) == batch_counts["refused"], (delta, batch_counts)
        for k, v in batch_counts.items():
            counts[k] += v
        counts["inputs"] += len(batch)

    @fuzz_settings(examples_for(fuzz_cases))
    @given(batch=batches(seeds(wp.WorkerMessage)))
    def fuzz(batch: list[bytes]) -> None:
        env.run(run(batch))

    start = time.perf_counter()
    try:
        fuzz()
        ping = worker[0] if worker else None
        assert ping is not None
        env.run(ping.send(frame(wp.encode(wp.Ping(token=1)))))
        assert env.run(ping.next()) == wp.Pong(token=1)  # the daemon still serves
    finally:
        for w in worker:
            w.close()
        env.close()
    print(f"\nworker fuzz after hello: {counts} in {time.perf_counter() - start:.1f}s")
    assert counts["inputs"] >= fuzz_cases
    assert counts["accepted"] > 0 and counts["decode"] > 0


def test_worker_decoder_fuzz_hello_phase(fuzz_cases: int) -> None:
    env = Driven(running_daemon(FakeEngine(), ENGINE))
    counts = {"inputs": 0, "welcomed": 0, "decode": 0, "refused": 0, "described": 0}
    preamble = encode_preamble(wp.MAGIC, wp.MAJOR, wp.MINOR)

    async def one(payload: bytes, tally: dict[str, int]) -> None:
        conn = await RawWorker.open(env.value.config.socket_path)
        try:
            await conn.send(preamble + frame(payload) + frame(wp.encode(wp.Ping(token=SENTINEL))))
            replies, welcomed = await conn.until_pong(SENTINEL)
        finally:
            conn.close()
        msg = _reference(payload)
        if welcomed:  # a Hello the daemon took: Welcome, then our Ping's Pong
            assert isinstance(msg, wp.Hello) and len(replies) == 1 and isinstance(replies[0], wp.Welcome), replies
            tally["welcomed"] += 1
        elif msg is None:
            assert len(replies) == 1 and isinstance(replies[0], wp.Error) and replies[0].code == "decode", replies
            tally["decode"] += 1
        elif isinstance(msg, wp.Describe):
            assert len(replies) == 1 and isinstance(replies[0], wp.Welcome), replies
            tally["described"] += 1
        else:  # anything but Hello, or a Hello the daemon refused (engine, rank taken)
            assert len(replies) == 1 and isinstance(replies[0], wp.Error) and replies[0].code != "decode", replies
        tally["refused"] += sum(isinstance(r, FAILED) for r in replies)

    async def run(batch: list[bytes]) -> None:
        before = _counts(env.value)
        tally = dict.fromkeys(counts, 0)
        for payload in batch:
            await one(payload, tally)
        delta = _delta(before, _counts(env.value))
        assert "internal" not in delta, delta
        assert delta.get("decode", 0) == tally["decode"], (delta, tally)
        assert sum(delta.values()) == tally["refused"], (delta, tally)
        for k, v in tally.items():
            counts[k] += v
        counts["inputs"] += len(batch)

    # Half the seeds are Hellos for this daemon's engine (or for "any engine"), so that
    # accepted hellos (and refused ones: rank taken) are common, not one in thousands.
    ours = st.builds(lambda h, engine: msgspec.structs.replace(h, engine_id=engine), structs(wp.Hello),
                     st.sampled_from(["", ENGINE]))

    @fuzz_settings(examples_for(fuzz_cases))
    @given(batch=batches(st.one_of(seeds(wp.WorkerMessage), ours.map(wp.encode))))
    def fuzz(batch: list[bytes]) -> None:
        env.run(run(batch))

    start = time.perf_counter()
    try:
        fuzz()
    finally:
        env.close()
    print(f"\nworker fuzz hello phase: {counts} in {time.perf_counter() - start:.1f}s")
    assert counts["inputs"] >= fuzz_cases
    assert counts["welcomed"] > 0 and counts["decode"] > 0
