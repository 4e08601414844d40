"""TTFT behind two fronts of one P/D stack: ``pushsvc proxy`` and vLLM's own ``vllm-router``.

One deployment: a prefill and a decode daemon, vLLM P (``kv_producer``, worker on core 0)
and D (``kv_consumer``, core 1) with ``PushsvcConnector``, and both fronts in front of the
same P and D at once. Each front gets the same streamed completions (``pushsvc.loadgen``:
mixed prompts of 8 to 600 words, greedy, ``--max-tokens`` each) at each concurrency; the
fronts take turns, and each (concurrency, front) runs ``--rounds`` times, alternating which
front goes first, so neither always meets a warmer host. Prefix caching is off on P and D:
every round prefills and transfers every prompt again.

Prints one row per (front, concurrency): requests, failures, TTFT p50/p90, latency p50,
and writes ``fronts.json`` (settings, the summaries, every request) and ``logs/`` (every
process) to ``--out``.

    flock /tmp/pushsvc-e2e.lock .venv/bin/python benchmarks/fronts.py --out bench-results/fronts-$(date +%Y%m%d-%H%M%S)

The router runs as a user would start it: ``--vllm-pd-disaggregation --kv-connector nixl``
plus P's and D's URLs, nothing about pushsvc. It learns P's daemon coordinates from P's
first answer (see docs/routers.md), so each front gets warm-up requests first, not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol, Sequence

from pushsvc.launch import Host, Proc, Stack, connector_config, free_port
from pushsvc.loadgen.client import Batch, Result, run_batch
from pushsvc.loadgen.prompts import mixed_prompts
from pushsvc.loadgen.stats import summarize
from pushsvc.tinymodel import ensure_tiny_model

ROUTER_VERSION = "0.1.17"  # pinned in pyproject.toml's vllm extra
VLLM_EXTRA = ("--no-enable-prefix-caching",)  # every round measures a prefill and a transfer
WARMUP_REQUESTS = 3  # per front: the router's first one goes P then D, later ones both at once


class Server(Protocol):
    """What the router needs of a server: its URL (a ``Proc``, or a relay in front of one)."""

    url: str


def router_binary() -> Path:
    """The ``vllm-router`` of this interpreter's environment (the [vllm] extra installs it)."""
    path = Path(sys.executable).parent / "vllm-router"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: install the [vllm] extra (make venv)")
    return path


def start_vllm_router(stack: Stack, name: str, prefill: Sequence[Server], decode: Sequence[Server], *,
                      extra: tuple[str, ...] = (), timeout: float = 120, on: Host | None = None) -> Proc:
    """Start vllm-router in vLLM P/D mode in front of ``prefill`` and ``decode``, as a user
    would: their URLs and ``--kv-connector nixl``, nothing about pushsvc. Stopped with ``stack``.
    ``on``: the host (network namespace) to run it on, listening on its address.

    Its Prometheus listener gets a free port (the default, 29000, may be taken on a shared
    host); workers are checked every second at start-up instead of every 30 s.
    """
    port = free_port()
    host = on.ip if on is not None else "127.0.0.1"
    argv = [str(router_binary()), "--vllm-pd-disaggregation", "--kv-connector", "nixl",
            "--host", host, "--port", str(port), "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1"]
    for p in prefill:
        argv += ["--prefill", p.url]
    for d in decode:
        argv += ["--decode", d.url]
    # The stack's own server start: the same log file, process group and stop-on-exit as
    # every other process of the stack, ready once /health answers.
    return stack.server(name, [*argv, *extra], f"http://{host}:{port}", timeout=timeout, on=on)


def start_fronts(stack: Stack, model: str) -> dict[str, Proc]:
    """Daemons, P and D, then both fronts; ``{"proxy": ..., "vllm-router": ...}``."""
    from concurrent.futures import ThreadPoolExecutor

    pdaemon = stack.daemon("daemon-p", "--log-level", "warning")
    ddaemon = stack.daemon("daemon-d", "--log-level", "warning")
    with ThreadPoolExecutor(2) as pool:  # vLLM start-up is mostly waiting: overlap the two
        p = pool.submit(stack.vllm, "vllm-p", model, cpus="0", extra=VLLM_EXTRA,
                        kv_transfer_config=connector_config("kv_producer", pdaemon))
        d = pool.submit(stack.vllm, "vllm-d", model, cpus="1", extra=VLLM_EXTRA,
                        kv_transfer_config=connector_config("kv_consumer", ddaemon))
        prefill, decode = p.result(), d.result()
    return {"proxy": stack.proxy("proxy", [prefill], [pdaemon], [decode]),
            "vllm-router": start_vllm_router(stack, "vllm-router", [prefill], [decode])}


def measure(fronts: dict[str, Proc], model: str, args: argparse.Namespace) -> list[dict]:
    prompts = mixed_prompts(args.prompts, prefix="fronts")
    for name, front in fronts.items():
        warm = run_batch(front.url, model, prompts[:WARMUP_REQUESTS], max_tokens=args.max_tokens, concurrency=1,
                         tag=f"warm-{name}")
        if failed := [r.error for r in warm.results if not r.ok]:
            raise RuntimeError(f"warm-up through {name} failed: {failed}")
    runs = []
    names = list(fronts)
    for concurrency in args.concurrency:
        for round_ in range(args.rounds):
            order = names if round_ % 2 == 0 else names[::-1]
            for name in order:
                tag = f"c{concurrency}-r{round_}-{name}"
                batch: Batch = run_batch(fronts[name].url, model, prompts, max_tokens=args.max_tokens,
                                         concurrency=concurrency, tag=tag, max_failures=3)
                runs.append({"front": name, "concurrency": concurrency, "round": round_, "wall_s": batch.wall_s,
                             "results": [r.to_json() for r in batch.results]})
                print(f"  {tag}: {sum(r.ok for r in batch.results)}/{len(batch.results)} ok in {batch.wall_s:.1f}s",
                      flush=True)
    return runs


def summaries(runs: list[dict], fronts: list[str], concurrencies: list[int]) -> list[dict]:
    rows = []
    for concurrency in concurrencies:
        for front in fronts:
            mine = [r for r in runs if r["front"] == front and r["concurrency"] == concurrency]
            results = [Result(**doc) for run in mine for doc in run["results"]]
            wall = sum(run["wall_s"] for run in mine)
            rows.append({"front": front, "concurrency": concurrency, **asdict(summarize(results, wall))})
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'front':<12} {'conc':>4} {'requests':>8} {'failed':>6} {'TTFT p50 ms':>11} {'TTFT p90 ms':>11} "
            f"{'latency p50 ms':>14}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['front']:<12} {r['concurrency']:>4} {r['n']:>8} {r['failed']:>6} {r['ttft_p50_ms']:>11.0f} "
                     f"{r['ttft_p90_ms']:>11.0f} {r['latency_p50_ms']:>14.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16, help="prompts per round (default 16)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--rounds", type=int, default=2, help="rounds per (concurrency, front); even: each front "
                                                           "goes first equally often")
    ap.add_argument("--out", type=Path, default=None, help="folder for fronts.json (default: a new temp dir)")
    ap.add_argument("--model-dir", default="/tmp/pushsvc-e2e-model")
    args = ap.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="fronts-"))
    out.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc)
    model = ensure_tiny_model(args.model_dir)
    workdir = Path(tempfile.mkdtemp(prefix="psfronts-"))  # short: the daemons' Unix sockets live under it
    try:
        with Stack(workdir, progress=print) as stack:
            fronts = start_fronts(stack, model)
            runs = measure({name: fronts[name] for name in ("proxy", "vllm-router")}, model, args)
    finally:
        logs = out / "logs"
        logs.mkdir(exist_ok=True)
        for log in workdir.glob("*.log"):
            shutil.copy(log, logs / log.name)
        shutil.rmtree(workdir, ignore_errors=True)
    rows = summaries(runs, ["proxy", "vllm-router"], args.concurrency)
    print(table(rows))
    doc = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "started": started.isoformat(timespec="seconds"),
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
        "settings": {"prompts": args.prompts, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
                     "rounds": args.rounds, "warmup_requests_per_front": WARMUP_REQUESTS,
                     "vllm_router": ROUTER_VERSION, "vllm_extra": list(VLLM_EXTRA),
                     "pinning": "P worker on core 0, D worker on core 1"},
        "summary": rows,
        "runs": runs,
    }
    path = out / "fronts.json"
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
