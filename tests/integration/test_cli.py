"""The ``pushsvc`` command as operators and scripts use it."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procs import start_daemon


def _pushsvc(*args: str, env=None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pushsvc", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--health-port", "70000"], "health_port"),
        (["--lease-s", "-1"], "lease_s"),
        (["--side-channel-port", "-5"], "side_channel_port"),
    ],
)
def test_invalid_flag_exits_2_naming_the_field(args, field, base_dir):
    out = _pushsvc("serve", "--runtime-dir", str(base_dir), *args)
    assert out.returncode == 2
    assert field in out.stderr and "invalid configuration" in out.stderr


def test_invalid_config_file_exits_2(base_dir):
    cfg = base_dir / "bad.toml"
    cfg.write_text('health_port = "eighty"\n')
    out = _pushsvc("serve", "--config", str(cfg))
    assert out.returncode == 2 and "health_port" in out.stderr
    cfg.write_text("no_such_key = 1\n")
    out = _pushsvc("serve", "--config", str(cfg))
    assert out.returncode == 2 and "no_such_key" in out.stderr


def test_invalid_env_exits_2(base_dir):
    env = {**os.environ, "PUSHSVC_WATCHDOG_S": "soon"}
    out = _pushsvc("serve", "--runtime-dir", str(base_dir), env=env)
    assert out.returncode == 2 and "watchdog_s" in out.stderr


def test_print_config_resolves_layers(base_dir):
    cfg = base_dir / "c.toml"
    cfg.write_text("[pushsvc]\nlease_s = 7.5\nhealth_port = 9000\n")
    out = _pushsvc("serve", "--config", str(cfg), "--health-port", "9100", "--runtime-dir", str(base_dir),
                   "--print-config")
    assert out.returncode == 0, out.stderr
    resolved = json.loads(out.stdout)
    assert resolved["lease_s"] == 7.5 and resolved["health_port"] == 9100
    assert resolved["socket_path"] == str(base_dir / "pushsvc.sock")


def test_sigterm_drains_and_exits_0(base_dir):
    d = start_daemon(base_dir, "term")
    assert d.get("/readyz")[0] == 200
    t0 = time.monotonic()
    assert d.stop(signal.SIGTERM) == 0
    assert time.monotonic() - t0 < 15
    log = d.log()
    assert '"daemon_stopping"' in log and '"daemon_stopped"' in log
    assert not (d.runtime_dir / "pushsvc.sock").exists()


@pytest.mark.parametrize("flags, want", [((), False), (("--ucx-sgl", "on"), True), (("--ucx-sgl", "off"), False)])
def test_the_daemon_says_how_it_posts_writes(base_dir, flags, want):
    d = start_daemon(base_dir, "sgl", "--gpu", "off", *flags)
    try:
        started = [json.loads(line) for line in d.log().splitlines() if '"daemon_started"' in line]
    finally:
        d.stop()
    assert len(started) == 1 and started[0]["ucx_sgl"] is want


def test_sigint_twice_exits_cleanly(base_dir):
    d = start_daemon(base_dir, "int")
    d.proc.send_signal(signal.SIGINT)
    d.proc.send_signal(signal.SIGINT)
    assert d.proc.wait(15) == 0


def test_status_prints_engine_and_tables(base_dir):
    d = start_daemon(base_dir, "stat")
    try:
        out = _pushsvc("status", "--url", d.url)
        assert out.returncode == 0, out.stderr
        assert "stat" in out.stdout and "tables" in out.stdout
        js = _pushsvc("status", "--url", d.url, "--json")
        data = json.loads(js.stdout)
        assert data["info"]["engine_id"] == "stat" and data["ready"]["ready"] is True
    finally:
        assert d.stop() == 0
    out = _pushsvc("status", "--url", d.url)
    assert out.returncode == 1 and "cannot reach" in out.stderr


def test_second_daemon_on_a_live_socket_refuses(base_dir):
    d = start_daemon(base_dir, "first")
    try:
        out = _pushsvc("serve", "--socket", d.socket, "--runtime-dir", str(base_dir / "first"),
                       "--health-port", "0", "--side-channel-port", "0", "--log-format", "json")
        assert out.returncode == 1
        assert "another daemon is listening" in out.stderr + out.stdout
        assert d.get("/healthz")[0] == 200
    finally:
        assert d.stop() == 0


# ---------------------------------------------------------------- side channel off loopback


def _events(log: str) -> list[dict]:
    return [json.loads(line) for line in log.splitlines() if line.startswith("{")]


def test_side_channel_off_loopback_without_a_secret_exits_2(base_dir):
    out = _pushsvc("serve", "--runtime-dir", str(base_dir), "--side-channel-host", "0.0.0.0",
                   "--allowed-peer-host", "10.0.0.0/8")
    assert out.returncode == 2
    assert "side_channel_secret_file" in out.stderr and "--insecure-side-channel" in out.stderr
    out = _pushsvc("serve", "--runtime-dir", str(base_dir), "--side-channel-host", "0.0.0.0",
                   "--insecure-side-channel")
    assert out.returncode == 2 and "allowed_peer_hosts" in out.stderr


def test_health_off_loopback_without_a_token_exits_2_and_the_flags_lift_it(base_dir):
    out = _pushsvc("serve", "--runtime-dir", str(base_dir), "--health-host", "0.0.0.0")
    assert out.returncode == 2
    assert "health_token_file" in out.stderr and "--insecure-health" in out.stderr
    out = _pushsvc("serve", "--runtime-dir", str(base_dir), "--health-host", "0.0.0.0", "--insecure-health",
                   "--print-config")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["insecure_health"] is True
    token = base_dir / "health.token"
    token.write_text("0123456789abcdef0123456789abcdef\n")
    token.chmod(0o600)
    out = _pushsvc("serve", "--runtime-dir", str(base_dir), "--health-host", "0.0.0.0", "--health-token-file",
                   str(token), "--print-config")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["health_token_file"] == str(token)


def test_insecure_side_channel_and_peer_hosts_flags(base_dir):
    out = _pushsvc("serve", "--runtime-dir", str(base_dir), "--side-channel-host", "0.0.0.0",
                   "--insecure-side-channel", "--allowed-peer-host", "10.0.0.0/8", "--allowed-peer-host", "*",
                   "--print-config")
    assert out.returncode == 0, out.stderr
    resolved = json.loads(out.stdout)
    assert resolved["insecure_side_channel"] is True
    assert resolved["allowed_peer_hosts"] == ["10.0.0.0/8", "*"]


def test_insecure_side_channel_warns_at_every_start(base_dir):
    for _ in range(2):
        d = start_daemon(base_dir, "insecure", "--insecure-side-channel")
        assert d.stop() == 0
        warned = [e for e in _events(d.log()) if e.get("event") == "side_channel_unauthenticated"]
        assert len(warned) == 1 and warned[0]["level"] == "warning", d.log()
        assert warned[0]["port"] == d.side_port
    d = start_daemon(base_dir, "secure")  # on loopback without the opt-out: no warning
    assert d.stop() == 0
    assert not [e for e in _events(d.log()) if e.get("event") == "side_channel_unauthenticated"]


# ---------------------------------------------------------------- runtime and socket directories


def test_runtime_dir_of_another_user_exits_2(base_dir):
    if os.geteuid() != 0:
        pytest.skip("makes a directory owned by another uid: needs root")
    taken = base_dir / "pushsvc-0"  # what another local user could create under /tmp first
    taken.mkdir(mode=0o777)
    os.chown(taken, 65534, 65534)
    out = _pushsvc("serve", "--runtime-dir", str(taken), "--health-port", "0", "--side-channel-port", "0",
                   timeout=30)
    assert out.returncode == 2, out.stderr
    assert f"runtime_dir: {taken} is owned by uid 65534 (nobody)" in out.stderr
    assert not (taken / "pushsvc.sock").exists()


def test_runtime_dir_symlink_exits_2(base_dir):
    (base_dir / "real").mkdir()
    (base_dir / "link").symlink_to(base_dir / "real")
    out = _pushsvc("serve", "--runtime-dir", str(base_dir / "link"), "--health-port", "0",
                   "--side-channel-port", "0", timeout=30)
    assert out.returncode == 2, out.stderr
    assert f"runtime_dir: {base_dir / 'link'} is a symbolic link" in out.stderr
    assert not list((base_dir / "real").iterdir())


def test_missing_socket_dir_is_created_0700(base_dir):
    sock = base_dir / "sockets" / "p" / "pushsvc.sock"
    d = start_daemon(base_dir, "sockdir", "--socket", str(sock))
    try:
        assert d.socket == str(sock) and sock.is_socket()
        assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
    finally:
        assert d.stop() == 0


def test_socket_dir_that_cannot_be_created_exits_2(base_dir):
    (base_dir / "file").write_text("")
    sock = base_dir / "file" / "dir" / "pushsvc.sock"
    out = _pushsvc("serve", "--runtime-dir", str(base_dir / "rt"), "--socket", str(sock), "--health-port", "0",
                   "--side-channel-port", "0", timeout=30)
    assert out.returncode == 2, out.stderr
    assert f"socket_path: cannot create the directory {sock.parent}" in out.stderr


def test_example_config_passes_print_config(base_dir):
    secret = base_dir / "side-channel.secret"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    secret.chmod(0o600)
    example = Path(__file__).resolve().parents[2] / "deploy" / "pushsvc.toml"
    out = _pushsvc("serve", "--config", str(example), "--side-channel-secret-file", str(secret), "--print-config")
    assert out.returncode == 0, out.stderr
    resolved = json.loads(out.stdout)
    assert resolved["side_channel_secret_file"] == str(secret) and resolved["allowed_peer_hosts"]
