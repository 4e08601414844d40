"""The GPU worker process (``kvproc.py``) as the tests and the GPU benchmark drive it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent / "integration"))

from procs import LineChild  # noqa: E402


def gpu_for(role: str) -> int:
    """The GPU (torch's index) a worker of ``role`` keeps its KV on, and with it the
    daemon's copies for it: P's on ``PUSHSVC_P_GPU`` (default 0), D's on
    ``PUSHSVC_D_GPU`` (default 1 where two or more GPUs are visible, else 0), so that on a
    host with two GPUs every push crosses from one to the other."""
    import torch

    name, default = ("PUSHSVC_P_GPU", 0) if role == "producer" else (
        "PUSHSVC_D_GPU", 1 if torch.cuda.device_count() >= 2 else 0)
    index = int(os.environ.get(name, default))
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(f"{name}={index}, but {torch.cuda.device_count()} GPU(s) are visible")
    return index


class GpuWorker(LineChild):
    """A ``kvproc.py`` process: CUDA KV caches plus the connector's worker role."""

    def __init__(self, daemon: Any, role: str, **opts) -> None:  # a procs.DaemonProc
        opts.setdefault("device", gpu_for(role))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "connector"),
                                                             os.environ.get("PYTHONPATH", "")])}
        super().__init__([sys.executable, str(HERE / "kvproc.py"), "--socket", daemon.socket, "--role", role],
                         opts, env=env, what="GPU worker")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit")
            except (RuntimeError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()
