"""Start and stop the processes of a local P/D deployment: daemons, vLLM servers, the
proxy. Used by the demo, the end-to-end tests and the benchmarks.

Every process gets its own log file; ``Stack`` stops everything it started (SIGTERM,
then SIGKILL after a bound) on exit, on error and on Ctrl-C. A process stopped while the
stack waits for it to start (by the stack, or by SIGINT/SIGTERM) raises ``Stopped``, which
is never taken for a start-up crash and never retried.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

VLLM_ENV = {
    # KV cache memory per vLLM CPU server (GiB): small, several servers share the host.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # vLLM compiles one logprobs helper with torch.compile (Inductor) on an engine's first
    # logprobs request, --enforce-eager or not: 13-36 s on this host, while the request (and
    # the D waiting for its KV) waits (docs/routers.md). Every server here runs eagerly.
    "TORCH_COMPILE_DISABLE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


# Exit statuses of a process ended by one of these signals: it was stopped, it did not crash.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Host(Protocol):
    """Where a process runs, if not here: an address to bind and reach it at, and the
    command that runs an argv there (the multi-host tests' network namespaces)."""

    ip: str

    def wrap(self, argv: list[str]) -> list[str]: ...


class Stopped(RuntimeError):
    """A process was stopped while the stack waited for it to start, or the stack is being
    stopped: not a start-up failure."""


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    info: dict = field(default_factory=dict)
    url: str = ""
    stopping: bool = False  # ``stop`` was called: its exit is ours, not a crash

    def alive(self) -> bool:
        return self.popen.poll() is None

    def was_stopped(self) -> bool:
        """It exited because it was told to: by ``stop``, or by SIGINT or SIGTERM from anyone."""
        return self.stopping or self.popen.returncode in [-s for s in _STOP_SIGNALS]

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0, sig: int = signal.SIGTERM) -> int:
        self.stopping = True  # before the signal: a thread waiting for its start must see it
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        return self.popen.returncode


# What deploy/pushsvc.service gives the daemon (Nice=-5): it is small and
# latency-critical, and vLLM's CPU workers can fill every core.
DAEMON_NICE = -5


def _prioritize(pid: int) -> None:
    """Run the daemon ahead of vLLM's CPU threads where the user may raise priority
    (root or CAP_SYS_NICE); elsewhere it keeps the default."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, DAEMON_NICE)
    except OSError:
        pass


def _get_json(url: str, timeout: float = 2.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


class Stack:
    """The processes of one run, stopped in reverse order by ``close``.

    Starts may run in threads (the demo starts P and D together) while the main thread
    stops the stack: ``_lock`` orders each spawn against ``refuse_starts``, so a process is
    either in ``procs`` when the stack begins to stop, or never spawned.
    """

    def __init__(self, workdir: Path, progress: Callable[[str], None] = lambda s: None,
                 vllm_log_level: str = "WARNING") -> None:
        self.workdir = workdir
        self.vllm_log_level = vllm_log_level
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.procs: list[Proc] = []
        self.progress = progress
        self.stopping = False  # set by refuse_starts (and close): nothing starts any more
        self._lock = threading.Lock()

    def refuse_starts(self) -> None:
        """Start nothing from now on: a start raises ``Stopped``, and one waiting for its
        process raises it once that process is gone, without starting it again. For a stack
        about to be stopped (Ctrl-C, SIGTERM, a failed start beside others)."""
        with self._lock:
            self.stopping = True

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None,
               on: Host | None = None) -> Proc:
        log = self.workdir / f"{name}.log"
        if on is not None:
            argv = on.wrap(argv)
        with self._lock:
            if self.stopping:
                raise Stopped(f"not starting {name}: the stack is stopping")
            with open(log, "wb") as f:
                popen = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT,
                                         env={**os.environ, **(env or {})},
                                         start_new_session=True)  # its own group: stop() reaches its children
            proc = Proc(name, popen, log)
            self.procs.append(proc)
        return proc

    def _forget(self, proc: Proc) -> None:
        with self._lock:
            if proc in self.procs:
                self.procs.remove(proc)

    def daemon(self, name: str, *extra: str, on: Host | None = None) -> Proc:
        """``pushsvc serve``; ``on``: run it there, its health endpoint on that host's
        address (``extra`` then says how it is secured)."""
        rt = self.workdir / name
        rt.mkdir(exist_ok=True)
        ready = rt / "ready.json"
        ready.unlink(missing_ok=True)
        where = ("--health-host", on.ip) if on is not None else ()
        proc = self._spawn(name, [sys.executable, "-m", "pushsvc", "serve", "--engine-id", name, "--runtime-dir",
                                  str(rt), "--health-port", "0", "--side-channel-port", "0", "--ready-file",
                                  str(ready), "--log-format", "json", *where, *extra], on=on)
        _prioritize(proc.popen.pid)
        self._wait(proc, lambda: ready.exists(), 60, interval=0.05)  # restarts are timed: poll finely
        proc.info = json.loads(ready.read_text())
        proc.url = f"http://{on.ip if on is not None else '127.0.0.1'}:{proc.info['health_port']}"
        return proc

    def vllm(self, name: str, model: str, port: int = 0, *, kv_transfer_config: dict | None = None,
             cpus: str = "", extra: tuple[str, ...] = (), timeout: float = 300, on: Host | None = None) -> Proc:
        """A vLLM CPU OpenAI server. ``cpus`` pins its worker threads (e.g. "1"); eager
        mode because vLLM's compile cache does not reload under this torch build
        (every start would recompile for 20-45 s); ``vllm_dtype()``'s dtype."""
        port = port or free_port()
        host = on.ip if on is not None else "127.0.0.1"
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
                "--host", host, "--max-model-len", "4096", "--dtype", vllm_dtype(), "--seed", "0",
                "--enforce-eager", "--disable-log-stats", *extra]
        if kv_transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        env = {**VLLM_ENV, "VLLM_LOGGING_LEVEL": self.vllm_log_level}
        if cpus:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
        return self.server(name, argv, f"http://{host}:{port}", env=env, timeout=timeout, on=on)

    def server(self, name: str, argv: list[str], url: str, *, env: dict[str, str] | None = None,
               timeout: float = 300, health: str = "/health", on: Host | None = None) -> Proc:
        """An HTTP server process, ready once ``{url}{health}`` answers 200. One that exits
        on its own during start-up is started once more; one that was stopped is not."""
        for attempt in (1, 2):
            proc = self._spawn(name, argv, env, on=on)
            proc.url = url
            try:
                self._wait(proc, lambda: _ok(f"{url}{health}"), timeout)
                return proc
            except Stopped:
                raise
            except RuntimeError:
                # On a host loaded by other work, vLLM's worker start-up has been seen to
                # die once and start fine the next time; a second death is reported.
                if attempt == 2 or proc.alive():
                    raise
                if self.stopping:
                    raise Stopped(f"{name} exited during start-up while the stack is stopping") from None
                self.progress(f"  {name} exited during start-up ({proc.log}); starting it once more")
                self._forget(proc)
                proc.log.rename(proc.log.with_suffix(".failed.log"))
        raise AssertionError("unreachable")

    def proxy(self, name: str, prefill: list[Proc], prefill_daemons: list[Proc], decode: list[Proc],
              port: int = 0, on: Host | None = None, extra: tuple[str, ...] = ()) -> Proc:
        """``pushsvc proxy``; ``prefill_daemons`` empty: it learns P's daemons from P's answers."""
        port = port or free_port()
        host = on.ip if on is not None else "127.0.0.1"
        argv = [sys.executable, "-m", "pushsvc", "proxy", "--port", str(port), "--host", host,
                "--log-format", "json", *extra]
        for p in prefill:
            argv += ["--prefill", p.url]
        for d in prefill_daemons:
            argv += ["--prefill-daemon", d.url]
        for d in decode:
            argv += ["--decode", d.url]
        proc = self._spawn(name, argv, on=on)
        proc.url = f"http://{host}:{port}"
        self._wait(proc, lambda: _ok(f"{proc.url}/healthz"), 60)
        return proc

    def _wait(self, proc: Proc, ready: Callable[[], bool], timeout: float, interval: float = 0.25) -> None:
        start = time.monotonic()
        last = -1
        while not ready():
            if not proc.alive():
                if proc.was_stopped() or self.stopping:
                    raise Stopped(f"{proc.name} was stopped during start-up (exit status {proc.popen.returncode})")
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
            waited = int(time.monotonic() - start)
            if waited > timeout:
                raise RuntimeError(f"{proc.name} not ready after {timeout:.0f}s:\n{proc.tail()}")
            if waited != last and waited % 5 == 0:
                self.progress(f"  waiting for {proc.name} ... {waited}s")
                last = waited
            time.sleep(interval)
        self.progress(f"  {proc.name} ready after {time.monotonic() - start:.1f}s ({proc.url or proc.log})")

    def stop(self, proc: Proc) -> int:
        code = proc.stop()
        self._forget(proc)
        return code

    def close(self) -> dict[str, int]:
        self.refuse_starts()
        codes = {}
        for proc in reversed(list(self.procs)):
            codes[proc.name] = proc.stop()
        self.procs.clear()
        return codes

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def vllm_dtype(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The dtype every vLLM CPU server here runs in: bfloat16, or float32 on a CPU with AMX
    tiles. There vLLM's bfloat16 kernels use AMX (its attention, where the block size is a
    multiple of 32, and oneDNN's GEMMs), and (1) a token computed alone then differs from
    the same token computed in a batch: D, which computes only a prompt's last token over
    P's KV, answers near-ties differently from a colocated vLLM that computed the whole
    prompt, so outputs no longer compare exactly (the KV bytes do: verify mode); (2) a
    worker of a TP 2 engine died of SIGILL (vLLM 0.32, vllm-cpu). float32 takes no AMX path."""
    try:
        with open(cpuinfo) as f:
            amx = any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        amx = False
    return "float32" if amx else "bfloat16"


# Every port ``free_port`` handed out in this process: the kernel may offer a port again
# once its probe socket is closed, before the server it was meant for has bound it, and
# vLLM's API server binds with SO_REUSEPORT, so two servers given one port would both
# start and share its connections (P's and D's legs going to either) instead of failing.
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port free on loopback right now (the caller binds it soon after), never one
    this process handed out before."""
    import socket

    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError("no loopback port left that this process has not handed out")


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def connector_config(role: str, daemon: Proc, **extra: object) -> dict:
    """The kv-transfer-config a vLLM server needs to use pushsvc."""
    return {
        "kv_connector": "PushsvcConnector",
        "kv_connector_module_path": "pushsvc_connector",
        "kv_role": role,
        "kv_connector_extra_config": {"daemon_socket": daemon.info["socket_path"], **extra},
    }
