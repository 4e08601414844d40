"""What P's loop spends on one layer of a step that finishes several layer-wise requests
into a same-host D: the time of each ``Layerwise._apply_layer`` (the layer's saves applied,
its copies launched, each request's bookkeeping), on this host's CPU.

A GPU pass whose layers come faster than this ends with P behind the pass
(docs/benchmarks.md, "Copied layer by layer"). The device is the daemon's fake
(``devmem/fake.py``: its copy moves the bytes on the CPU at the launch, a few KiB here), so
the figure is P's own work plus a small copy; the two daemons are real (fake NIXL engine,
real sockets and shared memory) and run in this process, as the unit tests run them.

    python benchmarks/layer_loop.py [--requests 8] [--layers 32] [--blocks 16] [--passes 16]
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
from pushsvc.engine.fake import FakeEngine  # noqa: E402
from pushsvc.protocol import worker as wp  # noqa: E402
from pushsvc.server.layerwise import Layerwise  # noqa: E402


class _Timed:
    """``Layerwise._apply_layer`` timed, each call's seconds kept."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._apply = Layerwise._apply_layer

    def __enter__(self) -> _Timed:
        apply, seconds = self._apply, self.seconds

        def timed(layerwise, rank, step, layer):
            started = time.perf_counter()
            apply(layerwise, rank, step, layer)
            seconds.append(time.perf_counter() - started)

        Layerwise._apply_layer = timed
        return self

    def __exit__(self, *exc) -> None:
        Layerwise._apply_layer = self._apply


async def _run(requests: int, layers: int, blocks: int, passes: int) -> dict:
    devmem = FakeDeviceMemory()
    devmem.add_device(UUID)
    names = [f"model.layers.{i}.self_attn" for i in range(layers)]
    fake = FakeEngine()
    total = requests * blocks
    async with running_daemon(fake, P_ENGINE, devmem=devmem, log_level="warning") as p, \
            running_daemon(fake, D_ENGINE, devmem=devmem, landing_mib=1, log_level="warning") as d:
        pw = LayerWorker(p, "producer", gpu=devmem, events=layers + 1, layers=names)
        dw = LayerWorker(d, "consumer", gpu=devmem, events=0, layers=names)
        await pw.start_layers(total, seed=1)
        await dw.start_layers(total, seed=2)
        events = list(pw.events)  # the layers' and the pass's
        await same_host_met(p, d, pw, dw)  # a first push over NIXL, then P maps D's KV
        rank = p.service.ranks.current[0]
        per_layer: list[float] = []
        passes_s: list[float] = []
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
            with _Timed() as timed:
                started = time.perf_counter()
                for event in events:  # the pass ran: P finds every layer final at once
                    event.finish()
                for rid in rids:
                    assert await dw.wait_for(wp.RecvDone, rid)
                took = time.perf_counter() - started
            for rid in rids:
                assert await pw.wait_for(wp.SendDone, rid)
            if n:
                per_layer += timed.seconds
                passes_s.append(took)
        launches = devmem.device(UUID).pair_copies
    return {"requests": requests, "layers": layers, "blocks": blocks, "passes": passes,
            "apply_layer_us_p50": statistics.median(per_layer) * 1e6,
            "apply_layer_us_p90": statistics.quantiles(per_layer, n=10)[-1] * 1e6,
            "pass_to_last_recv_done_ms_p50": statistics.median(passes_s) * 1e3,
            "pair_launches": launches}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=16, help="per request")
    ap.add_argument("--passes", type=int, default=16)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-results"))
    args = ap.parse_args()
    got = asyncio.run(_run(args.requests, args.layers, args.blocks, args.passes))
    print(f"{args.requests} requests x {args.layers} layers x {args.blocks} blocks, {args.passes} passes: "
          f"P's loop per layer p50 {got['apply_layer_us_p50']:.1f} us (p90 {got['apply_layer_us_p90']:.1f}); "
          f"every layer final to the last RecvDone p50 {got['pass_to_last_recv_done_ms_p50']:.2f} ms; "
          f"{got['pair_launches']} launches in all")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "layer_loop.json").write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M:%S"), **got}, indent=2))


if __name__ == "__main__":
    main()
