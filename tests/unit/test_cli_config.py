"""``pushsvc config check FILE``: the daemon's own loader, every problem it can find, the
effective configuration without secrets, and the exit status ``pushsvc serve`` would give."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pushsvc import cli
from pushsvc.config import load_config

SECRET = "0123456789abcdef0123456789abcdef"


@pytest.fixture(autouse=True)
def _no_pushsvc_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The check reads PUSHSVC_* like the daemon; this machine's must not leak in.
    for var in list(os.environ):
        if var.startswith("PUSHSVC_"):
            monkeypatch.delenv(var)


def _check(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    code = cli.main(["config", "check", str(path), *extra])
    return code, capsys.readouterr().out


def _secret(tmp_path: Path, mode: int = 0o600) -> Path:
    path = tmp_path / "side-channel.secret"
    path.write_text(SECRET + "\n")
    path.chmod(mode)
    return path


def test_valid_file_prints_the_effective_configuration_and_exits_0(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    secret = _secret(tmp_path)
    cfg = tmp_path / "pushsvc.toml"
    cfg.write_text(f'engine_id = "prefill-0"\nlease_s = 7.5\nruntime_dir = "{tmp_path}/rt"\n'
                   f'side_channel_host = "0.0.0.0"\nside_channel_secret_file = "{secret}"\n'
                   'allowed_peer_hosts = ["10.0.0.0/8"]\n')
    code, out = _check(cfg, capsys)
    assert code == 0, out
    assert "valid: no problems found" in out
    shown = dict(line.split(" = ", 1) for line in out.splitlines() if " = " in line and not line.startswith("#"))
    expected = load_config(str(cfg), env={})
    assert json.loads(shown["lease_s"]) == 7.5 == expected.lease_s
    assert json.loads(shown["socket_path"]) == expected.socket_path == f"{tmp_path}/rt/pushsvc.sock"
    assert json.loads(shown["side_channel_secret_file"]) == str(secret)
    assert SECRET not in out  # the path, never the contents


def test_every_problem_is_listed_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text('engine_id = "x"\nhealth_port = 70000\nlease_s = -1\nlog_level = "loud"\n')
    code, out = _check(cfg, capsys)
    assert code == 2 == cli.EXIT_CONFIG
    assert "3 problems:" in out
    for field in ("health_port:", "lease_s:", "log_level:"):
        assert f"  {field}" in out
    # With the invalid fields at their defaults the rest is shown, and says so.
    assert "invalid fields shown at their defaults" in out and 'engine_id = "x"' in out


def test_a_secret_others_can_read_is_a_problem_without_its_contents(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    secret = _secret(tmp_path, 0o644)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'engine_id = "x"\nside_channel_secret_file = "{secret}"\n')
    code, out = _check(cfg, capsys, "--json")
    assert code == 2
    report = json.loads(out)
    assert report["valid"] is False
    assert [p["field"] for p in report["problems"]] == ["side_channel_secret_file"]
    assert "chmod 600" in report["problems"][0]["message"]
    assert SECRET not in out


@pytest.mark.parametrize(("text", "field"), [("no_such_key = 1\n", "no_such_key"),
                                             ("health_port = \n", "config")])
def test_unloadable_files_exit_2_naming_the_field(text: str, field: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    code, out = _check(cfg, capsys)
    assert code == 2
    assert "no effective configuration" in out and f"  {field}:" in out
    code, out = _check(cfg, capsys, "--json")
    report = json.loads(out)
    assert code == 2 and report["config"] is None and report["problems"][0]["field"] == field


def test_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _check(tmp_path / "absent.toml", capsys)
    assert code == 2 and "cannot read" in out


def test_environment_counts_as_for_the_daemon(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('engine_id = "x"\nwatchdog_s = 30\n')
    monkeypatch.setenv("PUSHSVC_WATCHDOG_S", "45")
    code, out = _check(cfg, capsys, "--json")
    report = json.loads(out)
    assert code == 0 and report["config"]["watchdog_s"] == 45.0 and report["env"] == ["PUSHSVC_WATCHDOG_S"]
    monkeypatch.setenv("PUSHSVC_WATCHDOG_S", "soon")
    code, out = _check(cfg, capsys)
    assert code == 2 and "  watchdog_s: cannot parse 'soon'" in out


def test_an_unset_engine_id_is_flagged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'runtime_dir = "{tmp_path}/rt"\n')
    code, out = _check(cfg, capsys)
    assert code == 0
    (line,) = [line for line in out.splitlines() if line.startswith("engine_id = ")]
    assert "a new random id at every start" in line
    cfg.write_text(f'runtime_dir = "{tmp_path}/rt"\nengine_id = "decode-0"\n')
    code, out = _check(cfg, capsys)
    assert 'engine_id = "decode-0"\n' in out


def test_the_example_configuration_checks_with_its_secret(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    example = Path(__file__).resolve().parents[2] / "deploy" / "pushsvc.toml"
    monkeypatch.setenv("PUSHSVC_SIDE_CHANNEL_SECRET_FILE", str(_secret(tmp_path)))
    code, out = _check(example, capsys)
    assert code == 0, out


@pytest.mark.parametrize(("flag", "env", "want"), [("on", "false", True), ("off", "true", False), (None, "false", False),
                                                   (None, None, True)])
def test_serve_poll_hot_yield_flag_overrides_the_environment(flag: str | None, env: str | None, want: bool,
                                                             capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    if env is not None:
        monkeypatch.setenv("PUSHSVC_POLL_HOT_YIELD", env)
    extra = ["--poll-hot-yield", flag] if flag else []
    assert cli.main(["serve", "--engine-id", "unit", *extra, "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["poll_hot_yield"] is want


def test_serve_poll_hot_yield_takes_only_on_or_off(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--engine-id", "unit", "--poll-hot-yield", "yes", "--print-config"])
    assert exc.value.code == 2 and "expected on or off, got 'yes'" in capsys.readouterr().err


def test_serve_poll_spin_flag_overrides_the_environment(capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PUSHSVC_POLL_SPIN_S", "3")
    assert cli.main(["serve", "--engine-id", "unit", "--poll-spin-s", "0.25", "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["poll_spin_s"] == 0.25
