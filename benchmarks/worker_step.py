"""Worker-side cost of the pushsvc connector per engine step, against a live daemon.

vLLM calls the connector's worker hooks on every engine step, also on empty steps while
a transfer is pending (~650 steps/s on the 2-core machine). This times what
``PushsvcConnector`` does on a step with nothing to forward: ``PushWorker.start_step``
with empty metadata and ``PushWorker.get_finished()``, using
``connector/pushsvc_connector/worker.py`` registered with a real daemon over a memfd.

    python benchmarks/worker_step.py [--steps 200000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from daemon_push import Daemon  # noqa: E402

from pushsvc.protocol import worker as wp  # noqa: E402
from pushsvc.shm import SharedBuffer  # noqa: E402


def measure(steps: int = 200_000, rounds: int = 5) -> dict:
    from pushsvc_connector.kvshare import KVShare
    from pushsvc_connector.steps import StepPlan
    from pushsvc_connector.worker import PushWorker

    base = tempfile.mkdtemp(prefix="psstep-")
    daemon = Daemon(base, "step")
    worker = None
    try:
        worker = PushWorker(socket_path=daemon.info["socket_path"], rank=0, tp_size=1, role="consumer")
        buf = SharedBuffer.create(16 << 20)
        worker.register(KVShare([wp.Region(buffer=0, offset=0, block_len=128 << 10, num_blocks=128)], buffers=[buf]))
        empty, idle = StepPlan(), StepPlan(idle=True)
        out = {}
        for label, meta in (("busy_step", empty), ("idle_step", idle)):
            per_round = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                for _ in range(steps // rounds):
                    worker.start_step(meta)
                    worker.get_finished(0.01 if meta.idle else 0.0)  # idle_wait_ms default 10
                per_round.append((time.perf_counter() - t0) / (steps // rounds) * 1e6)
            out[f"{label}_us"] = statistics.median(per_round)
        out["steps"] = steps
        return out
    finally:
        if worker is not None:
            worker.close()
        daemon.stop()
        shutil.rmtree(base, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200_000)
    args = ap.parse_args()
    r = measure(args.steps)
    print(f"worker cost per engine step, nothing pending: start_step + get_finished = {r['busy_step_us']:.2f} us "
          f"(idle-flagged step: {r['idle_step_us']:.2f} us)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
