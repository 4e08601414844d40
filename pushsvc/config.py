"""The daemon's one typed configuration object, built at the edge.

Precedence, lowest first: field defaults < TOML file < ``PUSHSVC_*`` env vars < overrides
(CLI flags). ``load_config`` merges the layers, converts once with msgspec (so every layer is
type-checked the same way), fills the derived defaults and validates. Nothing below the CLI
reads the environment: everything else receives a ``Config``.
"""

from __future__ import annotations

import math
import os
import re
import socket
import stat
import tomllib
import uuid
from collections.abc import Mapping
from typing import Any

import msgspec

from pushsvc.errors import ConfigError
from pushsvc.peer_hosts import InvalidPeerHost, PeerHostPolicy, is_loopback_host
from pushsvc.protocol.peer_auth import MIN_SECRET_LEN

MiB = 1 << 20

ENV_PREFIX = "PUSHSVC_"
# Reserved, not a field: lets a container point at its file without a CLI flag.
ENV_CONFIG_PATH = "PUSHSVC_CONFIG"

LOG_FORMATS = frozenset({"auto", "json", "console"})
LOG_LEVELS = frozenset({"debug", "info", "warning", "error"})
GPU_MODES = frozenset({"auto", "on", "off"})
UCX_SGL_MODES = frozenset({"on", "off"})
IPC_PUSH_MODES = frozenset({"auto", "off"})

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
# sun_path is 108 bytes on Linux, including the NUL; a longer path fails only at bind()
# with an opaque OSError, so it is caught here where the field can be named.
_MAX_UNIX_PATH = 107


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Every knob of the daemon. Empty strings mean "derive in ``resolve()``"."""

    # Worker-facing unix socket.
    runtime_dir: str = ""
    socket_path: str = ""
    socket_group: str = ""
    allowed_uids: list[int] = []
    allowed_gids: list[int] = []
    # Time a new worker connection has to finish its preamble and hello, and how many
    # such unfinished connections may wait at once (the oldest is dropped beyond it).
    worker_hello_timeout_s: float = 5.0
    max_pending_workers: int = 32
    # HTTP health / metrics / info.
    health_host: str = "127.0.0.1"
    health_port: int = 8471
    # A file holding a bearer token (rules of side_channel_secret_file): when set, every
    # path but /healthz and /readyz needs "Authorization: Bearer <token>". Required when
    # health_host is not loopback, unless insecure_health.
    health_token_file: str = ""
    # Opt-out of that requirement: /metrics, /v1/info and /v1/requests open to whoever
    # reaches the port. Logged as a warning at every start.
    insecure_health: bool = False
    # Daemon-to-daemon side channel.
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 8472
    advertised_host: str = ""
    engine_id: str = ""
    # A file holding a secret shared by all daemons of a deployment; when set, peers
    # prove knowledge of it (HMAC over a nonce exchange) before any metadata flows.
    # Required when side_channel_host is not loopback, unless insecure_side_channel.
    side_channel_secret_file: str = ""
    # Opt-out of that requirement: any host that reaches the side channel may complete a
    # hello and learn every agent's NIXL metadata. Logged as a warning at every start.
    insecure_side_channel: bool = False
    # Hosts this daemon may dial (peer_hosts.py): addresses, CIDR networks, host names,
    # or "*". Loopback is always allowed; empty means loopback only, which a daemon
    # whose side channel is not on loopback may not use.
    allowed_peer_hosts: list[str] = []
    # NIXL.
    nixl_backends: list[str] = msgspec.field(default_factory=lambda: ["UCX"])
    nixl_progress_thread: bool = False
    # UCX's error handling: "peer" reports a dead peer to a WRITE (on one host the bytes go
    # by cma, messages over tcp/lo); "none" allows shared memory (docs/architecture.md,
    # "UCX transports").
    ucx_error_handling_mode: str = "peer"
    # "on": NIXL hands UCX each WRITE as one scatter-gather list instead of one put per
    # descriptor (NIXL_UCX_SGL_ENABLE; over cuda_ipc one batched copy for all of them).
    # Faster for many descriptors on the GPU, but a WRITE into memory cuda_ipc cannot reach
    # (a D without landing buffer) then fails to post (docs/gpu.md, "Posting a WRITE").
    ucx_sgl: str = "off"
    # Leases, watchdogs and liveness.
    lease_s: float = 120.0
    watchdog_s: float = 120.0
    registration_ttl_s: float = 120.0
    handshake_timeout_s: float = 5.0
    heartbeat_interval_s: float = 1.0
    peer_timeout_s: float = 5.0
    # Caps on untrusted input.
    max_worker_frame: int = 16 * MiB
    max_peer_frame: int = 64 * MiB
    max_notif_bytes: int = 4 * MiB
    max_worker_connections: int = 256
    # Transfer-status polling: fast while WRITEs are in flight, slow when idle.
    poll_busy_interval_s: float = 0.001
    poll_idle_interval_s: float = 0.05
    # Back-to-back polling while a WRITE moves, for at most this long per WRITE.
    poll_hot_max_s: float = 0.5
    # Offer the CPU to other waiting processes before each back-to-back pass (sched_yield).
    poll_hot_yield: bool = True
    # Busy polling: for this long after each worker message or peer event, while a request
    # is tracked, poll back to back instead of sleeping, so the daemon is awake when its
    # push comes (costs a core per daemon while requests wait). 0 = off
    # (docs/architecture.md, "Busy polling while requests wait").
    poll_spin_s: float = 0.0
    drain_timeout_s: float = 10.0
    # Logging and debugging.
    log_format: str = "auto"
    log_level: str = "info"
    # Digest every pushed block on P and check it on D (costs a hash pass over the KV).
    verify: bool = False
    # Request timelines kept for GET /v1/requests (docs/architecture.md); 0 keeps none
    # (the phase histogram and the request_timeline log event stay).
    timelines_kept: int = 256
    # GPU path (docs/gpu.md). "auto": on where the host has a CUDA driver and a visible
    # GPU; "on": required; "off": CUDA KV registrations are refused.
    gpu: str = "auto"
    # Landing buffer per consumer rank with CUDA KV (P WRITEs into it, D copies out);
    # 0 = WRITEs go straight into the imported worker KV (0.4 GB/s on one H200).
    landing_mib: int = 2048
    # P splits a WRITE into a landing buffer into parts of about this size, so D copies
    # early parts while later ones land (at most 32 parts); 0 = one WRITE.
    write_part_mib: int = 256
    # P posts a WRITE from host memory (the CPU path) a slice of about this size per pass
    # of its loop: the post itself moves the bytes (cma on one host, TCP between hosts
    # without RDMA), holding the loop that long
    # (~8 ms per 64 MiB on one host; docs/architecture.md, "UCX transports"). 0 = one post.
    post_slice_mib: int = 64
    # P's staging buffer per producer rank with CUDA KV: P copies a request's blocks into it
    # and WRITEs from there, so NIXL never registers the worker's (imported) memory. For NICs
    # that cannot register CUDA-IPC-imported memory (docs/gpu.md); 0 = WRITE from the KV.
    staging_mib: int = 0
    # Same-host push on the GPU: "auto": a D offers its worker's CUDA KV to P daemons on the
    # same host, a P maps it and copies each request's blocks into it with one kernel (no
    # NIXL WRITE, no landing copy; docs/gpu.md, "Same-host push"); "off": never (NIXL only).
    ipc_push: str = "auto"

    def resolve(self, env: Mapping[str, str] | None = None) -> Config:
        """Return a copy with derived defaults filled in; a resolved config is a fixed point."""
        env = os.environ if env is None else env
        hostname = socket.gethostname()
        runtime_dir = self.runtime_dir
        if not runtime_dir:
            xdg = env.get("XDG_RUNTIME_DIR", "")
            runtime_dir = os.path.join(xdg, "pushsvc") if xdg else f"/tmp/pushsvc-{os.getuid()}"
        advertised_host = self.advertised_host
        if not advertised_host:
            # A wildcard bind address is not something a peer can connect to.
            wildcard = self.side_channel_host in _WILDCARD_HOSTS
            advertised_host = hostname if wildcard else self.side_channel_host
        return msgspec.structs.replace(
            self,
            runtime_dir=runtime_dir,
            socket_path=self.socket_path or os.path.join(runtime_dir, "pushsvc.sock"),
            advertised_host=advertised_host,
            engine_id=self.engine_id or f"{hostname}-{uuid.uuid4().hex[:8]}",
        )

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid field. Call on a resolved config."""
        for name in ("health_port", "side_channel_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ConfigError(name, f"port must be in 0..65535, got {port}")
        for name in _DURATION_FIELDS:
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(name, f"must be a positive number of seconds, got {value}")
        for name in _SIZE_FIELDS:
            value = getattr(self, name)
            if value <= 0:
                raise ConfigError(name, f"must be positive, got {value}")
        if not (math.isfinite(self.poll_spin_s) and self.poll_spin_s >= 0):
            raise ConfigError("poll_spin_s", f"must be 0 (off) or a positive number of seconds, got {self.poll_spin_s}")
        if self.heartbeat_interval_s >= self.peer_timeout_s:
            # Otherwise a healthy peer would be declared dead between two heartbeats.
            raise ConfigError(
                "heartbeat_interval_s",
                f"must be less than peer_timeout_s ({self.peer_timeout_s}), "
                f"got {self.heartbeat_interval_s}",
            )
        if self.log_format not in LOG_FORMATS:
            raise ConfigError("log_format", f"must be one of {sorted(LOG_FORMATS)}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError("log_level", f"must be one of {sorted(LOG_LEVELS)}")
        if self.gpu not in GPU_MODES:
            raise ConfigError("gpu", f"must be one of {sorted(GPU_MODES)}")
        for name in ("landing_mib", "write_part_mib", "staging_mib", "post_slice_mib"):
            if not 0 <= getattr(self, name) <= 1 << 20:
                raise ConfigError(name, f"must be in 0..{1 << 20} MiB, got {getattr(self, name)}")
        if self.ucx_error_handling_mode not in ("peer", "none"):
            raise ConfigError("ucx_error_handling_mode", f'must be "peer" or "none", got {self.ucx_error_handling_mode!r}')
        if self.ucx_sgl not in UCX_SGL_MODES:
            raise ConfigError("ucx_sgl", f"must be one of {sorted(UCX_SGL_MODES)}, got {self.ucx_sgl!r}")
        if self.ipc_push not in IPC_PUSH_MODES:
            raise ConfigError("ipc_push", f"must be one of {sorted(IPC_PUSH_MODES)}, got {self.ipc_push!r}")
        if not 0 <= self.timelines_kept <= 100_000:
            raise ConfigError("timelines_kept", f"must be in 0..100000, got {self.timelines_kept}")
        if not self.nixl_backends or not all(self.nixl_backends):
            raise ConfigError("nixl_backends", "must name at least one backend, none empty")
        if any(uid < 0 for uid in self.allowed_uids):
            raise ConfigError("allowed_uids", "uids must be non-negative")
        if any(gid < 0 for gid in self.allowed_gids):
            raise ConfigError("allowed_gids", "gids must be non-negative")
        for name in ("runtime_dir", "socket_path", "socket_group", "side_channel_secret_file", "engine_id",
                     "health_host", "side_channel_host", "advertised_host", "health_token_file"):
            if "\x00" in getattr(self, name):
                raise ConfigError(name, "must not contain a NUL character")
        if self.socket_group.startswith("-"):
            raise ConfigError("socket_group", "must be a group name or a non-negative gid")
        if not os.path.isabs(self.socket_path):
            raise ConfigError("socket_path", f"must be absolute, got {self.socket_path!r}")
        if len(os.fsencode(self.socket_path)) > _MAX_UNIX_PATH:
            raise ConfigError("socket_path", f"longer than {_MAX_UNIX_PATH} bytes")
        for name in ("engine_id", "advertised_host"):
            if not getattr(self, name):
                raise ConfigError(name, "must not be empty")
        if self.side_channel_secret_file:
            read_secret_file(self.side_channel_secret_file)
        if self.health_token_file:
            read_secret_file(self.health_token_file, "health_token_file")
        elif not is_loopback_host(self.health_host) and not self.insecure_health:
            raise ConfigError(
                "health_token_file",
                f"required because health_host ({self.health_host!r}) is not a loopback address: without it "
                "anyone who reaches the port reads /metrics, /v1/info (peers, agents) and /v1/requests "
                "(request ids). Create a token (head -c 32 /dev/urandom | base64 > health.token; chmod 600 "
                "health.token) and give it to the scraper as a bearer token; /healthz and /readyz stay open "
                "for probes. Or, on a network you trust, set insecure_health = true (--insecure-health, "
                "PUSHSVC_INSECURE_HEALTH=1)")
        try:
            PeerHostPolicy.build(self.allowed_peer_hosts)
        except InvalidPeerHost as exc:
            raise ConfigError("allowed_peer_hosts", str(exc)) from None
        if not is_loopback_host(self.side_channel_host):
            self._validate_exposed_side_channel()
            if self.ucx_error_handling_mode == "none":
                # Without it UCX does not notice a peer host that vanished: a WRITE to it may
                # never settle, and P's blocks would stay leased for good.
                raise ConfigError("ucx_error_handling_mode", '"none" is for daemons that share one host '
                                  f'(side_channel_host {self.side_channel_host!r} is not loopback): use "peer"')

    def _validate_exposed_side_channel(self) -> None:
        # Off loopback, other machines (and whoever else is on their network) can reach the
        # side channel and name hosts for this daemon to dial: both must be decided here.
        host = self.side_channel_host
        if not self.side_channel_secret_file and not self.insecure_side_channel:
            raise ConfigError(
                "side_channel_secret_file",
                f"required because side_channel_host ({host!r}) is not a loopback address: without it "
                "anyone who reaches the side channel gets every agent's NIXL metadata. Create one secret "
                "for all daemons of the deployment (head -c 32 /dev/urandom | base64 > side-channel.secret; "
                "chmod 600 side-channel.secret, owned by the daemon's user) and point "
                "side_channel_secret_file at it on each of them; or, to run unauthenticated on a network "
                "you trust, set insecure_side_channel = true (--insecure-side-channel, "
                "PUSHSVC_INSECURE_SIDE_CHANNEL=1)",
            )
        if not self.allowed_peer_hosts:
            raise ConfigError(
                "allowed_peer_hosts",
                f"required because side_channel_host ({host!r}) is not a loopback address: list the peer "
                "daemons this one may dial, as IP addresses, CIDR networks (10.0.0.0/8, fd00::/8) or host "
                'names; "*" allows any host. Empty allows loopback only',
            )


_DURATION_FIELDS = tuple(  # poll_spin_s may be 0 (off)
    f.name for f in msgspec.structs.fields(Config) if f.name.endswith("_s") and f.name != "poll_spin_s"
)
_SIZE_FIELDS = ("max_worker_frame", "max_peer_frame", "max_notif_bytes", "max_worker_connections",
               "max_pending_workers")
_FIELD_TYPES: dict[str, Any] = {f.name: f.type for f in msgspec.structs.fields(Config)}


# Far more than any sane secret; keeps a mistaken path (a log, an image) from being read.
_MAX_SECRET_FILE = 4096


def read_secret_file(path: str, name: str = "side_channel_secret_file") -> bytes:
    """The side-channel secret held in ``path``, without one trailing newline.

    Refused with a ``ConfigError`` (which never quotes the contents) unless the file is a
    regular file the daemon can read, is not accessible by group or others, and holds
    at least 16 bytes. Checked on the open descriptor, so the file checked is the file read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError) as exc:  # ValueError: a path the OS cannot take (a NUL in it)
        raise ConfigError(name, f"cannot read {path!r}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(name, f"{path} is not a regular file")
        if st.st_mode & 0o077:
            raise ConfigError(name, f"{path} is accessible by group or others "
                                    f"(mode {stat.S_IMODE(st.st_mode):04o}); chmod 600 it")
        data = os.read(fd, _MAX_SECRET_FILE + 1)
        if st.st_size > _MAX_SECRET_FILE or len(data) > _MAX_SECRET_FILE:
            raise ConfigError(name, f"{path} is larger than {_MAX_SECRET_FILE} bytes")
    except OSError as exc:
        raise ConfigError(name, f"cannot read {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    if not data:
        raise ConfigError(name, f"{path} is empty")
    if len(data) < MIN_SECRET_LEN:
        raise ConfigError(name, f"the secret in {path} is shorter than {MIN_SECRET_LEN} bytes")
    return data


def load_config(
    path: str | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> Config:
    """Build, resolve and validate the config from file, env and overrides (see module doc)."""
    env = os.environ if env is None else env
    if path is None:
        path = env.get(ENV_CONFIG_PATH) or None
    merged: dict[str, object] = {}
    if path is not None:
        merged.update(_read_toml(path))
    merged.update(_from_env(env))
    for key, value in (overrides or {}).items():
        _check_known(key, "override")
        if value is not None:
            merged[key] = value
    try:
        cfg = msgspec.convert(merged, Config)
    except msgspec.ValidationError as exc:
        raise translate_validation_error(exc) from None
    cfg = cfg.resolve(env)
    cfg.validate()
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain builtins, for ``/v1/info`` and ``--print-config``."""
    return msgspec.to_builtins(cfg)


def _check_known(key: str, source: str) -> None:
    if key not in _FIELD_TYPES:
        raise ConfigError(key, f"unknown {source} key")


def _read_toml(path: str) -> dict[str, object]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"invalid TOML in {path}: {exc}") from None
    except UnicodeDecodeError as exc:  # tomllib decodes the bytes before it parses
        raise ConfigError("config", f"{path} is not UTF-8: {exc}") from None
    except RecursionError:  # tomllib's parser recurses once per nested array or table
        raise ConfigError("config", f"{path} nests arrays or tables too deeply") from None
    table = data.get("pushsvc")
    if isinstance(table, dict):
        # A [pushsvc] table means the file is shared: other tables belong to other tools,
        # but a bare top-level key looks like ours and must not be silently ignored.
        for key, value in data.items():
            if key != "pushsvc" and not isinstance(value, dict):
                raise ConfigError(key, f"key outside the [pushsvc] table in {path}")
        data = table
    for key in data:
        _check_known(key, f"config file ({path})")
    return data


def _from_env(env: Mapping[str, str]) -> dict[str, object]:
    values: dict[str, object] = {}
    for var, raw in env.items():
        if not var.startswith(ENV_PREFIX) or var == ENV_CONFIG_PATH:
            continue
        name = var[len(ENV_PREFIX):].lower()
        if name not in _FIELD_TYPES:
            # Typos must not be silent; the error names the variable as it was spelled.
            raise ConfigError(var, "unknown environment variable")
        values[name] = _parse_env(name, _FIELD_TYPES[name], raw)
    return values


def _parse_env(name: str, typ: Any, raw: str) -> object:
    try:
        if typ is bool:
            return _parse_bool(raw)
        if typ is str:
            return raw
        if typ in (int, float):
            return typ(raw.strip())
        (item_type,) = typ.__args__  # list[int] / list[str]
        return [item_type(item.strip()) for item in raw.split(",") if item.strip()]
    except ValueError:
        raise ConfigError(name, f"cannot parse {raw!r} from {ENV_PREFIX}{name.upper()}") from None


def _parse_bool(raw: str) -> bool:
    word = raw.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(raw)


_PATH_FIELD = re.compile(r"at `\$\.([^`.\[]+)")
_NAMED_FIELD = re.compile(r"(?:unknown|missing required) field `([^`]*)`")


def translate_validation_error(exc: msgspec.ValidationError) -> ConfigError:
    """A msgspec conversion error as a ``ConfigError`` naming the top-level field.

    msgspec names the location only inside its message: "... - at `$.health_port`",
    "... - at `$.allowed_uids[1]`", "Object contains unknown field `x`", "Object missing
    required field `x`". Used by every config built with ``msgspec.convert`` (daemon and proxy).
    """
    text = str(exc)
    match = _PATH_FIELD.search(text) or _NAMED_FIELD.search(text)
    return ConfigError(match.group(1) if match else "config", text)
