"""Idle CPU of a daemon with one registered worker, NIXL progress thread off vs on.

    python benchmarks/idle_cpu.py [--seconds 10]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil

from pushsvc.client import DaemonClient
from pushsvc.protocol import worker as wp
from pushsvc.shm import SharedBuffer


def measure(progress_thread: bool, seconds: float) -> float:
    base = tempfile.mkdtemp(prefix="psidle-")
    ready = os.path.join(base, "ready.json")
    env = {**os.environ, "PUSHSVC_NIXL_PROGRESS_THREAD": "true" if progress_thread else "false"}
    proc = subprocess.Popen([sys.executable, "-m", "pushsvc", "serve", "--engine-id", "idle", "--runtime-dir", base,
                             "--health-port", "0", "--side-channel-port", "0", "--ready-file", ready,
                             "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not os.path.exists(ready):
            time.sleep(0.02)
        with open(ready) as f:
            info = json.load(f)
        client = DaemonClient(info["socket_path"], engine_id="idle", rank=0, tp_size=1, role="both")
        client.connect()
        buf = SharedBuffer.create(1 << 20)
        client.register_kv([buf.fd], [wp.Region(buffer=0, offset=0, block_len=4096, num_blocks=256)])
        p = psutil.Process(proc.pid)
        time.sleep(1.0)
        t0 = sum(p.cpu_times()[:2])
        time.sleep(seconds)
        used = sum(p.cpu_times()[:2]) - t0
        client.close()
        buf.close()
        return used / seconds * 100
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
        shutil.rmtree(base, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    for on in (False, True):
        print(f"nixl_progress_thread={str(on).lower():<5}  idle daemon CPU: {measure(on, args.seconds):6.2f}% of a core",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
