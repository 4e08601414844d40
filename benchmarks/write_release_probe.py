"""What happens to a NIXL WRITE whose target is stopped, and to its source buffer when
the initiator gives the handle up.

Two plain processes, one NIXL agent each (UCX, no daemon). The target is stopped
(SIGSTOP) before the initiator posts a 16 MiB WRITE of bytes ``X``. The initiator then

* ``keep``: keeps the handle and polls it,
* ``release``: releases the handle (NIXL's documented way to abort a transfer),
* ``release_remove``: releases it and unloads the target's agent,

overwrites its source buffer with ``Y``, resumes the target and lets both make
progress. The target's buffer then says which bytes moved and when: ``X`` moved before
the release, ``Y`` after it, zeros never.

Run: ``python benchmarks/write_release_probe.py [keep|release|release_remove]`` (all
three by default); ``UCX_TLS=tcp`` and the like pick other transports.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from pushsvc.engine.nixl import NixlAgent
from pushsvc.errors import TransferError

SIZE = 16 << 20
CHUNK = 1 << 20


def target(workdir: str) -> None:
    buf = np.zeros(SIZE, dtype=np.uint8)
    agent = NixlAgent("probe-target", ["UCX"], False)
    agent.register([(buf.ctypes.data, SIZE)], "DRAM")
    with open(f"{workdir}/meta.tmp", "wb") as f:
        f.write(agent.metadata())
    with open(f"{workdir}/addr", "w") as f:
        f.write(str(buf.ctypes.data))
    os.rename(f"{workdir}/meta.tmp", f"{workdir}/meta")
    while not os.path.exists(f"{workdir}/dump"):
        agent.notifs()  # the target's share of UCX progress
        time.sleep(0.001)
    np.save(f"{workdir}/target.npy", buf)
    agent.close()


def _spin(agent: NixlAgent, seconds: float, handle=None):
    state = None
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        agent.notifs()
        if handle is not None:
            state = agent.state(handle)
        time.sleep(0.001)
    return state


def probe(mode: str) -> dict:
    workdir = tempfile.mkdtemp(prefix="nixl-probe-")
    proc = subprocess.Popen([sys.executable, __file__, "--target", workdir])
    try:
        while not os.path.exists(f"{workdir}/meta"):
            time.sleep(0.01)
        with open(f"{workdir}/addr") as f:
            base = int(f.read())
        src = np.full(SIZE, ord("X"), dtype=np.uint8)
        agent = NixlAgent("probe-initiator", ["UCX"], False)
        agent.register([(src.ctypes.data, SIZE)], "DRAM")
        with open(f"{workdir}/meta", "rb") as f:
            name = agent.add_remote(f.read())
        n = SIZE // CHUNK
        local = agent.prep_local(np.array([[src.ctypes.data + i * CHUNK, CHUNK, 0] for i in range(n)], np.uint64),
                                 "DRAM")
        remote = agent.prep_remote(name, np.array([[base + i * CHUNK, CHUNK, 0] for i in range(n)], np.uint64),
                                   "DRAM")
        warm, _ = agent.write(local, np.arange(1), remote, np.arange(1), b"warm")  # connects the endpoints
        deadline = time.monotonic() + 10
        while agent.state(warm).value == "PROC" and time.monotonic() < deadline:
            agent.notifs()
        agent.release(warm)
        src[:] = ord("X")
        proc.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        handle, first = agent.write(local, np.arange(n), remote, np.arange(n), b"main")
        stopped_state = _spin(agent, 2.0, handle)
        result = {"mode": mode, "posted": first.value, "after_2s_stopped": stopped_state.value}
        if mode in ("release", "release_remove"):
            try:
                agent.release(handle)
                result["release"] = "ok"
            except TransferError as exc:  # reported, not hidden: this is what we measure
                result["release"] = f"failed: {exc}"
        if mode == "release_remove":
            agent.remove_remote(name)
        src[:] = ord("Y")  # bytes read from here on arrive as Y
        _spin(agent, 0.5)
        proc.send_signal(signal.SIGCONT)
        resumed = _spin(agent, 3.0, handle if mode == "keep" else None)
        if mode == "keep":
            result["after_resume"] = resumed.value
        open(f"{workdir}/dump", "w").close()
        proc.wait(30)
        got = np.load(f"{workdir}/target.npy")
        result.update(target_X=int((got == ord("X")).sum()), target_Y=int((got == ord("Y")).sum()),
                      target_untouched=int((got == 0).sum()))
        agent.close()
        return result
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--target":
        target(sys.argv[2])
        return 0
    for mode in sys.argv[1:] or ["keep", "release", "release_remove"]:
        print(probe(mode), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
