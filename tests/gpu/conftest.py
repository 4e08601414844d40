"""GPU tests: real daemons (``pushsvc serve --gpu on``), real NIXL, worker processes
holding vLLM-shaped CUDA KV caches (``kvproc.py``). Run by ``make test-gpu`` on a host with
a CUDA GPU; they are not part of the CPU suite (``testpaths`` leaves them out), and they
fail, not skip, where no GPU is visible."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "integration"))

from gpuprocs import GpuWorker  # noqa: E402
from procs import DaemonProc, start_daemon  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    import torch

    if not torch.cuda.is_available():
        raise pytest.UsageError("tests/gpu need a CUDA GPU (torch.cuda.is_available() is False)")


def pytest_report_header(config: pytest.Config) -> str:
    import torch

    from gpuprocs import gpu_for

    return (f"GPUs: {torch.cuda.device_count()} visible; P's workers on cuda:{gpu_for('producer')}, "
            f"D's on cuda:{gpu_for('consumer')}")


GPU_FLAGS = ("--gpu", "on", "--log-level", "info")


@pytest.fixture
def base_dir():
    with tempfile.TemporaryDirectory(prefix="psgpu-") as d:
        yield Path(d)


class Spawner:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.daemons: list[DaemonProc] = []
        self.workers: list[GpuWorker] = []

    def daemon(self, engine_id: str, *extra: str) -> DaemonProc:
        """A daemon on the GPU; same-host push off unless ``extra`` turns it on (``--ipc-push
        auto``): the landing path is what most tests exercise, and it is the only path
        between hosts."""
        ipc = () if "--ipc-push" in extra else ("--ipc-push", "off")
        d = start_daemon(self.base, engine_id, *GPU_FLAGS, *ipc, *extra, timeout=120)
        self.daemons.append(d)
        return d

    def restart(self, old: DaemonProc, *extra: str) -> tuple[DaemonProc, float]:
        """Start ``old``'s engine again (same runtime dir and socket); seconds to ready."""
        t0 = time.monotonic()
        new = self.daemon(old.engine_id, *extra)
        return new, time.monotonic() - t0

    def worker(self, daemon: DaemonProc, role: str, **opts) -> GpuWorker:
        w = GpuWorker(daemon, role, **opts)
        self.workers.append(w)
        return w

    def close(self) -> None:
        for w in self.workers:
            w.close()
        codes = {d.engine_id + f"/{d.proc.pid}": d.stop() for d in self.daemons}
        bad = {k: v for k, v in codes.items() if v not in (0, -9)}
        assert not bad, f"daemons exited badly: {bad}\n" + "\n".join(d.log()[-4000:] for d in self.daemons)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture
def spawn(base_dir, request):
    s = Spawner(base_dir)
    yield s
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        for d in s.daemons:  # what the daemons said, for the failure's report
            print(f"--- daemon {d.engine_id} (pid {d.proc.pid}) log tail:\n{d.log()[-6000:]}")
    s.close()
