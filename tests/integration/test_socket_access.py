"""Access to a real daemon: SO_PEERCRED admission of workers under other uids and groups,
loopback-only listeners by default, and well-behaved clients next to idle and flooding ones.

The test process runs as root; ``asuser.py`` drops to another uid before it connects.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pushsvc.client import DaemonClient
from pushsvc.config import load_config
from pushsvc.protocol import worker as wp

HERE = Path(__file__).parent
FLOOD = HERE.parent.parent / "benchmarks" / "flood.py"

SOCKET_GID = 64100  # gives the file-system access (socket 0660, runtime dir 0710)
ALLOWED_GID = 64200
ALLOWED_UID = 64000

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs clients under other uids: needs root")


def config_file(base: Path, name: str, text: str) -> str:
    path = base / f"{name}.toml"
    path.write_text(text)
    return str(path)


def as_user(daemon, uid: int, gid: int, groups: list[int] = ()) -> dict:
    out = subprocess.run(
        [sys.executable, str(HERE / "asuser.py"), "--socket", daemon.socket, "--engine-id", daemon.engine_id,
         "--uid", str(uid), "--gid", str(gid), "--groups", ",".join(map(str, groups))],
        capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["uid"] == uid and result["gid"] == gid  # really ran as that user
    return result


@pytest.fixture
def reachable(base_dir: Path) -> Path:
    # Other uids must traverse the test's base directory to reach the runtime dir.
    base_dir.chmod(0o711)
    return base_dir


def rejections(daemon, reason: str) -> float:
    return daemon.metric("pushsvc_rejected_connections_total", listener="unix", reason=reason)


def test_peers_are_admitted_by_uid_or_group_and_others_refused(spawn, reachable: Path) -> None:
    cfg = config_file(reachable, "access", f'socket_group = "{SOCKET_GID}"\nallowed_uids = [{ALLOWED_UID}]\n'
                                           f"allowed_gids = [{ALLOWED_GID}]\n")
    d = spawn.daemon("access", "--config", cfg)
    st = os.stat(d.socket)
    assert (st.st_mode & 0o777, st.st_gid) == (0o660, SOCKET_GID)

    by_uid = as_user(d, ALLOWED_UID, SOCKET_GID)
    assert by_uid["admitted"], by_uid
    by_supplementary = as_user(d, 64002, SOCKET_GID, [ALLOWED_GID])
    assert by_supplementary["admitted"], by_supplementary
    by_primary = as_user(d, 64003, ALLOWED_GID, [SOCKET_GID])
    assert by_primary["admitted"], by_primary
    assert rejections(d, "not_allowed") == 0

    # Reaches the socket through the file system, but neither its uid nor its groups are allowed.
    stranger = as_user(d, 64001, SOCKET_GID)
    assert not stranger["admitted"]
    # The daemon closed it (EOF or EPIPE, depending on timing); not the file system's EACCES.
    assert stranger["error"].startswith("DaemonUnavailable") and "Permission denied" not in stranger["error"]
    assert rejections(d, "not_allowed") == 1
    events = [json.loads(line) for line in d.log().splitlines() if line.startswith("{")]
    refused = [e for e in events if e.get("event") == "worker_rejected"]
    assert [(e["reason"], e["uid"]) for e in refused] == [("not_allowed", 64001)]
    connected = {e["uid"] for e in events if e.get("event") == "worker_connected"}
    assert connected == {ALLOWED_UID, 64002, 64003}


def test_socket_group_is_the_allowed_group_when_no_gids_are_listed(spawn, reachable: Path) -> None:
    d = spawn.daemon("group", "--config", config_file(reachable, "group", f'socket_group = "{SOCKET_GID}"\n'))
    member = as_user(d, 64005, 64005, [SOCKET_GID])
    assert member["admitted"], member
    # Without the group the file system already refuses: the daemon never sees it.
    outsider = as_user(d, 64006, 64006)
    assert not outsider["admitted"] and "Permission denied" in outsider["error"]
    assert rejections(d, "not_allowed") == 0


def test_health_and_side_channel_listen_on_loopback_by_default(spawn) -> None:
    defaults = load_config(None, env={}, overrides={"engine_id": "x", "runtime_dir": "/tmp/x"})
    assert defaults.health_host == "127.0.0.1" and defaults.side_channel_host == "127.0.0.1"
    d = spawn.daemon("loopback")  # no host flags: the defaults
    listening = {(c.laddr.ip, c.laddr.port) for c in psutil.Process(d.proc.pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN}
    # Before any worker exists the daemon has opened exactly these two; the NIXL/UCX
    # listener that comes with a worker's agent is UCX's own (see deploy/README.md).
    assert listening == {("127.0.0.1", d.info["health_port"]), ("127.0.0.1", d.side_port)}


# ---------------------------------------------------------------- slow and flooding clients


def healthz(port: int) -> None:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request("GET", "/healthz")
        r = c.getresponse()
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
    finally:
        c.close()


def worker_round(daemon, token: int) -> None:
    client = DaemonClient(daemon.socket, engine_id=daemon.engine_id, rank=0, tp_size=1, role="both", timeout_s=30)
    try:
        client.connect()
        client.send(wp.Ping(token=token))
        deadline = time.monotonic() + 30
        while not any(isinstance(e, wp.Pong) and e.token == token for e in client.poll()):
            assert time.monotonic() < deadline, "no Pong within 30 s"
            time.sleep(0.005)
    finally:
        client.close()


def load(kind: str, target: str, addr: str, conns: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(FLOOD), "--load", kind, target, addr, str(conns)],
                            stdout=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_well_behaved_clients_get_through_idle_and_flooding_ones(spawn, base_dir: Path) -> None:
    cfg = config_file(base_dir, "flood", "max_pending_workers = 8\nworker_hello_timeout_s = 2.0\n")
    d = spawn.daemon("flood", "--config", cfg)
    port = str(d.info["health_port"])
    loads = [load("idle", "unix", d.socket, 100), load("flood", "unix", d.socket, 0),
             load("idle", "tcp", port, 300), load("slowloris", "tcp", port, 100), load("flood", "tcp", port, 0)]
    try:
        time.sleep(2.0)
        for token in range(1, 21):
            healthz(d.info["health_port"])
            worker_round(d, token)
            # The pending cap holds: at most 8 unfinished connections besides the worker.
            assert d.metric("pushsvc_worker_connections") <= 8 + 1
        time.sleep(2.5)  # past the hello deadline of whatever the idle load holds now
    finally:
        stats = []
        for p in loads:
            p.send_signal(signal.SIGTERM)
            out, _ = p.communicate(timeout=60)
            stats.append(json.loads(out.strip().splitlines()[-1]))
    idle_unix = stats[0]
    assert idle_unix["dropped"] > 0  # the daemon closed idle worker connections ...
    assert rejections(d, "pending_overflow") + rejections(d, "hello_timeout") >= idle_unix["dropped"]  # ... counted
    assert rejections(d, "pending_overflow") > 0
    assert all(s["opened"] > 0 for s in stats)
    print("loads:", stats)
