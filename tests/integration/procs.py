"""Real processes for integration tests: ``pushsvc serve`` daemons and kvworker workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).parent


@dataclass
class DaemonProc:
    engine_id: str
    runtime_dir: Path
    proc: subprocess.Popen
    info: dict = field(default_factory=dict)
    log_path: Path | None = None

    @property
    def socket(self) -> str:
        return self.info["socket_path"]

    @property
    def side_port(self) -> int:
        return self.info["side_channel_port"]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.info['health_port']}"

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def live_info(self) -> dict:
        return json.loads(self.get("/v1/info")[1])

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        total = 0.0
        for line in self.get("/metrics")[1].splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            key, _, value = line.rpartition(" ")
            sample, _, label_text = key.partition("{")
            if sample != name:
                continue
            if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
                total += float(value)
        return total

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path and self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_daemon(base: Path, engine_id: str, *extra: str, timeout: float = 60.0) -> DaemonProc:
    runtime = base / engine_id
    runtime.mkdir(parents=True, exist_ok=True)
    ready = runtime / "ready.json"
    ready.unlink(missing_ok=True)  # a restart under the same engine id must not read the old one
    log_path = runtime / "daemon.log"
    cmd = [sys.executable, "-m", "pushsvc", "serve", "--engine-id", engine_id, "--runtime-dir", str(runtime),
           "--health-port", "0", "--side-channel-port", "0", "--ready-file", str(ready),
           "--log-format", "json", *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PUSHSVC_")}
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    d = DaemonProc(engine_id, runtime, proc, log_path=log_path)
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"daemon {engine_id} exited {proc.returncode}:\n{d.log()}")
        if time.monotonic() > deadline:
            d.stop(signal.SIGKILL)
            raise RuntimeError(f"daemon {engine_id} not ready after {timeout}s:\n{d.log()}")
        time.sleep(0.02)
    d.info = json.loads(ready.read_text())
    return d


class LineChild:
    """A helper process driven by JSON lines: one command per line on its stdin, one
    reply per line on its stdout (its first line is its hello)."""

    def __init__(self, args: list[str], opts: dict, env: dict[str, str] | None = None, what: str = "worker") -> None:
        for k, v in opts.items():
            args = [*args, f"--{k.replace('_', '-')}", str(v)]
        self.opts = opts
        self._what = what
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                     env=env)
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self._what} exited with {self.proc.wait()}")
        return json.loads(line)

    def call(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        if not reply.get("ok"):
            raise RuntimeError(reply.get("error"))
        return reply


class WorkerProc(LineChild):
    def __init__(self, daemon: DaemonProc, role: str, **opts) -> None:
        super().__init__([sys.executable, str(HERE / "kvworker.py"), "--socket", daemon.socket,
                          "--engine-id", daemon.engine_id, "--role", role], opts)

    def wait(self, request_id: str, timeout: float = 20.0) -> dict | None:
        return self.call("wait", request_id=request_id, timeout=timeout)["event"]

    def digests(self) -> list[list[str]]:
        return self.call("digests")["digests"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        elif not self.proc.stdin.closed:
            # A worker killed by the test: its pipe is closed here, not by the collector.
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        self.proc.stdout.close()


def tables_empty(*daemons: DaemonProc, timeout: float = 5.0) -> bool:
    """Whether every table of each daemon empties within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(not any(d.live_info()["tables"].values()) for d in daemons):
            return True
        time.sleep(0.05)
    return False


def joint_announced(P: DaemonProc, D: DaemonProc) -> None:
    """Wait until D's joint agent (D TP above P's) is one of the agents P knows."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        joints = D.live_info()["joints"]
        peers = P.live_info()["peers"]
        if joints and peers and joints[0]["agent"] in peers[0]["agents"]:
            return
        time.sleep(0.05)
    raise AssertionError(f"D's joint agent never reached P: {D.live_info()['joints']} {P.live_info()['peers']}")
