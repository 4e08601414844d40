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


class GpuWorker(LineChild):
    """A ``kvproc.py`` process: CUDA KV caches plus the connector's worker role."""

    def __init__(self, daemon: Any, role: str, **opts) -> None:  # a procs.DaemonProc
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
