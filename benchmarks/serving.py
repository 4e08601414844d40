"""Serving benchmark: the same model, prompts and vLLM build through four deployments.

* ``colocated``: one vLLM server, no connector (the reference outputs and the TTFT floor).
* ``vllm-pull``: P/D with vLLM's ``NixlConnector`` (D READs from P), driven like vLLM's
  toy proxy (``vllm_proxy.py --mode pull``).
* ``vllm-push``: P/D with vLLM's ``NixlPushConnector`` (P WRITEs into D), driven like
  its authors' push proxy (``vllm_proxy.py --mode push``).
* ``pushsvc``: P/D with ``PushsvcConnector``, one daemon per instance, ``pushsvc proxy``.

P/D deployments pin P's worker to core 0 and D's to core 1 (``VLLM_CPU_OMP_THREADS_BIND``).
For each deployment: start, warm up (first handshakes; not measured), measure idle CPU,
then every (prompt set, concurrency) workload; per workload TTFT, per-token latency,
requests/s, CPU seconds per request over every process of the deployment, and how many
outputs equal the colocated ones.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import attribution
from procstats import CpuMeter, total

from pushsvc.launch import Host, Proc, Stack, connector_config, free_port, vllm_dtype
from pushsvc.loadgen.client import run_batch
from pushsvc.loadgen.prompts import Prompt
from pushsvc.loadgen.stats import summarize

HERE = Path(__file__).resolve().parent
NOPROG_DIR = HERE / "nixl_noprog"
WARMUP_TRIES = 3
# Every workload sends the same prompts again: without this, later runs would hit the
# prefix cache (on P, on D, or colocated) and measure no prefill and no transfer.
VLLM_EXTRA = ("--no-enable-prefix-caching",)
WARMUP_TIMEOUT_S = 60.0
MAX_FAILURES = 3  # per workload; then its other requests are skipped


class BenchStack(Stack):
    """``Stack`` with extra environment variables per process name (vLLM's NIXL side
    channel is configured only through the environment); with ``vllm_stats``, its vLLM
    servers keep their statistics (``/metrics``' request histograms), which ``Stack``
    turns off."""

    def __init__(self, *args, vllm_stats: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.env_for: dict[str, dict[str, str]] = {}
        self.vllm_stats = vllm_stats

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None, on: Host | None = None) -> Proc:
        if self.vllm_stats and "vllm.entrypoints.openai.api_server" in argv:
            argv = [a for a in argv if a != "--disable-log-stats"]
        return super()._spawn(name, argv, {**(env or {}), **self.env_for.get(name, {})}, on=on)


@dataclass
class Deployment:
    url: str
    roots: dict[str, int]  # label -> pid of a process tree that belongs to this deployment
    metrics: dict[str, str] = field(default_factory=dict)  # label -> Prometheus /metrics URL
    # pushsvc: the last ``n`` requests' timelines (proxy log, P's and D's daemons)
    timelines: Callable[[int], tuple[list[dict], list[dict], list[dict]]] | None = None
    servers: dict[str, str] = field(default_factory=dict)  # label -> a vLLM server's base URL


# Daemon histograms whose per-workload mean says where a pushsvc request's time goes.
DAEMON_TIMERS = ("pushsvc_match_wait_seconds", "pushsvc_transfer_seconds", "pushsvc_recv_seconds")


def _scrape(urls: dict[str, str], timers: tuple[str, ...] = DAEMON_TIMERS) -> dict[str, float]:
    """``label:metric_sum`` / ``label:metric_count`` for ``timers`` at each URL, over all
    of a timer's series (vLLM labels its own by engine and model)."""
    out: dict[str, float] = {}
    for label, url in urls.items():
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                text = r.read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            series, _, value = line.rpartition(" ")
            name = series.split("{", 1)[0]
            if not line.startswith("#") and name.endswith(("_sum", "_count")) and name.rsplit("_", 1)[0] in timers:
                out[f"{label}:{name}"] = out.get(f"{label}:{name}", 0.0) + float(value)
    return out


def _timer_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean milliseconds per observation of each timer between two scrapes."""
    means = {}
    for key in after:
        if key.endswith("_sum"):
            base = key[: -len("_sum")]
            n = after.get(base + "_count", 0) - before.get(base + "_count", 0)
            if n > 0:
                means[base + "_mean_ms"] = (after[key] - before.get(key, 0.0)) / n * 1e3
    return means


@dataclass(frozen=True)
class Anchor:
    name: str
    title: str
    settings: dict
    start: Callable[[BenchStack, str], Deployment]
    # A variant that may not work at all gets one short warm-up instead of three.
    warmup_tries: int = 3
    warmup_timeout_s: float = 60.0


def _together(stack: Stack, starts: dict[str, Callable[[], Proc]]) -> list[Proc]:
    """Start servers in parallel (vLLM start-up is mostly single-threaded Python)."""
    results: dict[str, Proc | BaseException] = {}

    def run(name: str, fn: Callable[[], Proc]) -> None:
        try:
            results[name] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            results[name] = exc

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in starts.items()]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.2)
    for r in results.values():
        if isinstance(r, BaseException):
            raise r
    return [results[n] for n in starts]  # type: ignore[misc]


# ---------------------------------------------------------------------------- anchors


def _colocated(stack: BenchStack, model: str) -> Deployment:
    p = stack.vllm("colocated", model, extra=VLLM_EXTRA)
    return Deployment(p.url, {"vllm": p.popen.pid}, servers={"colocated": p.url})


def _nixl(mode: str, prog_thread: bool, extra: dict, name: str) -> Callable[[BenchStack, str], Deployment]:
    connector = {"pull": "NixlConnector", "push": "NixlPushConnector"}[mode]

    def start(stack: BenchStack, model: str) -> Deployment:
        ports = {"p": free_port(), "d": free_port()}
        procs = {}
        for role in ("p", "d"):
            env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports[role])}
            if not prog_thread:
                env["BENCH_NIXL_PROG_THREAD"] = "0"
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(NOPROG_DIR), os.environ.get("PYTHONPATH")]))
            stack.env_for[f"{name}-{role}"] = env
            cfg = {"kv_connector": connector, "kv_role": "kv_both", "kv_buffer_device": "cpu",
                   "engine_id": f"{name}-{role}", **({"kv_connector_extra_config": extra} if extra else {})}
            cpus = "0" if role == "p" else "1"
            procs[role] = (lambda r=role, c=cfg, cp=cpus: stack.vllm(f"{name}-{r}", model, kv_transfer_config=c,
                                                                      cpus=cp, extra=VLLM_EXTRA))
        p, d = _together(stack, {f"{name}-p": procs["p"], f"{name}-d": procs["d"]})
        port = free_port()
        argv = [sys.executable, str(HERE / "vllm_proxy.py"), "--mode", mode, "--prefill", p.url, "--decode", d.url,
                "--port", str(port)]
        if mode == "push":
            argv += ["--prefill-engine-id", f"{name}-p", "--prefill-host", "127.0.0.1",
                     "--prefill-side-channel-port", str(ports["p"])]
        proxy = stack.server(f"{name}-proxy", argv, f"http://127.0.0.1:{port}", timeout=60, health="/healthz")
        return Deployment(proxy.url, {"P": p.popen.pid, "D": d.popen.pid, "proxy": proxy.popen.pid})

    return start


def _pushsvc(stack: BenchStack, model: str, p_extra: dict | None = None, d_flags: tuple[str, ...] = ()) -> Deployment:
    """pushsvc's P/D; ``p_extra``: more of P's ``kv_connector_extra_config``; ``d_flags``:
    more of D's vLLM flags."""
    pd = stack.daemon("pushsvc-daemon-p", "--log-level", "warning")
    dd = stack.daemon("pushsvc-daemon-d", "--log-level", "warning")
    p, d = _together(stack, {
        "pushsvc-p": lambda: stack.vllm("pushsvc-p", model, cpus="0", extra=VLLM_EXTRA,
                                        kv_transfer_config=connector_config("kv_producer", pd, **(p_extra or {}))),
        "pushsvc-d": lambda: stack.vllm("pushsvc-d", model, cpus="1", extra=(*VLLM_EXTRA, *d_flags),
                                        kv_transfer_config=connector_config("kv_consumer", dd)),
    })
    proxy = stack.proxy("pushsvc-proxy", [p], [pd], [d])

    def timelines(n: int) -> tuple[list[dict], list[dict], list[dict]]:
        return (attribution.proxy_timelines(proxy.log)[-n:], attribution.daemon_timelines(pd.url, n),
                attribution.daemon_timelines(dd.url, n))

    return Deployment(proxy.url, {"P": p.popen.pid, "D": d.popen.pid, "daemon-P": pd.popen.pid,
                                  "daemon-D": dd.popen.pid, "proxy": proxy.popen.pid},
                      {"P": f"{pd.url}/metrics", "D": f"{dd.url}/metrics"}, timelines, {"P": p.url, "D": d.url})


_PD = {"pinning": "P worker on core 0, D worker on core 1 (VLLM_CPU_OMP_THREADS_BIND)"}
_VLLM = {"flags": f"--enforce-eager --max-model-len 4096 --dtype {vllm_dtype()} --seed 0 --no-enable-prefix-caching, "
                  "VLLM_CPU_KVCACHE_SPACE=1"}


def anchors(nixl_extra: dict | None = None) -> dict[str, Anchor]:
    """Every deployment the benchmark knows. vLLM's NIXL connectors come twice: as vLLM
    ships them (NIXL progress thread on) and with the progress thread off (``-noprog``)."""
    extra = dict(nixl_extra or {})

    def nixl_settings(prog: bool) -> dict:
        return {**_VLLM, **_PD, "kv_role": "kv_both", "kv_buffer_device": "cpu",
                "engine_id": "set per server; VLLM_NIXL_SIDE_CHANNEL_HOST/PORT per server",
                **({"kv_connector_extra_config": extra} if extra else {}),
                "nixl_progress_thread": "on (vLLM default)" if prog else
                "off (enable_prog_thread=False via benchmarks/nixl_noprog/sitecustomize.py)"}

    pull_proxy = "benchmarks/vllm_proxy.py --mode pull (P first, its kv_transfer_params to D)"
    push_proxy = ("benchmarks/vllm_proxy.py --mode push (P and D legs concurrently, "
                  "P's engine id + side channel given to D up front)")
    out = [Anchor("colocated", "colocated vLLM", {**_VLLM, "pinning": "vLLM default (worker on core 0)"}, _colocated)]
    for prog in (True, False):
        suffix = "" if prog else "-noprog"
        note = "" if prog else ", progress thread off"
        out += [
            Anchor(f"vllm-pull{suffix}", f"vLLM NixlConnector (pull{note})", {**nixl_settings(prog), "proxy": pull_proxy},
                   _nixl("pull", prog, extra, f"vllm-pull{suffix}"), *(() if prog else (1, 30.0))),
            Anchor(f"vllm-push{suffix}", f"vLLM NixlPushConnector (push{note})",
                   {**nixl_settings(prog), "proxy": push_proxy}, _nixl("push", prog, extra, f"vllm-push{suffix}"),
                   *(() if prog else (1, 30.0))),
        ]
    out.append(Anchor("pushsvc", "pushsvc",
                      {**_VLLM, **_PD, "daemons": "one per instance, NIXL progress thread off (default), "
                                                  "log level warning",
                       "connector": "PushsvcConnector defaults (idle_wait_ms 10)", "proxy": "pushsvc proxy"},
                      _pushsvc))
    return {a.name: a for a in out}


# ---------------------------------------------------------------------------- runs


@dataclass
class RunRecord:
    anchor: str
    prompt_set: str
    concurrency: int
    wall_s: float
    summary: dict
    cpu_s_per_req: float
    cpu_by_proc_s: dict
    matches: int | None
    compared: int
    results: list[dict] = field(default_factory=list)


@dataclass
class Workload:
    prompt_set: str
    concurrency: int


def run_anchor(anchor: Anchor, model: str, workdir: Path, prompt_sets: dict[str, list[Prompt]],
               workloads: list[Workload], warmup: list[Prompt], max_tokens: int, idle_s: float,
               reference: dict[tuple[str, int], dict[str, str]], bar, log: Callable[[str], None]) -> dict:
    """Start ``anchor``, run every workload, stop it. ``reference`` maps (set, concurrency)
    -> prompt id -> colocated text (filled in by the colocated anchor, which runs first)."""
    out: dict = {"anchor": anchor.name, "title": anchor.title, "settings": anchor.settings, "runs": [],
                 "started": time.time()}
    started = time.monotonic()
    with BenchStack(workdir / anchor.name, progress=log) as stack:
        try:
            bar.set_description(f"{anchor.name}: starting")
            dep = anchor.start(stack, model)
            out["start_s"] = time.monotonic() - started
            meter = CpuMeter(dep.roots)
            # Idle CPU before any request: what the deployment costs doing nothing.
            bar.set_description(f"{anchor.name}: idle CPU (cold)")
            out["idle_cold_cpu_percent"], out["idle_cold_cpu_percent_total"] = _idle(meter, idle_s)
            bar.set_description(f"{anchor.name}: warm-up")
            # The first request pays the NIXL handshakes; vLLM's times out after 5 s and fails
            # the request, which happens on a loaded 2-core host: allow a few tries.
            out["warmup"] = []
            for attempt in range(anchor.warmup_tries):
                warm, _ = run_batch(dep.url, model, warmup, max_tokens=max_tokens, concurrency=1,
                                    tag=f"{anchor.name}-w{attempt}", timeout_s=anchor.warmup_timeout_s, max_failures=1)
                out["warmup"] += [r.to_json() for r in warm]
                failed = [r for r in warm if not r.ok]
                if not failed:
                    break
                log(f"  {anchor.name}: warm-up try {attempt + 1} failed: {failed[0].error}")
            else:
                raise RuntimeError(f"warm-up failed ({anchor.warmup_tries} tries, {anchor.warmup_timeout_s:.0f} s "
                                   f"timeout): {failed[0].error}")
            bar.set_description(f"{anchor.name}: idle CPU")
            out["idle_cpu_percent"], out["idle_cpu_percent_total"] = _idle(meter, idle_s)
            for wl in workloads:
                prompts = prompt_sets[wl.prompt_set]
                bar.set_description(f"{anchor.name}: {wl.prompt_set} c={wl.concurrency}")
                m0 = _scrape(dep.metrics)
                s0 = meter.snapshot()
                t_start = time.time()
                results, wall = run_batch(dep.url, model, prompts, max_tokens=max_tokens,
                                          concurrency=wl.concurrency, tag=f"{anchor.name}-{wl.prompt_set}-c{wl.concurrency}",
                                          on_result=lambda r: bar.update(1), max_failures=MAX_FAILURES)
                used = CpuMeter.delta(s0, meter.snapshot())
                timers = _timer_means(m0, _scrape(dep.metrics))
                if anchor.name == "colocated":
                    reference[(wl.prompt_set, wl.concurrency)] = {r.request_id: r.text for r in results if r.ok}
                # Against colocated at c=1 (one sequence per batch: the cleanest reference) and
                # at the same concurrency (bf16 results depend on the batch a sequence ran in).
                ref = reference.get((wl.prompt_set, 1))
                same = reference.get((wl.prompt_set, wl.concurrency))
                count = lambda rf: None if rf is None else sum(  # noqa: E731
                    1 for r in results if r.ok and rf.get(r.request_id) == r.text)
                rec = RunRecord(anchor.name, wl.prompt_set, wl.concurrency, wall, asdict(summarize(results, wall)),
                                total(used) / len(results), used, count(ref), len(ref or {}),
                                [r.to_json() for r in results])
                where = phase_medians(dep, len(prompts))
                out["runs"].append({**asdict(rec), "matches_same_c": count(same), "daemon_timers_ms": timers,
                                    "attribution_p50_ms": where, "started": t_start, "ended": time.time()})
                if where:
                    log(f"  {anchor.name} {wl.prompt_set} c={wl.concurrency} TTFT p50 by phase (ms, "
                        f"{where['requests']:.0f} requests): " + ", ".join(
                            f"{k} {where[k]}" for k in (*attribution.PHASES, *attribution.TOTALS) if k in where))
                errors = [r.error for r in results if not r.ok]
                if errors:
                    log(f"  {anchor.name} {wl.prompt_set} c={wl.concurrency}: {len(errors)} failed, e.g. {errors[0]}")
                time.sleep(1.0)
        except Exception as exc:  # noqa: BLE001 - recorded; the next anchor still runs
            out["error"] = f"{type(exc).__name__}: {exc}"
            out["traceback"] = traceback.format_exc()
            log(f"  {anchor.name} FAILED: {out['error'][:2000]}")
        finally:
            bar.set_description(f"{anchor.name}: stopping")
    out["total_s"] = time.monotonic() - started
    out["ended"] = time.time()
    return out


def phase_medians(dep: Deployment, n: int, prefix: str = "") -> dict[str, float] | None:
    """Medians of the phases of the last ``n`` requests (``attribution.py``), where the
    deployment has timelines; None where it has none. With ``prefix``, of the requests
    among the last ``4 n`` whose proxy request id starts with it (one run of a client that
    names its requests, ``latency.py``). Timelines that cannot be read give ``requests`` 0
    and the error."""
    stats = phase_stats(dep, n, prefix)
    return None if stats is None else stats["p50"]


def phase_stats(dep: Deployment, n: int, prefix: str = "") -> dict[str, dict] | None:
    """``phase_medians`` as ``p50``, as ``tail`` where the slowest requests' extra time
    went (``attribution.tail_excess``), and each request's phases as ``per_request`` (proxy
    request id -> phase -> ms, for a look at one run's tail afterwards); ``tail`` and
    ``per_request`` are empty where the timelines cannot be read."""
    if dep.timelines is None:
        return None
    time.sleep(0.5)  # the proxy logs a request's timeline as its response ends
    try:
        proxy, p, d = dep.timelines(4 * n if prefix else n)
        if prefix:
            proxy = [line for line in proxy if str(line.get("request_id", "")).startswith(prefix)]
        per_request = attribution.attribute(proxy, p, d)
    except (OSError, ValueError, KeyError) as exc:
        return {"p50": {"requests": 0, "error": str(exc)[:200]}, "tail": {}, "per_request": {}}
    return {"p50": attribution.medians(per_request), "tail": attribution.tail_excess(per_request),
            "per_request": per_request}


def _idle(meter: CpuMeter, seconds: float) -> tuple[dict[str, float], float]:
    """% of a core used by each process of the deployment over ``seconds`` of no requests."""
    time.sleep(2.0)  # let the last request's tail (frees, leases) settle
    s0 = meter.snapshot()
    time.sleep(seconds)
    used = CpuMeter.delta(s0, meter.snapshot())
    return {k: v / seconds * 100 for k, v in used.items()}, total(used) / seconds * 100
