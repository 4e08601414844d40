from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from procs import DaemonProc, WorkerProc, start_daemon


@pytest.fixture
def base_dir():
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="psit-") as d:
        yield Path(d)


@pytest.fixture
def spawn(base_dir):
    """Start daemons and workers; stop all of them at teardown (daemons must exit 0)."""
    daemons: list[DaemonProc] = []
    workers: list[WorkerProc] = []

    class Spawner:
        def daemon(self, engine_id: str, *extra: str) -> DaemonProc:
            d = start_daemon(base_dir, engine_id, *extra)
            daemons.append(d)
            return d

        def worker(self, daemon: DaemonProc, role: str, **opts) -> WorkerProc:
            w = WorkerProc(daemon, role, **opts)
            workers.append(w)
            return w

    yield Spawner()
    for w in workers:
        w.close()
    codes = {d.engine_id: d.stop() for d in daemons}
    bad = {k: v for k, v in codes.items() if v not in (0, -9)}
    assert not bad, f"daemons exited badly: {bad}\n" + "\n".join(d.log()[-3000:] for d in daemons)
