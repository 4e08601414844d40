"""Fuzz the side-channel decoder exactly as a session uses it: ``Session.read`` on a
real ``asyncio.StreamReader``, with the decoder a ``PeerManager`` gives its sessions,
during the handshake and after it alike.

Every input is a frame: usually its true length and a payload from ``fuzzing`` (valid
messages, mutated ones, random msgpack, garbage), sometimes a lying length above the
cap. The oracle is the wire contract: a frame over the cap is refused before its payload
is read; a payload is accepted exactly when the protocol's decoder accepts it, and then
returned unchanged; every refusal is ``MalformedInput`` and counted once in
``pushsvc_malformed_inputs{source="side_channel"}``; nothing else ever escapes.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from fuzzing import batches, examples_for, fuzz_settings, seeds
from hypothesis import given

from pushsvc.errors import MalformedInput
from pushsvc.metrics import Metrics
from pushsvc.protocol import peer as pp
from pushsvc.protocol.framing import HEADER
from pushsvc.protocol.framing import CountingDecoder
from pushsvc.server.session import Session

MAX_FRAME = 64 << 20  # the daemon's default max_peer_frame
LYING = (MAX_FRAME + 1, 2**31, 2**32 - 1)

# A failing batch of big inputs has a big repr; Hypothesis warns about it, which would
# hide the failure behind the warning.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:Generating overly large repr")]


def _frames(metrics: Metrics) -> CountingDecoder:
    return CountingDecoder(pp.peer_decoder, source="side_channel", max_frame=MAX_FRAME, malformed=metrics.malformed)


def _count(metrics: Metrics, reason: str) -> float:
    value = metrics.registry.get_sample_value("pushsvc_malformed_inputs_total",
                                              {"source": "side_channel", "reason": reason})
    return value or 0.0


def _expected(payload: bytes) -> pp.PeerMessage | None:
    try:
        return pp.peer_decoder.decode(payload)
    except Exception:  # the reference: whatever the protocol's decoder refuses
        return None


async def _read_one(frames: CountingDecoder, data: bytes) -> pp.PeerMessage | BaseException:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    try:
        session = Session(reader, None, dialed=False, frames=frames, max_buffered=0)  # type: ignore[arg-type]
        return await session.read()
    except MalformedInput as exc:
        return exc


def test_side_channel_decoder_fuzz(fuzz_cases: int) -> None:
    metrics = Metrics()
    frames = _frames(metrics)
    loop = asyncio.new_event_loop()
    totals = {"inputs": 0, "accepted": 0, "too_large": 0, "decode": 0}

    async def run(batch: list[bytes], rng: random.Random) -> None:
        before = {r: _count(metrics, r) for r in ("too_large", "decode")}
        refused = {"too_large": 0, "decode": 0}
        for payload in batch:
            lying = rng.random() < 0.05
            length = rng.choice(LYING) if lying else len(payload)
            got = await _read_one(frames, HEADER.pack(length) + payload)
            expected = None if lying else _expected(payload)
            if lying:
                assert isinstance(got, MalformedInput) and "exceeds cap" in str(got), (length, payload)
                refused["too_large"] += 1
            elif expected is None:
                assert isinstance(got, MalformedInput) and "malformed" in str(got), payload
                refused["decode"] += 1
            else:
                assert got == expected, payload
                totals["accepted"] += 1
        # Counted once per refusal, by reason, and never for an accepted frame.
        assert {r: _count(metrics, r) - before[r] for r in refused} == refused, batch
        totals["inputs"] += len(batch)
        for r, n in refused.items():
            totals[r] += n

    @fuzz_settings(examples_for(fuzz_cases))
    @given(batch=batches(seeds(pp.PeerMessage)))
    def fuzz(batch: list[bytes]) -> None:
        loop.run_until_complete(run(batch, random.Random(len(batch) + sum(map(len, batch)))))

    start = time.perf_counter()
    try:
        fuzz()
    finally:
        loop.close()
    rejected = totals["too_large"] + totals["decode"]
    print(f"\nside_channel fuzz: {totals} in {time.perf_counter() - start:.1f}s")
    assert totals["inputs"] >= fuzz_cases
    assert _count(metrics, "too_large") + _count(metrics, "decode") == rejected
    # The generators must reach both sides of the decoder, or the run proves little.
    assert totals["accepted"] > 0 and totals["decode"] > 0 and totals["too_large"] > 0
