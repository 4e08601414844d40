"""The proxy's configuration: defaults, normalised URLs, errors naming the field, the CLI."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from pushsvc import cli
from pushsvc.errors import ConfigError
from pushsvc.proxy.config import load_proxy_config


def _cfg(**overrides: Any) -> dict[str, Any]:
    values: dict[str, Any] = {"prefill": ["http://p:8000"], "prefill_daemon": ["http://p:8471"],
                              "decode": ["http://d:8000/"], "port": 8000}
    values.update(overrides)
    return values


def test_config_normalizes_urls_and_keeps_defaults() -> None:
    cfg = load_proxy_config(_cfg(timeout_s=None))
    assert cfg.decode == ["http://d:8000"] and cfg.timeout_s == 300.0 and cfg.host == "127.0.0.1"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"prefill": ["not-a-url"]}, "prefill"),
        ({"decode": ["ftp://d:21"]}, "decode"),
        ({"decode": ["http://d:70000"]}, "decode"),
        ({"prefill_daemon": ["http://a:1", "http://b:1"]}, "prefill_daemon"),
        ({"prefill": ["http://p:1", "http://p:1"], "prefill_daemon": ["http://a:1", "http://b:1"]}, "prefill"),
        ({"port": 70000}, "port"),
        ({"port": "eighty"}, "port"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"remote_tp_size": 0}, "remote_tp_size"),
        ({"decode": []}, "decode"),
    ],
)
def test_config_errors_name_the_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_proxy_config(_cfg(**overrides))
    assert info.value.field == field


_CLI_BASE = ["proxy", "--prefill-daemon", "http://127.0.0.1:8471", "--decode", "http://127.0.0.1:8200",
             "--port", "8000"]


def test_cli_proxy_with_a_bad_url_exits_2() -> None:
    argv = [sys.executable, "-m", "pushsvc", *_CLI_BASE, "--prefill", "not-a-url"]
    out = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "invalid configuration" in out.stderr and "prefill" in out.stderr


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--prefill", "http://127.0.0.1:8100", "--port", "70000"], "port"),
        (["--prefill", "http://127.0.0.1:8100", "--prefill", "http://127.0.0.1:8101"], "prefill_daemon"),
        (["--prefill", "http://127.0.0.1:8100", "--timeout-s", "-1"], "timeout_s"),
    ],
)
def test_cli_proxy_invalid_values_exit_2_naming_the_field(
    args: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([*_CLI_BASE, *args]) == 2
    err = capsys.readouterr().err
    assert "invalid configuration" in err and f"{field}:" in err


def test_config_without_daemon_urls_learns_from_p_but_a_partial_list_is_refused() -> None:
    assert load_proxy_config(_cfg(prefill_daemon=[])).prefill_daemon == []
    with pytest.raises(ConfigError, match="or none to learn each P's daemon from P's answers") as info:
        load_proxy_config(_cfg(prefill=["http://p:1", "http://p:2"]))
    assert info.value.field == "prefill_daemon"


def test_cli_proxy_needs_no_prefill_daemon(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["proxy", "--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200"]
    assert cli.build_parser().parse_args([*argv, "--port", "8000"]).prefill_daemon == []
    assert cli.main([*argv, "--port", "70000"]) == 2  # past the parser, refused by the config
    err = capsys.readouterr().err
    assert "port:" in err and "prefill_daemon" not in err
