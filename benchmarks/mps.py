"""A private CUDA MPS server for one benchmark run (``--mps`` of ``gpu_overlap.py`` and
``gpu_push.py``).

Without MPS a GPU runs one process's work at a time, a time slice each, so a copy P's
daemon launches while P's worker computes waits for its slice (docs/gpu.md, "Limits").
MPS lets the kernels of its clients share the GPU. The server started here listens on a
pipe directory of its own: only processes that inherit ``CUDA_MPS_PIPE_DIRECTORY`` (the
run's process and those it starts) become its clients; every other process on the host runs as before.
It is stopped when the run ends. Nothing of the GPU's settings changes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable

CONTROL = "nvidia-cuda-mps-control"
_ENV = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")


def run_under_mps(enabled: bool, fn: Callable[..., None], *args: object) -> None:
    """``fn(*args)``; with ``enabled``, in a process of its own that is a client of a fresh
    MPS server, as are all the processes it starts. This process makes no CUDA context of
    its own: the server would wait for it before it quits."""
    if not enabled:
        fn(*args)
        return
    control = shutil.which(CONTROL)
    if control is None:
        raise SystemExit(f"--mps: {CONTROL} is not on PATH (it ships with the NVIDIA driver's utilities)")
    base = tempfile.mkdtemp(prefix="pushsvc-mps-")
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": os.path.join(base, "pipe"),
           "CUDA_MPS_LOG_DIRECTORY": os.path.join(base, "log")}
    for name in _ENV:
        os.makedirs(env[name])
    subprocess.run([control, "-d"], env=env, check=True)
    saved = {name: os.environ.get(name) for name in _ENV}
    os.environ.update({name: env[name] for name in _ENV})  # the child and what it starts inherit them
    try:
        child = mp.get_context("spawn").Process(target=fn, args=args)
        child.start()
        child.join()
        # A server starts only for a client: none listed means nothing ran under MPS.
        servers = subprocess.run([control], input=b"get_server_list\n", env=env, capture_output=True,
                                 timeout=30).stdout.decode().split()
        print(f"MPS servers that served the run: {' '.join(servers) or 'none (no process became a client)'}",
              flush=True)
        if child.exitcode:
            raise SystemExit(f"the run under MPS exited with {child.exitcode}")
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        subprocess.run([control], input=b"quit\n", env=env, check=False, timeout=60)
        shutil.rmtree(base, ignore_errors=True)
