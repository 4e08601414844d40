"""``pushsvc`` command line: serve, status, config check, proxy, demo.

This is the edge where configuration is built (file, env, flags); everything below
receives a ``Config``. Invalid configuration exits with status 2 and names the field.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any, Sequence

import msgspec

from pushsvc.config import ENV_CONFIG_PATH, ENV_PREFIX, Config, load_config, to_dict
from pushsvc.errors import ConfigError

EXIT_CONFIG = 2
EXIT_NOT_READY = 3  # `pushsvc status`: reachable but /readyz says 503


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the transfer daemon")
    p.add_argument("--config", help="TOML configuration file")
    p.add_argument("--socket", dest="socket_path", help="worker Unix socket path")
    p.add_argument("--runtime-dir", dest="runtime_dir")
    p.add_argument("--engine-id", dest="engine_id")
    p.add_argument("--health-host", dest="health_host")
    p.add_argument("--health-port", dest="health_port", type=int, help="0 picks a free port")
    p.add_argument("--side-channel-host", dest="side_channel_host")
    p.add_argument("--side-channel-port", dest="side_channel_port", type=int, help="0 picks a free port")
    p.add_argument("--advertised-host", dest="advertised_host")
    p.add_argument("--side-channel-secret-file", dest="side_channel_secret_file", metavar="PATH",
                   help="shared secret (mode 0600, >= 16 bytes) peers must prove before any metadata flows; "
                        "required unless the side channel binds loopback or --insecure-side-channel is given")
    p.add_argument("--health-token-file", dest="health_token_file",
                   help="bearer token file for /metrics, /v1/info, /v1/requests (required off loopback)")
    p.add_argument("--insecure-health", dest="insecure_health", action="store_true", default=None,
                   help="allow an unauthenticated health server off loopback (warned at every start)")
    p.add_argument("--insecure-side-channel", dest="insecure_side_channel", action="store_true", default=None,
                   help="allow a side channel off loopback without a secret: anyone who reaches it gets every "
                        "agent's NIXL metadata")
    p.add_argument("--allowed-peer-host", dest="allowed_peer_hosts", action="append", metavar="HOST",
                   help="a host name, IP address, CIDR network, or '*' for any, that this daemon may dial "
                        "(repeat for several; replaces the file's and env's list; loopback is always allowed)")
    p.add_argument("--lease-s", dest="lease_s", type=float)
    p.add_argument("--watchdog-s", dest="watchdog_s", type=float)
    p.add_argument("--log-format", dest="log_format", choices=["auto", "json", "console"])
    p.add_argument("--log-level", dest="log_level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--verify", dest="verify", action="store_true", default=None,
                   help="KV verify mode: digest pushed blocks on P, check them on D")
    p.add_argument("--gpu", dest="gpu", choices=["auto", "on", "off"],
                   help="GPU path: auto (when a CUDA driver and GPU are present), on (required), off")
    p.add_argument("--landing-mib", dest="landing_mib", type=int,
                   help="D's landing buffer per GPU rank, MiB (0: WRITE into vLLM's KV directly)")
    p.add_argument("--staging-mib", dest="staging_mib", type=int,
                   help="P: copy each request's GPU KV into a staging buffer of this size per rank, MiB, and WRITE "
                        "from there (0: WRITE from vLLM's KV directly)")
    p.add_argument("--write-part-mib", dest="write_part_mib", type=int,
                   help="P: WRITEs into a landing buffer go in parts of about this size, MiB (0: one WRITE)")
    p.add_argument("--post-slice-mib", dest="post_slice_mib", type=int,
                   help="P: WRITEs from host memory go a slice of about this size per loop pass, MiB (0: one post)")
    p.add_argument("--ucx-error-handling-mode", dest="ucx_error_handling_mode", choices=["peer", "none"],
                   help="UCX error handling: peer (a dead peer fails the WRITE; on one host notifications over tcp/lo) "
                        "or none (shared-memory transports)")
    p.add_argument("--ucx-sgl", dest="ucx_sgl", choices=["on", "off"],
                   help="post each WRITE to UCX as one scatter-gather list (on; faster for many GPU descriptors, "
                        "but no WRITE into a D without landing buffer) or one put per descriptor (off)")
    p.add_argument("--ipc-push", dest="ipc_push", choices=["auto", "off"],
                   help="same-host GPU push: auto (a P maps a D's KV on the same host and copies into it itself) "
                        "or off (NIXL WRITEs only)")
    p.add_argument("--poll-hot-yield", dest="poll_hot_yield", type=_on_off, metavar="{on,off}",
                   help="before each hot pass the progress loop offers its CPU to other waiting processes (on) "
                        "or keeps it (off)")
    p.add_argument("--poll-spin-s", dest="poll_spin_s", type=float, metavar="SECONDS",
                   help="busy polling: for this long after each worker message or peer event, while a request is "
                        "tracked, poll back to back instead of sleeping (a core per daemon while requests wait, for "
                        "a daemon awake when the push comes); 0 = off (default)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--ready-file", help="write /v1/info JSON here once the daemon is ready")


def _proxy_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("proxy", help="run the P/D proxy in front of vLLM prefill and decode instances")
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a prefill vLLM base URL (repeat for several)")
    p.add_argument("--prefill-daemon", dest="prefill_daemon", action="append", default=[], metavar="URL",
                   help="health URL of the pushsvc daemon of the prefill instance at the same position, one per "
                        "--prefill: D is sent to the daemon its /v1/info describes. Default: none, each prefill "
                        "instance's answers say where its daemon is (the first request to it runs prefill, then "
                        "decode)")
    p.add_argument("--prefill-daemon-token-file", dest="prefill_daemon_token_file", metavar="FILE",
                   help="bearer token of the --prefill-daemon URLs' /v1/info: their health_token_file (mode 600), "
                        "which a daemon whose health server listens beyond loopback requires")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a decode vLLM base URL (repeat for several)")
    p.add_argument("--port", type=int, required=True, help="0 picks a free port")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--timeout-s", dest="timeout_s", type=float,
                   help="total per non-streamed backend call; idle between stream chunks (default 300)")
    p.add_argument("--connect-timeout-s", dest="connect_timeout_s", type=float, help="default 10")
    p.add_argument("--remote-tp-size", dest="remote_tp_size", type=int,
                   help="prefill TP size, unless the prefill instance's answers say it (default 1)")
    p.add_argument("--max-connections", dest="max_connections", type=int,
                   help="open backend connections at most (default 1024)")
    p.add_argument("--health-interval-s", dest="health_interval_s", type=float,
                   help="backend and daemon probe period, 0 turns probing off (default 5)")
    p.add_argument("--drain-timeout-s", dest="drain_timeout_s", type=float,
                   help="grace for in-flight requests on shutdown (default 10)")
    p.add_argument("--max-body-bytes", dest="max_body_bytes", type=int, help="default 32 MiB")
    p.add_argument("--prefix-affinity-slack", dest="prefix_affinity_slack", type=int,
                   help="send a prompt to the prefill instance that last took one starting alike while it has at "
                        "most N requests more in flight than the least busy; -1: off (default 2)")
    p.add_argument("--admin-token-file", dest="admin_token_file", metavar="FILE",
                   help="bearer token of POST /admin/drain and /admin/resume (mode 600, 16 bytes or more); "
                        "without it they answer loopback clients only")
    p.add_argument("--otlp-traces-endpoint", dest="otlp_traces_endpoint", metavar="URL",
                   help="export an OpenTelemetry span per exchange to this OTLP endpoint (the legs carry its "
                        "traceparent, so vLLM's own spans join the trace); OTEL_EXPORTER_OTLP_TRACES_PROTOCOL "
                        "grpc (default) or http/protobuf")
    p.add_argument("--log-format", dest="log_format", choices=["auto", "json", "console"])
    p.add_argument("--log-level", dest="log_level", choices=["debug", "info", "warning", "error"])


_PROXY_FIELDS = ("prefill", "prefill_daemon", "prefill_daemon_token_file", "decode", "port", "host", "timeout_s", "connect_timeout_s",
                 "remote_tp_size", "max_connections", "health_interval_s", "drain_timeout_s", "max_body_bytes",
                 "prefix_affinity_slack", "admin_token_file", "otlp_traces_endpoint", "log_format",
                 "log_level")


_OVERRIDES = ("socket_path", "runtime_dir", "engine_id", "health_host", "health_port", "side_channel_host",
              "side_channel_port", "advertised_host", "side_channel_secret_file", "insecure_side_channel",
              "health_token_file", "insecure_health",
              "allowed_peer_hosts", "lease_s", "watchdog_s", "log_format", "log_level", "verify", "gpu", "landing_mib",
              "staging_mib",
              "write_part_mib", "post_slice_mib", "ucx_error_handling_mode", "ucx_sgl", "ipc_push", "poll_hot_yield",
              "poll_spin_s")


def _on_off(value: str) -> bool:
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}")
    return value == "on"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pushsvc", description="Push-mode KV-cache transfer daemon for vLLM")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _proxy_parser(sub)
    st = sub.add_parser("status", help="print a daemon's /v1/info, /readyz and table sizes",
                        description="Exit status: 0 ready, 3 reachable but not ready, 1 unreachable.")
    st.add_argument("--url", default="http://127.0.0.1:8471", help="daemon health endpoint")
    st.add_argument("--token-file", dest="token_file",
                    help="the daemon's health_token_file, needed for /v1/info when the daemon has one")
    st.add_argument("--json", action="store_true", help='{"info": /v1/info, "ready": /readyz} instead of tables')
    _config_parser(sub)
    _demo_parser(sub)
    return parser


def _config_parser(sub: argparse._SubParsersAction) -> None:
    cfg = sub.add_parser("config", help="work with configuration files")
    actions = cfg.add_subparsers(dest="config_command", required=True)
    check = actions.add_parser(
        "check", help="validate a TOML configuration as the daemon would load it",
        description="Loads FILE with the daemon's loader, PUSHSVC_* variables of this environment included, "
                    "and prints the effective configuration and every problem found. Exit 0 if valid, "
                    "2 if not (what `pushsvc serve` would exit with). Secret files are checked (owner, mode, "
                    "length) but never printed: run it as the daemon's user.")
    check.add_argument("file", help="TOML configuration file")
    check.add_argument("--json", action="store_true",
                       help='{"valid", "config", "problems": [{"field", "message"}], "env"}')


def _demo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="P/D vLLM with pushsvc next to colocated vLLM, on this machine",
        description="Serve the same prompts through one colocated vLLM and through P/D (two vLLM servers, "
                    "two pushsvc daemons, the proxy); compare outputs and TTFT. Exit 0 only if the outputs match.")
    p.add_argument("--model-dir", dest="model_dir",
                   help="the tiny model, made there if missing (default ~/.cache/pushsvc/tiny-llama)")
    p.add_argument("--prompts", type=int, default=12, help="number of prompts (default 12)")
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=32, help="tokens per answer (default 32)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at once (default 4)")
    p.add_argument("--workdir", help="logs and daemon sockets (default: a new temporary directory)")
    p.add_argument("--keep-logs", dest="keep_logs", action="store_true",
                   help="keep the work directory after a successful run (a failed run always keeps it)")
    p.add_argument("--transfer-only", dest="transfer_only", action="store_true",
                   help="only two daemons pushing between in-process workers, no vLLM (a few seconds)")
    p.add_argument("--requests", type=int, default=16, help="with --transfer-only: pushes (default 16)")
    p.add_argument("--blocks", type=int, default=64, help="with --transfer-only: blocks per push (default 64)")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "status":
        return _status(args)
    if args.command == "config":
        return _config_check(args)
    if args.command == "proxy":
        return _proxy(args)
    if args.command == "demo":
        return _demo(args)
    return EXIT_CONFIG


def _demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pushsvc.demo import DemoOptions, default_model_dir, run_demo

    for flag in ("prompts", "max_tokens", "concurrency", "requests", "blocks"):
        if getattr(args, flag) < 1:
            print(f"pushsvc: --{flag.replace('_', '-')} must be at least 1", file=sys.stderr)
            return EXIT_CONFIG
    return run_demo(DemoOptions(
        model_dir=args.model_dir or default_model_dir(Path.home()), prompts=args.prompts,
        max_tokens=args.max_tokens, concurrency=args.concurrency, workdir=args.workdir, keep_logs=args.keep_logs,
        transfer_only=args.transfer_only, requests=args.requests, blocks=args.blocks))


def _serve(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config, overrides={k: getattr(args, k) for k in _OVERRIDES})
    except ConfigError as exc:
        print(f"pushsvc: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.print_config:
        print(json.dumps(to_dict(config), indent=2))
        return 0
    from pushsvc.logging import configure_logging

    configure_logging(config.log_format, config.log_level)
    import uvloop

    return uvloop.run(_run_daemon(config, args.ready_file))


async def _run_daemon(config: Config, ready_file: str | None) -> int:
    from pushsvc.sdnotify import Notifier
    from pushsvc.server.daemon import Daemon

    try:
        # systemd's $NOTIFY_SOCKET and $WATCHDOG_USEC, read here at the edge like the config.
        daemon = Daemon(config, notifier=Notifier.from_env())
    except ConfigError as exc:  # the secret file changed after the config was loaded
        print(f"pushsvc: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    daemon._install_signal_handlers()
    try:
        await daemon.startup()
        if ready_file:
            _write_atomic(ready_file, json.dumps(daemon.info()))
        await daemon.main_loop()
    except ConfigError as exc:  # a runtime or socket directory the daemon cannot use
        print(f"pushsvc: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as exc:
        print(f"pushsvc: cannot start: {exc}", file=sys.stderr)
        return 1
    finally:
        await daemon.shutdown()
    return 0


def _proxy(args: argparse.Namespace) -> int:
    from pushsvc.proxy.config import load_proxy_config

    try:
        config = load_proxy_config({k: getattr(args, k) for k in _PROXY_FIELDS})
    except ConfigError as exc:
        print(f"pushsvc: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    from pushsvc.logging import configure_logging
    from pushsvc.proxy.server import run_proxy

    configure_logging(config.log_format, config.log_level)
    return run_proxy(config)


def _write_atomic(path: str, text: str) -> None:
    import os

    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _status(args: argparse.Namespace) -> int:
    base = args.url.rstrip("/")
    headers = {}
    if args.token_file:
        from pushsvc.config import read_secret_file

        try:
            token = read_secret_file(args.token_file, "token_file")
        except ConfigError as exc:
            print(f"pushsvc: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        headers["Authorization"] = "Bearer " + token.decode("latin-1")
    try:
        info = _get_json(f"{base}/v1/info", headers)
        try:
            ready = _get_json(f"{base}/readyz", {})
        except urllib.error.HTTPError as exc:
            ready = json.load(exc)
    except (OSError, ValueError) as exc:
        print(f"pushsvc: cannot reach daemon at {base}: {exc}", file=sys.stderr)
        return 1
    code = 0 if ready.get("ready") else EXIT_NOT_READY
    if args.json:
        print(json.dumps({"info": info, "ready": ready}, indent=2))
    else:
        print(format_status(info, ready))
    return code


def _get_json(url: str, headers: dict[str, str]) -> Any:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
        return json.load(r)


def format_status(info: dict[str, Any], ready: dict[str, Any]) -> str:
    """``pushsvc status`` for a person: a summary, then one table per kind of thing."""
    checks = "  ".join(f"{k}={v}" for k, v in ready.items() if k != "ready")
    lines = [
        f"engine     {info['engine_id']}  (daemon {info['daemon_id'][:8]}, version {info.get('version', '?')}, "
        f"up {info['uptime_s']:.0f}s)",
        f"ready      {'yes' if ready.get('ready') else 'NO'}  ({checks})",
        f"socket     {info['socket_path']}",
        f"side chan  {info['side_channel_host']}:{info['side_channel_port']}",
        f"open fds   {info.get('open_fds', '?')}",
        "",
    ]
    lines += _table(("rank", "role", "agent", "registered", "worker", "memory", "landing slots"), [
        (f"{a['rank']}/{a['tp_size']}" + (f" stage {a['stage']}/{a['stages']}" if a.get("stages", 1) > 1 else ""),
         a["role"], a["agent"], _yes(a["registered"]), _yes(a["worker_connected"]),
         a.get("mem_type") or "-", a.get("landing_slots", 0))
        for a in info["agents"]], empty="no ranks: no worker has said hello")
    if info.get("joints"):  # D TP above a P's: one joint agent per P rank
        lines.append("")
        lines += _table(("joint", "agent", "members", "gathering"), [
            (f"{j['rank']}/{j['tp_size']}", j["agent"], ",".join(map(str, j["members"])), j["gathering"])
            for j in info["joints"]])
    lines.append("")
    lines += _table(("peer", "daemon", "address", "authenticated", "agents", "maps our KV"), [
        (p["engine_id"], p["daemon_id"][:8], f"{p['host']}:{p['port']}", _yes(p.get("authenticated")),
         len(p["agents"]), len(p.get("ipc_ready", ()))) for p in info["peers"]], empty="no peers")
    lines.append("")
    lines += _table(("tables", "entries"), list(info["tables"].items()))
    handles = info.get("nixl_handles") or {}
    if handles:
        lines += ["", "nixl handles  " + "  ".join(f"{k}={v}" for k, v in handles.items())]
    return "\n".join(lines)


def _yes(value: object) -> str:
    return "yes" if value else "no"


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]], empty: str = "") -> list[str]:
    if not rows and empty:
        return [f"({empty})"]
    cells = [[str(c) for c in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]


# ---------------------------------------------------------------- config check


def _config_check(args: argparse.Namespace) -> int:
    env = {k: v for k, v in os.environ.items() if k != ENV_CONFIG_PATH}
    config, problems = check_config(args.file, env)
    used_env = sorted(k for k in env if k.startswith(ENV_PREFIX))
    if args.json:
        print(json.dumps({"valid": not problems, "config": to_dict(config) if config else None,
                          "problems": [{"field": p.field, "message": p.message} for p in problems],
                          "env": used_env}, indent=2))
        return EXIT_CONFIG if problems else 0
    if config is not None:
        note = "" if not problems else "  (invalid fields shown at their defaults)"
        print(f"# effective configuration of {args.file}{note}")
        for var in used_env:
            print(f"# from the environment: {var}")
        # Unset, engine_id is drawn anew at every load, so a second load tells.
        random_id = check_config(args.file, env)[0] not in (None, config) and not problems
        for key, value in to_dict(config).items():
            note = "  # not set: a new random id at every start; vLLM's engine_id must equal it" \
                if key == "engine_id" and random_id else ""
            print(f"{key} = {json.dumps(value)}{note}")
    else:
        print(f"# {args.file} does not load until the problems below are fixed: no effective configuration")
    if problems:
        print(f"\n{len(problems)} problem{'s' if len(problems) > 1 else ''}:")
        for p in problems:
            print(f"  {p.field}: {p.message}")
        return EXIT_CONFIG
    print("\nvalid: no problems found")
    return 0


def check_config(path: str, env: dict[str, str]) -> tuple[Config | None, list[ConfigError]]:
    """Load ``path`` as ``pushsvc serve --config`` would, and keep looking past the first
    problem: the loader stops at the first invalid field, so each one found is set back to
    its default and the file is loaded again, until it loads or a problem cannot be set
    aside (a TOML syntax error, an unknown key, a field whose default fails too). Returns the config
    it last loaded (None if none) and the problems, first found first."""
    defaults = {f.name: f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
                for f in msgspec.structs.fields(Config)}
    overrides: dict[str, object] = {}
    problems: list[ConfigError] = []
    while True:
        try:
            return load_config(path, env=env, overrides=overrides), problems
        except ConfigError as exc:
            if exc.field in overrides:  # its default is no better: a consequence, not news
                return None, problems
            problems.append(exc)
            if exc.field not in defaults:
                return None, problems
            overrides[exc.field] = defaults[exc.field]
