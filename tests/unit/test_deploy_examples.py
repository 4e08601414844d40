"""The examples in deploy/ stay loadable: pushsvc.toml and the daemon's environment in
sidecar.yaml pass load_config once their secret file exists, and pushsvc.toml lists every key."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import msgspec
import pytest

from pushsvc.config import Config, load_config
from pushsvc.errors import ConfigError

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
EXAMPLE_TOML = DEPLOY / "pushsvc.toml"
SIDECAR = DEPLOY / "sidecar.yaml"


@pytest.fixture
def secret(tmp_path: Path) -> str:
    path = tmp_path / "side-channel.secret"
    path.write_text("0123456789abcdef0123456789abcdef\n")
    path.chmod(0o400)
    return str(path)


def test_example_toml_lists_every_key() -> None:
    with open(EXAMPLE_TOML, "rb") as f:
        keys = set(tomllib.load(f))
    assert keys == {f.name for f in msgspec.structs.fields(Config)}


def test_example_toml_loads_with_its_secret(secret: str) -> None:
    cfg = load_config(str(EXAMPLE_TOML), env={}, overrides={"side_channel_secret_file": secret})
    # Off loopback, authenticated, and a list of peers to dial; no opt-out.
    assert cfg.side_channel_host == "0.0.0.0"
    assert cfg.insecure_side_channel is False
    assert cfg.allowed_peer_hosts and "*" not in cfg.allowed_peer_hosts


def test_example_toml_names_a_secret_file_it_requires() -> None:
    with open(EXAMPLE_TOML, "rb") as f:
        named = tomllib.load(f)["side_channel_secret_file"]
    if os.path.exists(named):
        pytest.skip(f"{named} exists on this machine")
    with pytest.raises(ConfigError) as info:
        load_config(str(EXAMPLE_TOML), env={})
    assert info.value.field == "side_channel_secret_file" and named in info.value.message


def _sidecar() -> dict:
    yaml = pytest.importorskip("yaml")  # installed with the vllm extra (make venv)
    return yaml.safe_load(SIDECAR.read_text())


def _container(pod: dict, name: str) -> dict:
    spec = pod["spec"]
    (found,) = [c for c in spec["initContainers"] + spec["containers"] if c["name"] == name]
    return found


def test_sidecar_daemon_environment_loads_with_its_secret(secret: str, tmp_path: Path) -> None:
    daemon = _container(_sidecar(), "pushsvc")
    fields = {"POD_NAME": "vllm-prefill-0", "POD_IP": "10.244.1.7"}
    env: dict[str, str] = {}
    for var in daemon["env"]:
        if "value" in var:
            value = var["value"]
            for ref, sub in fields.items():
                value = value.replace(f"$({ref})", sub)
            env[var["name"]] = value
    assert env["PUSHSVC_SIDE_CHANNEL_SECRET_FILE"].startswith("/")
    assert os.path.dirname(env["PUSHSVC_HEALTH_TOKEN_FILE"]) == os.path.dirname(env["PUSHSVC_SIDE_CHANNEL_SECRET_FILE"])
    with pytest.raises(ConfigError) as info:  # off loopback: no health without its token
        load_config(None, env={**env, "PUSHSVC_SIDE_CHANNEL_SECRET_FILE": secret,
                               "PUSHSVC_HEALTH_TOKEN_FILE": ""})
    assert info.value.field == "health_token_file"
    token = tmp_path / "health.token"
    token.write_text("fedcba9876543210fedcba9876543210\n")
    token.chmod(0o400)
    cfg = load_config(None, env={**env, "PUSHSVC_SIDE_CHANNEL_SECRET_FILE": secret,
                                 "PUSHSVC_HEALTH_TOKEN_FILE": str(token)})
    assert cfg.side_channel_host == "0.0.0.0" and cfg.insecure_side_channel is False
    assert cfg.health_host == "0.0.0.0" and cfg.insecure_health is False
    assert cfg.allowed_peer_hosts and cfg.engine_id == "vllm-prefill-0" and cfg.advertised_host == "10.244.1.7"


def test_sidecar_gives_the_daemon_a_private_0400_copy_of_the_secret() -> None:
    pod = _sidecar()
    daemon, copier, vllm = (_container(pod, n) for n in ("pushsvc", "pushsvc-secret", "vllm"))
    secret_file = next(v["value"] for v in daemon["env"] if v["name"] == "PUSHSVC_SIDE_CHANNEL_SECRET_FILE")
    init_names = [c["name"] for c in pod["spec"]["initContainers"]]
    assert init_names.index("pushsvc-secret") < init_names.index("pushsvc")  # copied before the daemon starts
    token_file = next(v["value"] for v in daemon["env"] if v["name"] == "PUSHSVC_HEALTH_TOKEN_FILE")
    command = copier["command"]
    assert command[:5] == ["install", "-m", "0400", "-t", os.path.dirname(secret_file)]
    assert {os.path.basename(f) for f in command[5:]} == {os.path.basename(secret_file), os.path.basename(token_file)}
    copy_dir = os.path.dirname(secret_file)
    (volume,) = [m["name"] for m in daemon["volumeMounts"] if m["mountPath"] == copy_dir]
    assert [m["name"] for m in copier["volumeMounts"] if m["mountPath"] == copy_dir] == [volume]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes[volume]["emptyDir"]["medium"] == "Memory"
    secret_volumes = {name for name, v in volumes.items() if "secret" in v} | {volume}
    assert not secret_volumes & {m["name"] for m in vllm["volumeMounts"]}  # vLLM never sees it


def test_sidecar_points_vllms_connector_at_the_daemons_socket() -> None:
    """The connector reads ``daemon_socket`` (connector.py) and must find the socket the
    daemon container listens on: a misnamed key left vLLM's workers without a daemon."""
    import json

    pod = _sidecar()
    args = _container(pod, "vllm")["args"]
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "PushsvcConnector" and config["kv_connector_module_path"] == "pushsvc_connector"
    daemon_env = {v["name"]: v.get("value") for v in _container(pod, "pushsvc")["env"]}
    assert config["kv_connector_extra_config"] == {"daemon_socket": daemon_env["PUSHSVC_SOCKET_PATH"]}


@pytest.mark.parametrize("version", ["1.30.0", "1.37.0"])
def test_sidecar_is_a_valid_kubernetes_object(version: str) -> None:
    """Against the Kubernetes API schemas of the oldest and the newest release we name, with
    unknown fields refused (strict): a misspelt field would be dropped by the API server."""
    import kubernetes_validate

    yaml = pytest.importorskip("yaml")
    docs = [d for d in yaml.safe_load_all(SIDECAR.read_text()) if d]
    assert docs and all(d["kind"] == "Pod" for d in docs)
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_schema_check_catches_a_misspelt_probe() -> None:
    import kubernetes_validate

    pod = _sidecar()
    daemon = _container(pod, "pushsvc")
    daemon["livenesProbe"] = daemon.pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, "1.37.0", strict=True)


def test_sidecar_probes_the_daemons_health_endpoint() -> None:
    """Started, ready and alive by the daemon's own open probes (no token needed)."""
    daemon = _container(_sidecar(), "pushsvc")
    paths = {kind: daemon[kind]["httpGet"]["path"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert paths == {"startupProbe": "/readyz", "readinessProbe": "/readyz", "livenessProbe": "/healthz"}
