"""The GPU worker process (``kvproc.py``) as the tests and the GPU benchmark drive it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


class GpuWorker:
    """A ``kvproc.py`` process: CUDA KV caches plus the connector's worker role."""

    def __init__(self, daemon: Any, role: str, **opts) -> None:  # a procs.DaemonProc
        args = [sys.executable, str(HERE / "kvproc.py"), "--socket", daemon.socket, "--role", role]
        for k, v in opts.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "connector"),
                                                             os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                     env=env)
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"GPU worker exited with {self.proc.wait()}")
        return json.loads(line)

    def call(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        if not reply.get("ok"):
            raise RuntimeError(reply.get("error"))
        return reply

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
