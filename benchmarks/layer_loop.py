"""What P's loop spends on the layers of a step that finishes several layer-wise requests
into a same-host D: the time of each ``Layerwise._apply`` (the saves applied, their copies
launched, each request's bookkeeping), on this host's CPU, in two ways:

* ``one-by-one``: each layer's event finishes once P applied the layer before: what one
  layer costs P. A GPU pass whose layers come faster than this finds P behind it.
* ``together``: every layer's event finishes at once, as when P fell behind the pass (or
  the pass had no work): P applies the saves it finds done in one go (``Layerwise.poll``).

(docs/benchmarks.md, "Copied layer by layer" and "P catching up with the pass".) The
device is the daemon's fake (``devmem/fake.py``: its copy moves the bytes on the CPU at the
launch, pair by pair, where a GPU's launch only queues a kernel: ~0.3 ms a layer here, ~8
ms for a whole pass at once), so each apply is also printed without the fake's launches:
P's own work. The two daemons are real (fake NIXL engine, real sockets and shared memory)
and run in this process, as the unit tests run them; they log JSON lines at info to
/dev/null, as a deployed daemon logs each request's timeline.

    python benchmarks/layer_loop.py [--requests 8] [--layers 32] [--blocks 16] [--passes 16]
        [--arrival one-by-one,together] [--log-level info]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "unit"), str(ROOT), str(ROOT / "connector")]

from daemon_fixtures import D_ENGINE, P_ENGINE, metric, running_daemon, wait_until  # noqa: E402
from gpu_fixtures import UUID  # noqa: E402
from layer_fixtures import LayerWorker, pushregs_at, recv_into, same_host_met  # noqa: E402

from pushsvc.devmem.fake import FakeDeviceMemory  # noqa: E402
from pushsvc.devmem.fake import _PairCopier as _FakePairCopier  # noqa: E402
from pushsvc.engine.fake import FakeEngine  # noqa: E402
from pushsvc.logging import configure_logging  # noqa: E402
from pushsvc.protocol import worker as wp  # noqa: E402
from pushsvc.server.layerwise import Layerwise  # noqa: E402


class _Timed:
    """``Layerwise._apply`` timed: each call's seconds, the seconds of the fake device's
    launches in it (which move the bytes on the CPU, where a GPU's launch only queues a
    kernel), and how many saves it applied."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, float, int]] = []
        self._apply = Layerwise._apply
        self._launch = _FakePairCopier.launch

    def __enter__(self) -> _Timed:
        apply, launch, calls = self._apply, self._launch, self.calls
        launching = [0.0]

        def timed_launch(copier, *args, **kw):
            started = time.perf_counter()
            try:
                return launch(copier, *args, **kw)
            finally:
                launching[0] += time.perf_counter() - started

        def timed(layerwise, rank, saves):
            launching[0] = 0.0
            started = time.perf_counter()
            apply(layerwise, rank, saves)
            if saves:
                calls.append((time.perf_counter() - started, launching[0], len(saves)))

        Layerwise._apply = timed
        _FakePairCopier.launch = timed_launch
        return self

    def __exit__(self, *exc) -> None:
        Layerwise._apply = self._apply
        _FakePairCopier.launch = self._launch


async def _applied(timed: _Timed, calls: int, timeout: float = 10.0) -> None:
    """Until P applied ``calls`` times (the daemons share this loop: yield to it)."""
    deadline = time.monotonic() + timeout
    while len(timed.calls) < calls:
        if time.monotonic() > deadline:
            raise AssertionError(f"P applied saves {len(timed.calls)} times, not {calls}, in {timeout} s")
        await asyncio.sleep(0)


async def _run(requests: int, layers: int, blocks: int, passes: int, arrival: str) -> dict:
    devmem = FakeDeviceMemory()
    devmem.add_device(UUID)
    names = [f"model.layers.{i}.self_attn" for i in range(layers)]
    fake = FakeEngine()
    total = requests * blocks
    async with running_daemon(fake, P_ENGINE, devmem=devmem) as p, \
            running_daemon(fake, D_ENGINE, devmem=devmem, landing_mib=1) as d:
        pw = LayerWorker(p, "producer", gpu=devmem, events=layers + 1, layers=names)
        dw = LayerWorker(d, "consumer", gpu=devmem, events=0, layers=names)
        await pw.start_layers(total, seed=1)
        await dw.start_layers(total, seed=2)
        events = list(pw.events)  # the layers' and the pass's
        await same_host_met(p, d, pw, dw)  # a first push over NIXL, then P maps D's KV
        rank = p.service.ranks.current[0]
        calls: list[tuple[float, float, int]] = []
        passes_s: list[float] = []
        launched = 0
        for n in range(passes + 1):  # the first is a warm-up
            step = 10 + n
            rids = [f"s{n}.{i}" for i in range(requests)]
            ids = [list(range(i * blocks, (i + 1) * blocks)) for i in range(requests)]
            regs = metric(p, "pushsvc_notifications_total", kind="push_reg")
            for rid, blocks_of in zip(rids, ids):
                recv_into(p, dw, rid, blocks_of)
            await pushregs_at(p, regs + requests)
            for rid, blocks_of in zip(rids, ids):
                pw.send(wp.SendStart(request_id=rid, block_ids=[blocks_of], step=step))
            await wait_until(lambda: all(rid in p.service.sender._of(rank).writes for rid in rids), "matched at P")
            for layer in range(layers):  # every layer saved, none of its kernels run yet
                events[layer].record()
                pw.send(wp.LayerSaved(step=step, layer=layer))
            events[layers].record()
            pw.send(wp.StepSaved(step=step))
            await pw.ping(n)
            before = devmem.device(UUID).pair_copies
            with _Timed() as timed:
                started = time.perf_counter()
                if arrival == "together":  # the pass ran: P finds every layer final at once
                    for event in events:
                        event.finish()
                else:  # each layer once P applied the one before
                    for i, event in enumerate(events):
                        event.finish()
                        await _applied(timed, i + 1)
                for rid in rids:
                    assert await dw.wait_for(wp.RecvDone, rid)
                took = time.perf_counter() - started
            for rid in rids:
                assert await pw.wait_for(wp.SendDone, rid)
            if n:
                calls += timed.calls
                passes_s.append(took)
                launched += devmem.device(UUID).pair_copies - before
    seconds = [s for s, _, _ in calls]
    own = [s - launching for s, launching, _ in calls]
    return {"requests": requests, "layers": layers, "blocks": blocks, "passes": passes, "arrival": arrival,
            "apply_us_p50": statistics.median(seconds) * 1e6,
            "apply_us_p90": statistics.quantiles(seconds, n=10)[-1] * 1e6,
            "apply_without_fake_launches_us_p50": statistics.median(own) * 1e6,
            "apply_without_fake_launches_us_p90": statistics.quantiles(own, n=10)[-1] * 1e6,
            "saves_per_apply": sum(k for _, _, k in calls) / len(calls),
            "pass_to_last_recv_done_ms_p50": statistics.median(passes_s) * 1e3,
            "launches_per_pass": launched / passes}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=16, help="per request")
    ap.add_argument("--passes", type=int, default=16)
    ap.add_argument("--arrival", default="one-by-one,together",
                    help="one-by-one: each layer's event once P applied the one before; together: all at once")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-results"))
    ap.add_argument("--log-level", default="info", help="the daemons' (JSON lines to /dev/null, as a daemon's "
                    "go to its journal: at info, each request's timeline event)")
    args = ap.parse_args()
    devnull = open(os.devnull, "w")
    configure_logging("json", args.log_level, devnull)
    runs = []
    for arrival in args.arrival.split(","):
        if arrival not in ("one-by-one", "together"):
            ap.error(f"--arrival: {arrival!r} is neither one-by-one nor together")
        got = asyncio.run(_run(args.requests, args.layers, args.blocks, args.passes, arrival))
        runs.append(got)
        print(f"{args.requests} requests x {args.layers} layers x {args.blocks} blocks, {args.passes} passes, "
              f"layers final {arrival}: P's apply p50 {got['apply_us_p50']:.1f} us (p90 {got['apply_us_p90']:.1f}), "
              f"without the fake's launches {got['apply_without_fake_launches_us_p50']:.1f} us "
              f"(p90 {got['apply_without_fake_launches_us_p90']:.1f}), {got['saves_per_apply']:.1f} saves each, "
              f"{got['launches_per_pass']:.0f} launches a pass; the first layer final to the last RecvDone p50 "
              f"{got['pass_to_last_recv_done_ms_p50']:.2f} ms")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "layer_loop.json").write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": runs},
                                                    indent=2))


if __name__ == "__main__":
    main()
