"""A private CUDA MPS server for one benchmark run (``--mps`` of ``gpu_overlap.py`` and
``gpu_push.py``).

Without MPS a GPU runs one process's work at a time, a time slice each, so a copy P's
daemon launches while P's worker computes waits for its slice (docs/gpu.md, "Limits").
MPS lets the kernels of its clients share the GPU. The server started here listens on a
pipe directory of its own: only processes that inherit ``CUDA_MPS_PIPE_DIRECTORY`` (this
one and its children) become its clients; every other process on the host runs as before.
It is stopped when the run ends. Nothing of the GPU's settings changes.

Enter it before this process touches CUDA: a context made before it is not a client.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

CONTROL = "nvidia-cuda-mps-control"
_ENV = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")


@contextlib.contextmanager
def private_mps(enabled: bool = True) -> Iterator[bool]:
    """Run the body as a client of a fresh MPS server (when ``enabled``); yields whether one runs."""
    if not enabled:
        yield False
        return
    control = shutil.which(CONTROL)
    if control is None:
        raise SystemExit(f"--mps: {CONTROL} is not on PATH (it ships with the NVIDIA driver's utilities)")
    base = tempfile.mkdtemp(prefix="pushsvc-mps-")
    env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(base, "pipe"), "CUDA_MPS_LOG_DIRECTORY": os.path.join(base, "log")}
    for path in env.values():
        os.makedirs(path)
    saved = {name: os.environ.get(name) for name in _ENV}
    subprocess.run([control, "-d"], env={**os.environ, **env}, check=True)
    os.environ.update(env)
    try:
        yield True
    finally:
        subprocess.run([control], input=b"quit\n", env={**os.environ, **env}, check=False, timeout=60)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        log = os.path.join(env["CUDA_MPS_LOG_DIRECTORY"], "control.log")
        if os.path.exists(log):  # the server's own account of its clients, for the run's output
            with open(log) as f:
                tail = f.read().splitlines()[-5:]
            print("MPS control log (last lines):", *tail, sep="\n  ", flush=True)
        shutil.rmtree(base, ignore_errors=True)
