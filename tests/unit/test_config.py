"""load_config: layering, derived defaults and every rejection path, without touching os.environ."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import msgspec
import pytest

from pushsvc.config import MiB, Config, load_config, to_dict, translate_validation_error
from pushsvc.errors import ConfigError
from pushsvc.proxy.config import ProxyConfig, load_proxy_config

# A stand-in for an empty environment that still fixes the runtime dir.
BASE_ENV = {"XDG_RUNTIME_DIR": "/run/user/1000"}


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "pushsvc.toml"
    path.write_text(text)
    return str(path)


def config_error(**kwargs: object) -> ConfigError:
    kwargs.setdefault("env", BASE_ENV)
    with pytest.raises(ConfigError) as info:
        load_config(**kwargs)  # type: ignore[arg-type]
    return info.value


# Defaults and derived values


def test_defaults_resolve_under_xdg_runtime_dir() -> None:
    cfg = load_config(env=BASE_ENV)
    assert cfg.runtime_dir == "/run/user/1000/pushsvc"
    assert cfg.socket_path == "/run/user/1000/pushsvc/pushsvc.sock"
    assert cfg.health_port == 8471
    assert cfg.side_channel_port == 8472
    assert cfg.advertised_host == "127.0.0.1"
    assert cfg.nixl_backends == ["UCX"]
    assert cfg.max_worker_frame == 16 * MiB
    assert cfg.allowed_uids == []
    assert cfg.side_channel_secret_file == "" and cfg.insecure_side_channel is False
    assert cfg.allowed_peer_hosts == []


def test_runtime_dir_falls_back_to_tmp_per_uid() -> None:
    cfg = load_config(env={})
    assert cfg.runtime_dir == f"/tmp/pushsvc-{os.getuid()}"
    assert cfg.socket_path == f"{cfg.runtime_dir}/pushsvc.sock"


def test_engine_id_generated_from_hostname_and_unique() -> None:
    first = load_config(env=BASE_ENV).engine_id
    second = load_config(env=BASE_ENV).engine_id
    host, _, suffix = first.rpartition("-")
    assert host == socket.gethostname()
    assert len(suffix) == 8
    assert first != second


def test_explicit_values_are_kept_by_resolve() -> None:
    cfg = load_config(
        env=BASE_ENV,
        overrides={"engine_id": "p0", "socket_path": "/x/s.sock", "advertised_host": "10.0.0.5"},
    )
    assert (cfg.engine_id, cfg.socket_path, cfg.advertised_host) == ("p0", "/x/s.sock", "10.0.0.5")
    assert cfg.resolve(BASE_ENV) == cfg


def test_wildcard_bind_advertises_hostname() -> None:
    cfg = load_config(env=BASE_ENV, overrides={"side_channel_host": "0.0.0.0", "insecure_side_channel": True,
                                                "allowed_peer_hosts": ["*"]})
    assert cfg.advertised_host == socket.gethostname()


def test_to_dict_is_plain_builtins() -> None:
    d = to_dict(load_config(env=BASE_ENV, overrides={"engine_id": "e"}))
    assert d["engine_id"] == "e"
    assert d["nixl_backends"] == ["UCX"]
    assert set(d) == set(Config.__struct_fields__)


# Layering


def test_toml_top_level(tmp_path: Path) -> None:
    path = write(tmp_path, 'health_port = 9000\nlease_s = 30\nnixl_backends = ["UCX", "GDS"]\n')
    cfg = load_config(path, env=BASE_ENV)
    assert cfg.health_port == 9000
    assert cfg.lease_s == 30.0
    assert cfg.nixl_backends == ["UCX", "GDS"]


def test_toml_pushsvc_table_ignores_other_tools_tables(tmp_path: Path) -> None:
    path = write(tmp_path, "[pushsvc]\nhealth_port = 9001\n\n[vllm]\nwhatever = 1\n")
    assert load_config(path, env=BASE_ENV).health_port == 9001


def test_toml_key_outside_pushsvc_table_rejected(tmp_path: Path) -> None:
    path = write(tmp_path, 'log_level = "debug"\n[pushsvc]\nhealth_port = 9001\n')
    assert config_error(path=path).field == "log_level"


def test_env_overrides_file(tmp_path: Path) -> None:
    path = write(tmp_path, "health_port = 9000\nnixl_progress_thread = false\n")
    cfg = load_config(path, env={**BASE_ENV, "PUSHSVC_HEALTH_PORT": "9100", "PUSHSVC_NIXL_PROGRESS_THREAD": "yes"})
    assert cfg.health_port == 9100
    assert cfg.nixl_progress_thread is True


def test_overrides_beat_env_and_none_is_ignored() -> None:
    env = {**BASE_ENV, "PUSHSVC_HEALTH_PORT": "9100", "PUSHSVC_LOG_LEVEL": "debug"}
    cfg = load_config(env=env, overrides={"health_port": 9200, "log_level": None})
    assert cfg.health_port == 9200
    assert cfg.log_level == "debug"


def test_config_path_from_env(tmp_path: Path) -> None:
    path = write(tmp_path, "health_port = 9300\n")
    assert load_config(env={**BASE_ENV, "PUSHSVC_CONFIG": path}).health_port == 9300


def test_env_lists_and_types() -> None:
    env = {
        **BASE_ENV,
        "PUSHSVC_ALLOWED_UIDS": "1000,1001",
        "PUSHSVC_NIXL_BACKENDS": "UCX, GDS",
        "PUSHSVC_PEER_TIMEOUT_S": "7.5",
        "PUSHSVC_NIXL_PROGRESS_THREAD": "1",
        "PUSHSVC_SOCKET_GROUP": "kv",
    }
    cfg = load_config(env=env)
    assert cfg.allowed_uids == [1000, 1001]
    assert cfg.nixl_backends == ["UCX", "GDS"]
    assert cfg.peer_timeout_s == 7.5
    assert cfg.nixl_progress_thread is True
    assert cfg.socket_group == "kv"


def test_busy_polling_is_off_by_default_and_zero_is_valid() -> None:
    assert load_config(env=BASE_ENV).poll_spin_s == 0.0
    assert load_config(env={**BASE_ENV, "PUSHSVC_POLL_SPIN_S": "0"}).poll_spin_s == 0.0
    assert load_config(env={**BASE_ENV, "PUSHSVC_POLL_SPIN_S": "1.5"}).poll_spin_s == 1.5


@pytest.mark.parametrize(("raw", "expected"), [("0", False), ("FALSE", False), ("no", False), ("True", True)])
def test_env_bool_words(raw: str, expected: bool) -> None:
    assert load_config(env={**BASE_ENV, "PUSHSVC_NIXL_PROGRESS_THREAD": raw}).nixl_progress_thread is expected


# Rejections, each naming the field


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"health_port": 70000}, "health_port"),
        ({"side_channel_port": -1}, "side_channel_port"),
        ({"lease_s": -1.0}, "lease_s"),
        ({"drain_timeout_s": 0.0}, "drain_timeout_s"),
        ({"watchdog_s": float("nan")}, "watchdog_s"),
        ({"max_peer_frame": 0}, "max_peer_frame"),
        ({"log_format": "xml"}, "log_format"),
        ({"log_level": "trace"}, "log_level"),
        ({"nixl_backends": []}, "nixl_backends"),
        ({"allowed_uids": [-5]}, "allowed_uids"),
        ({"socket_path": "relative.sock"}, "socket_path"),
        ({"socket_path": "/" + "x" * 200}, "socket_path"),
        ({"heartbeat_interval_s": 5.0, "peer_timeout_s": 5.0}, "heartbeat_interval_s"),
        ({"heartbeat_interval_s": 6.0}, "heartbeat_interval_s"),
        ({"health_port": "80"}, "health_port"),
        ({"post_slice_mib": -1}, "post_slice_mib"),
        ({"post_slice_mib": (1 << 20) + 1}, "post_slice_mib"),
        ({"poll_spin_s": -0.001}, "poll_spin_s"),
        ({"poll_spin_s": float("inf")}, "poll_spin_s"),
        ({"poll_spin_s": float("nan")}, "poll_spin_s"),
        ({"no_such_field": 1}, "no_such_field"),
    ],
)
def test_invalid_values_name_the_field(overrides: dict[str, object], field: str) -> None:
    err = config_error(overrides=overrides)
    assert err.field == field
    assert str(err).startswith(f"{field}: ")


def test_unknown_toml_key(tmp_path: Path) -> None:
    path = write(tmp_path, "health_prot = 9000\n")
    assert config_error(path=path).field == "health_prot"


def test_unknown_key_in_pushsvc_table(tmp_path: Path) -> None:
    path = write(tmp_path, "[pushsvc]\nlease = 3\n")
    assert config_error(path=path).field == "lease"


def test_wrong_toml_type(tmp_path: Path) -> None:
    path = write(tmp_path, 'health_port = "9000"\n')
    assert config_error(path=path).field == "health_port"


def test_wrong_toml_list_item_type(tmp_path: Path) -> None:
    path = write(tmp_path, 'allowed_uids = [1000, "bob"]\n')
    assert config_error(path=path).field == "allowed_uids"


def test_bool_is_not_an_int_in_toml(tmp_path: Path) -> None:
    path = write(tmp_path, "max_worker_connections = true\n")
    assert config_error(path=path).field == "max_worker_connections"


def test_unknown_env_var() -> None:
    err = config_error(env={**BASE_ENV, "PUSHSVC_HEALTH_PROT": "1"})
    assert err.field == "PUSHSVC_HEALTH_PROT"


def test_unrelated_env_vars_are_ignored() -> None:
    load_config(env={**BASE_ENV, "PUSHSVCX": "1", "HOME": "/root"})


@pytest.mark.parametrize(
    ("var", "raw", "field"),
    [
        ("PUSHSVC_NIXL_PROGRESS_THREAD", "maybe", "nixl_progress_thread"),
        ("PUSHSVC_HEALTH_PORT", "eighty", "health_port"),
        ("PUSHSVC_LEASE_S", "", "lease_s"),
        ("PUSHSVC_ALLOWED_UIDS", "1000,bob", "allowed_uids"),
    ],
)
def test_unparsable_env_value(var: str, raw: str, field: str) -> None:
    assert config_error(env={**BASE_ENV, var: raw}).field == field


def test_missing_file(tmp_path: Path) -> None:
    err = config_error(path=str(tmp_path / "absent.toml"))
    assert err.field == "config"
    assert "absent.toml" in err.message


def test_toml_syntax_error(tmp_path: Path) -> None:
    path = write(tmp_path, "health_port = = 1\n")
    assert config_error(path=path).field == "config"


# The side channel off loopback: a secret (or the loud opt-out) and the peers it may dial


def secret_file(tmp_path: Path) -> str:
    path = tmp_path / "side-channel.secret"
    path.write_text("s" * 32 + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.0.0.5", "fd00::5", "prefill-0.example.internal",
                                  "127.0.0.1.example"])
def test_side_channel_off_loopback_needs_a_secret(host: str) -> None:
    err = config_error(overrides={"side_channel_host": host, "allowed_peer_hosts": ["10.0.0.0/8"]})
    assert err.field == "side_channel_secret_file"
    assert f"side_channel_host ({host!r}) is not a loopback address" in err.message
    # Says how to make one, and names the opt-out in every layer.
    assert "head -c 32 /dev/urandom | base64" in err.message and "chmod 600" in err.message
    for spelling in ("insecure_side_channel = true", "--insecure-side-channel", "PUSHSVC_INSECURE_SIDE_CHANNEL=1"):
        assert spelling in err.message


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost", "LocalHost"])
def test_side_channel_on_loopback_needs_neither_secret_nor_peer_list(host: str) -> None:
    cfg = load_config(env=BASE_ENV, overrides={"side_channel_host": host})
    assert cfg.side_channel_host == host and cfg.allowed_peer_hosts == []


def test_a_secret_opens_the_side_channel_beyond_loopback(tmp_path: Path) -> None:
    cfg = load_config(env=BASE_ENV, overrides={"side_channel_host": "0.0.0.0", "allowed_peer_hosts": ["10.0.0.0/8"],
                                                "side_channel_secret_file": secret_file(tmp_path)})
    assert cfg.insecure_side_channel is False


def test_insecure_side_channel_is_the_explicit_opt_out(tmp_path: Path) -> None:
    overrides = {"side_channel_host": "0.0.0.0", "allowed_peer_hosts": ["*"]}
    assert load_config(env=BASE_ENV, overrides={**overrides, "insecure_side_channel": True}).insecure_side_channel
    env = {**BASE_ENV, "PUSHSVC_INSECURE_SIDE_CHANNEL": "1"}
    assert load_config(env=env, overrides=overrides).insecure_side_channel
    path = write(tmp_path, 'side_channel_host = "::"\ninsecure_side_channel = true\nallowed_peer_hosts = ["*"]\n')
    assert load_config(path, env=BASE_ENV).insecure_side_channel
    # false is false, in every spelling
    err = config_error(env={**BASE_ENV, "PUSHSVC_INSECURE_SIDE_CHANNEL": "no"}, overrides=overrides)
    assert err.field == "side_channel_secret_file"


def test_side_channel_off_loopback_needs_allowed_peer_hosts(tmp_path: Path) -> None:
    for extra in ({"side_channel_secret_file": secret_file(tmp_path)}, {"insecure_side_channel": True}):
        err = config_error(overrides={"side_channel_host": "0.0.0.0", **extra})
        assert err.field == "allowed_peer_hosts"
        assert "is not a loopback address" in err.message
        assert "10.0.0.0/8" in err.message and '"*" allows any host' in err.message


def test_allowed_peer_hosts_from_every_layer(tmp_path: Path) -> None:
    env = {**BASE_ENV, "PUSHSVC_ALLOWED_PEER_HOSTS": "10.0.0.0/8, decode-0.example.internal,fd00::/8"}
    assert load_config(env=env).allowed_peer_hosts == ["10.0.0.0/8", "decode-0.example.internal", "fd00::/8"]
    path = write(tmp_path, 'allowed_peer_hosts = ["192.168.0.0/16", "*"]\n')
    assert load_config(path, env=BASE_ENV).allowed_peer_hosts == ["192.168.0.0/16", "*"]
    cfg = load_config(path, env=env, overrides={"allowed_peer_hosts": ["10.1.2.3"]})
    assert cfg.allowed_peer_hosts == ["10.1.2.3"]


@pytest.mark.parametrize(
    ("entry", "words"),
    [("10.0.0.0/33", "is not an IP address, a CIDR network"), ("10.0.0.1/8", "did you mean 10.0.0.0/8?"),
     ("*.example.com", "wildcard patterns are not supported"), ("host:8472", "is not an IP address"),
     ("", "is not an IP address")],
)
def test_allowed_peer_hosts_entries_must_parse(entry: str, words: str) -> None:
    # Checked whatever the bind host: a list that does not parse is a mistake either way.
    err = config_error(overrides={"allowed_peer_hosts": ["10.0.0.0/8", entry]})
    assert err.field == "allowed_peer_hosts"
    assert words in err.message and repr(entry) in err.message


def test_allowed_peer_hosts_wrong_type_in_toml(tmp_path: Path) -> None:
    path = write(tmp_path, 'allowed_peer_hosts = "10.0.0.0/8"\n')
    err = config_error(path=path)
    assert err.field == "allowed_peer_hosts" and "Expected `array`, got `str`" in err.message


# One translation of msgspec's conversion errors, for the daemon's and the proxy's config


def _conversion_error(value: object, typ: type) -> msgspec.ValidationError:
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.convert(value, typ)
    return info.value


@pytest.mark.parametrize(
    ("value", "typ", "field"),
    [
        ({"health_port": "80"}, Config, "health_port"),
        ({"allowed_uids": [1000, "bob"]}, Config, "allowed_uids"),
        ({"allowed_peer_hosts": [1]}, Config, "allowed_peer_hosts"),
        ({"no_such_field": 1}, Config, "no_such_field"),
        ([1, 2], Config, "config"),
        ({"prefill": ["http://p:1"], "decode": ["http://d:1"], "port": 1}, ProxyConfig, "prefill_daemon"),
        ({}, ProxyConfig, "prefill"),
        ({"prefill": "http://p:1"}, ProxyConfig, "prefill"),
        ({"prefill": [], "prefill_daemon": [], "decode": [], "port": "x"}, ProxyConfig, "port"),
    ],
)
def test_translate_validation_error_names_the_top_level_field(value: object, typ: type, field: str) -> None:
    exc = _conversion_error(value, typ)
    err = translate_validation_error(exc)
    assert (err.field, err.message) == (field, str(exc))


def test_proxy_config_reports_conversion_errors_the_same_way() -> None:
    with pytest.raises(ConfigError) as info:
        load_proxy_config({"prefill": ["http://p:1"], "decode": ["http://d:1"], "port": 1})
    assert info.value.field == "prefill_daemon"


@pytest.mark.parametrize("key", ["side_channel_secret_file", "socket_path", "runtime_dir", "engine_id"])
def test_a_nul_in_a_path_or_name_is_a_config_error_not_a_crash(tmp_path: Path, key: str) -> None:
    # Found by the config fuzzer: os.open raised ValueError ("embedded null byte") through load_config.
    value = "/tmp/a\\u0000b" if key != "engine_id" else "p\\u0000"
    err = config_error(path=write(tmp_path, f'{key} = "{value}"\n'))
    assert err.field == key and "NUL" in str(err)
