"""systemd readiness and watchdog (``pushsvc/sdnotify.py``), seen from a notify socket the
test binds itself, as systemd would: a real in-process daemon over the fake engine tells
it READY=1, STATUS=, WATCHDOG=1 and STOPPING=1. Also the unit file, verified and assessed
by the real ``systemd-analyze``."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import structlog
from daemon_fixtures import WAIT_S, Worker, running_daemon

from pushsvc.engine.fake import FakeEngine
from pushsvc.sdnotify import Notifier, notify_address, watchdog_interval
from pushsvc.server.daemon import Daemon

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "pushsvc.service"
OPERATIONS = ROOT / "docs" / "operations.md"
INSTALLED_BINARY = "/opt/pushsvc/.venv/bin/pushsvc"


@dataclass
class Received:
    at: float  # time.monotonic() when the datagram was read
    fields: dict[str, str]


@dataclass
class NotifySocket:
    """A bound ``AF_UNIX`` datagram socket read by a thread, so that arrival times are
    taken while the event loop under test is blocked."""

    sock: socket.socket
    name: str  # what NOTIFY_SOCKET holds
    messages: list[Received] = field(default_factory=list)
    arrived: threading.Condition = field(default_factory=threading.Condition)

    def env(self, **extra: str) -> dict[str, str]:
        return {"NOTIFY_SOCKET": self.name, **extra}

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(4096)
            except OSError:
                return
            if not data:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if line)
            with self.arrived:
                self.messages.append(Received(time.monotonic(), fields))
                self.arrived.notify_all()

    def with_key(self, key: str) -> list[Received]:
        with self.arrived:
            return [m for m in self.messages if key in m.fields]

    def wait_for(self, key: str, count: int = 1, timeout: float = WAIT_S) -> list[Received]:
        """Block (in a thread) until ``count`` datagrams carried ``key``."""
        with self.arrived:
            ok = self.arrived.wait_for(lambda: len([m for m in self.messages if key in m.fields]) >= count, timeout)
        assert ok, f"{count} x {key} not received within {timeout}s; got {self.messages}"
        return self.with_key(key)

    async def await_key(self, key: str, count: int = 1, timeout: float = WAIT_S) -> list[Received]:
        return await asyncio.to_thread(self.wait_for, key, count, timeout)


@contextmanager
def notify_socket(abstract: bool = False) -> Iterator[NotifySocket]:
    base = tempfile.mkdtemp(prefix="psn")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = f"pushsvc-test-{uuid.uuid4().hex}"
        sock.bind("\0" + name)
        env_name = "@" + name
    else:
        env_name = f"{base}/notify"
        sock.bind(env_name)
    ns = NotifySocket(sock, env_name)
    reader = threading.Thread(target=ns._read, daemon=True)
    reader.start()
    try:
        yield ns
    finally:
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        reader.join(WAIT_S)
        shutil.rmtree(base, ignore_errors=True)


def notified_daemon(env: dict[str, str]) -> AbstractAsyncContextManager[Daemon]:
    """A real daemon whose notifier is read from ``env``, as ``pushsvc serve`` reads it from
    its environment; shut down on exit unless the test already did."""
    return running_daemon(FakeEngine(), "notified", notifier=Notifier.from_env(env))


# ---------------------------------------------------------------- the environment


def test_addresses_and_watchdog_interval_from_the_environment() -> None:
    assert notify_address({}) is None
    assert notify_address({"NOTIFY_SOCKET": ""}) is None
    assert notify_address({"NOTIFY_SOCKET": "/run/systemd/notify"}) == "/run/systemd/notify"
    assert notify_address({"NOTIFY_SOCKET": "@sd/notify"}) == "\0sd/notify"
    assert notify_address({"NOTIFY_SOCKET": "vsock:2:1234"}) is None
    me = os.getpid()
    assert watchdog_interval({"WATCHDOG_USEC": "20000000"}, me) == 10.0
    assert watchdog_interval({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": str(me)}, me) == 10.0
    assert watchdog_interval({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": str(me + 1)}, me) is None
    assert watchdog_interval({}, me) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}, me) is None
    assert watchdog_interval({"WATCHDOG_USEC": "soon"}, me) is None


def test_without_notify_socket_nothing_is_sent() -> None:
    notifier = Notifier.from_env({"WATCHDOG_USEC": "1000000"})
    assert not notifier.enabled and notifier.watchdog_s is None
    assert notifier.notify(ready="1") is False
    assert notifier.sent == 0


@pytest.mark.asyncio
async def test_daemon_without_notify_socket_starts_and_stops() -> None:
    async with notified_daemon({}) as daemon:
        assert daemon.readiness()[0]
        assert daemon._notify_task is not None
    assert daemon.notifier.sent == 0


# ---------------------------------------------------------------- readiness and stopping


@pytest.mark.asyncio
@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
async def test_ready_at_startup_and_stopping_at_shutdown(abstract: bool) -> None:
    with notify_socket(abstract=abstract) as ns:
        async with notified_daemon(ns.env()) as daemon:
            (ready,) = await ns.await_key("READY")
            assert ready.fields["READY"] == "1"
            assert ready.fields["STATUS"].startswith("ready: 0/0 ranks registered")
            # The same moment /readyz turns 200: the daemon was ready when it said so.
            assert daemon.readiness()[0]
            assert ns.with_key("STOPPING") == []
            await daemon.shutdown()
            (stopping,) = await ns.await_key("STOPPING")
            assert stopping.fields["STOPPING"] == "1" and stopping.fields["STATUS"].startswith("draining")
        assert len(ns.with_key("READY")) == 1


@pytest.mark.asyncio
async def test_status_line_follows_ranks() -> None:
    """A worker that said hello but has not registered its KV makes the daemon not ready;
    registering makes it ready again. systemctl status sees both."""
    with notify_socket() as ns:
        async with notified_daemon(ns.env()) as daemon:
            await ns.await_key("READY")
            worker = Worker(daemon, "producer")
            try:
                await worker.connect()
                (status,) = await _await_status(ns, "not ready: 0/1 ranks registered, 1 workers connected")
                assert not daemon.readiness()[0]
                await worker.register(4)
                await _await_status(ns, "ready: 1/1 ranks registered, 1 workers connected, 0 peers")
            finally:
                worker.close()
            assert len(ns.with_key("READY")) == 1  # READY=1 is said once; later changes are STATUS=


async def _await_status(ns: NotifySocket, prefix: str) -> list[Received]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while True:
        found = [m for m in ns.with_key("STATUS") if m.fields["STATUS"].startswith(prefix)]
        if found:
            return found
        assert loop.time() < deadline, f"no STATUS starting {prefix!r}: {ns.with_key('STATUS')}"
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------- watchdog


WATCHDOG_USEC = 1_000_000  # pings every 0.5 s


@pytest.mark.asyncio
async def test_watchdog_pings_at_half_the_interval() -> None:
    with notify_socket() as ns:
        async with notified_daemon(ns.env(WATCHDOG_USEC=str(WATCHDOG_USEC), WATCHDOG_PID=str(os.getpid()))):
            pings = await ns.await_key("WATCHDOG", count=5, timeout=10 * WAIT_S)
    gaps = [b.at - a.at for a, b in zip(pings, pings[1:])]
    half = WATCHDOG_USEC / 2e6
    # Never faster than asked (the reader's clock may lag a ping by a little), and in the
    # median well inside the deadline systemd enforces (the whole WATCHDOG_USEC).
    assert min(gaps) > 0.8 * half, gaps
    assert statistics.median(gaps) < 1.5 * half, gaps


@pytest.mark.asyncio
async def test_no_watchdog_ping_for_another_pid() -> None:
    with notify_socket() as ns:
        async with notified_daemon(ns.env(WATCHDOG_USEC="200000", WATCHDOG_PID=str(os.getpid() + 1))) as daemon:
            await ns.await_key("READY")
            assert daemon.notifier.watchdog_s is None
            # A STATUS= change reaches us only through the notifier's loop, a second or so
            # later: five would-be watchdog intervals in which no ping came.
            worker = Worker(daemon, "producer")
            try:
                await worker.connect()
                await _await_status(ns, "not ready")
            finally:
                worker.close()
        assert ns.with_key("WATCHDOG") == []


@pytest.mark.asyncio
async def test_a_blocked_loop_sends_no_pings() -> None:
    """The pings come from the event loop: blocking it for four intervals must stop them
    (a thread sending them would keep systemd fooled), and they resume once it turns."""
    half = WATCHDOG_USEC / 2e6
    with notify_socket() as ns:
        async with notified_daemon(ns.env(WATCHDOG_USEC=str(WATCHDOG_USEC))):
            await ns.await_key("WATCHDOG", count=2, timeout=10 * WAIT_S)
            before = len(ns.with_key("WATCHDOG"))
            blocked_from = time.monotonic()
            time.sleep(4 * half)  # blocks the event loop on purpose
            blocked_until = time.monotonic()
            during = [m for m in ns.with_key("WATCHDOG") if blocked_from + 0.1 < m.at < blocked_until]
            assert during == []
            await ns.await_key("WATCHDOG", count=before + 1, timeout=10 * WAIT_S)
            resumed = ns.with_key("WATCHDOG")[before]
            assert resumed.at >= blocked_until - 0.05


# ---------------------------------------------------------------- sending never hurts


@pytest.mark.asyncio
async def test_a_missing_socket_is_logged_once_and_the_daemon_runs_on() -> None:
    base = tempfile.mkdtemp(prefix="psn")
    try:
        env = {"NOTIFY_SOCKET": f"{base}/nobody-listens", "WATCHDOG_USEC": "100000"}
        with structlog.testing.capture_logs() as events:
            async with notified_daemon(env) as daemon:
                notifier = daemon.notifier  # READY=1 has failed already, at startup
                assert notifier.notify(watchdog="1") is False
                assert daemon.readiness()[0]
            assert daemon.stopped
        failures = [e for e in events if e["event"] == "sd_notify_failed"]
        assert len(failures) == 1 and "FileNotFoundError" in failures[0]["error"]
        assert notifier.sent == 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.asyncio
async def test_an_unwritable_socket_does_not_crash() -> None:
    """A path that is a directory, and a datagram socket nobody reads any more."""
    base = tempfile.mkdtemp(prefix="psn")
    try:
        with structlog.testing.capture_logs() as events:
            async with notified_daemon({"NOTIFY_SOCKET": base}):
                pass
        assert [e["event"] for e in events].count("sd_notify_failed") == 1
        gone = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        gone.bind(f"{base}/closed")
        gone.close()  # the file stays, nothing is bound to it: ECONNREFUSED
        notifier = Notifier.from_env({"NOTIFY_SOCKET": f"{base}/closed"})
        with structlog.testing.capture_logs() as events:
            assert notifier.notify(ready="1") is False
            assert notifier.notify(ready="1") is False
        notifier.close()
        assert [e["event"] for e in events] == ["sd_notify_failed"]
        assert "ConnectionRefusedError" in events[0]["error"]
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_full_socket_never_blocks() -> None:
    """systemd not reading: once the socket's queue is full (net.unix.max_dgram_qlen, 10 by
    default) sends fail at once (MSG_DONTWAIT) instead of stalling the loop. Sent from a
    thread so that a blocking send fails the test instead of hanging it."""
    base = tempfile.mkdtemp(prefix="psn")
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sink.bind(f"{base}/sink")
        notifier = Notifier.from_env({"NOTIFY_SOCKET": f"{base}/sink"})
        results: list[bool] = []
        sender = threading.Thread(target=lambda: results.extend(notifier.notify(status="x") for _ in range(1000)),
                                  daemon=True)
        sender.start()
        sender.join(WAIT_S)
        assert not sender.is_alive(), "a send blocked on the full socket"
        assert results[0] is True and results[-1] is False
        notifier.close()
    finally:
        sink.close()
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------- the unit file


def _unit_with_real_binary(tmp_path: Path) -> Path:
    """deploy/pushsvc.service with ExecStart pointing at this checkout's pushsvc: verify
    checks that the executable exists, and /opt/pushsvc is where an installation puts it,
    not where this checkout has it. Nothing else of the unit is changed."""
    binary = ROOT / ".venv" / "bin" / "pushsvc"
    assert binary.exists(), f"{binary}: build the venv (make venv)"
    text = UNIT.read_text()
    assert INSTALLED_BINARY in text
    copy = tmp_path / "pushsvc.service"
    copy.write_text(text.replace(INSTALLED_BINARY, str(binary)))
    return copy


def _systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.skip("systemd-analyze is not installed")
    return found


def test_unit_declares_notify_readiness_and_a_watchdog() -> None:
    settings = dict(line.split("=", 1) for line in UNIT.read_text().splitlines()
                    if re.match(r"^[A-Za-z]+=", line))
    assert settings["Type"] == "notify" and settings["NotifyAccess"] == "main"
    assert settings["WatchdogSec"].endswith("s") and int(settings["WatchdogSec"][:-1]) > 0
    assert "ExecStartPost" not in settings  # readiness comes from the daemon itself now
    assert settings["Restart"] == "on-failure"  # covers the watchdog's kill


def test_systemd_analyze_verify_passes(tmp_path: Path) -> None:
    """``systemd-analyze verify`` on the unit, with only ExecStart rewritten (see
    ``_unit_with_real_binary``). Fails, not skips, when systemd-analyze is present."""
    analyze = _systemd_analyze()
    out = subprocess.run([analyze, "verify", str(_unit_with_real_binary(tmp_path))],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "pushsvc.service" not in out.stderr, out.stderr  # no warning about our unit either


def test_security_exposure_is_the_one_documented(tmp_path: Path) -> None:
    """``systemd-analyze security --offline=yes`` needs no running systemd; the figure in
    docs/operations.md must be what it says of the unit as it is now."""
    analyze = _systemd_analyze()
    out = subprocess.run([analyze, "security", "--offline=yes", str(_unit_with_real_binary(tmp_path))],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    match = re.search(r"Overall exposure level for pushsvc.service: ([0-9.]+) (\w+)", out.stdout)
    assert match, out.stdout[-500:]
    assert f"exposure {match.group(1)} {match.group(2)}" in OPERATIONS.read_text()


# ---------------------------------------------------------------- `pushsvc serve` as systemd runs it


def test_pushsvc_serve_notifies_from_its_main_process(tmp_path: Path) -> None:
    """The real command line reads $NOTIFY_SOCKET itself: READY=1, then STOPPING=1 on SIGTERM,
    each sent by the process systemd started (``SO_PASSCRED``: the pid NotifyAccess=main
    accepts), and a clean exit. The real NIXL engine, so this is the slowest test here."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    sock.settimeout(60)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PUSHSVC_", "WATCHDOG_"))}
    env["NOTIFY_SOCKET"] = str(tmp_path / "notify")
    cmd = [sys.executable, "-m", "pushsvc", "serve", "--engine-id", "unit", "--runtime-dir", str(tmp_path / "rt"),
           "--health-port", "0", "--side-channel-port", "0", "--log-format", "json", "--gpu", "off"]
    log_path = tmp_path / "daemon.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        senders: list[int] = []
        messages: list[dict[str, str]] = []

        def receive_until(key: str) -> None:
            while not any(key in m for m in messages):
                data, ancillary, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(12))
                for level, kind, payload in ancillary:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                        senders.append(struct.unpack("iII", payload[:12])[0])
                messages.append(dict(line.split("=", 1) for line in data.decode().splitlines() if line))

        receive_until("READY")
        assert proc.poll() is None, log_path.read_text()
        proc.send_signal(signal.SIGTERM)
        receive_until("STOPPING")
        assert proc.wait(30) == 0, log_path.read_text()
        assert set(senders) == {proc.pid} and len(senders) == len(messages)
        assert messages[0]["READY"] == "1" and messages[0]["STATUS"].startswith("ready: ")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sock.close()
