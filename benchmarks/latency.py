"""Where a P/D request's time to first token goes, per prompt length, next to colocated.

Driven by vLLM's own serving benchmark client (``vllm_serve.py``: ``--dataset-name random``,
fixed input and output lengths, streamed completions, ``--ignore-eos``) against each
deployment: a colocated vLLM, and pushsvc's P/D (two vLLM CPU servers, their daemons and
the proxy). For every input length and concurrency, the client's TTFT p50/p90 and, for
pushsvc, the TTFT of the same requests split into phases from their three timelines
(``attribution.py``: P's queue and prefill, transfer, D notified, D's first step, the
proxy's forwarding), which phase holds the slowest requests' extra time (the "tail
owner": over the slowest eighth, the phase furthest above its median) and the transfer
overhead against its goal. Prints a table; writes ``latency.json`` and ``latency.png``
into ``--out``. ``make bench-latency`` runs it; ``BENCH_ARGS`` passes arguments.
Diagnostics: ``--vllm-stats`` (vLLM's own request histograms per server),
``--vllm-spin-ms`` (``vllm_spin/sitecustomize.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import attribution
import serving

from pushsvc.tinymodel import ensure_tiny_model

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEPLOYMENTS = {"colocated": serving._colocated, "pushsvc": serving._pushsvc,
               "pushsvc-layerwise": lambda stack, model: serving._pushsvc(stack, model, {"layerwise_push": True}),
               # Not in the defaults: D's vLLM without asynchronous scheduling (what it does to D's first step).
               "pushsvc-layerwise-dsync": lambda stack, model: serving._pushsvc(
                   stack, model, {"layerwise_push": True}, d_flags=("--no-async-scheduling",))}
PD_DEPLOYMENTS = ("pushsvc", "pushsvc-layerwise", "pushsvc-layerwise-dsync")


@dataclass(frozen=True)
class Point:
    input_len: int
    concurrency: int

    @property
    def tag(self) -> str:
        return f"in{self.input_len}-c{self.concurrency}"


def client_run(url: str, model: str, point: Point, args: argparse.Namespace, out: Path, prefix: str) -> dict:
    """One run of vLLM's client; its result JSON (TTFT percentiles in ms among it)."""
    name = f"{prefix}{point.tag}.json"
    argv = [sys.executable, str(HERE / "vllm_serve.py"), "--base-url", url, "--model", model, "--tokenizer", model,
            "--backend", "openai", "--endpoint", "/v1/completions", "--dataset-name", "random",
            "--random-input-len", str(point.input_len), "--random-output-len", str(args.output_len),
            "--random-range-ratio", "0", "--num-prompts", str(args.prompts),
            "--max-concurrency", str(point.concurrency), "--ignore-eos", "--seed", "0",
            "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,90",
            "--request-id-prefix", f"{prefix}{point.tag}-", "--disable-tqdm",
            "--save-result", "--result-dir", str(out), "--result-filename", name]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.run_timeout_s)
    (out / f"{prefix}{point.tag}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"vllm_serve.py exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads((out / name).read_text())


def run_deployment(name: str, model: str, points: list[Point], args: argparse.Namespace, out: Path) -> dict:
    rec: dict = {"deployment": name, "runs": []}
    with serving.BenchStack(out / "logs" / name, progress=print, vllm_stats=args.vllm_stats) as stack:
        dep = DEPLOYMENTS[name](stack, model)
        warm = Point(min(p.input_len for p in points), 1)
        client_run(dep.url, model, warm, argparse.Namespace(**{**vars(args), "prompts": 4}), out, f"{name}-warm-")
        for point in points:
            prefix = f"{name}-{point.tag}-"
            stats_before = serving._scrape(_metrics_urls(dep), VLLM_TIMERS) if args.vllm_stats else {}
            result = client_run(dep.url, model, point, args, out, f"{name}-")
            stats = serving.phase_stats(dep, args.prompts, prefix) or {}
            run = {"input_len": point.input_len, "concurrency": point.concurrency,
                   "completed": result.get("completed"), "failed": result.get("failed"),
                   "ttft_p50_ms": result.get("median_ttft_ms"), "ttft_p90_ms": result.get("p90_ttft_ms"),
                   "tpot_p50_ms": result.get("median_tpot_ms"),
                   "phases_p50_ms": stats.get("p50"), "phases_tail_ms": stats.get("tail"),
                   "phases_per_request_ms": stats.get("per_request")}
            if args.vllm_stats:
                run["vllm_means_ms"] = vllm_means(stats_before, serving._scrape(_metrics_urls(dep), VLLM_TIMERS))
            if args.events and dep.timelines is not None:
                run["event_gaps_ms"] = run_gaps(dep, args.prompts, prefix)
                run["events_p50_ms"] = event_medians(run["event_gaps_ms"], args.prompts)
            rec["runs"].append(run)
            print(f"  {name} {point.tag}: TTFT p50 {run['ttft_p50_ms']:.1f} ms, p90 {run['ttft_p90_ms']:.1f} ms, "
                  f"{run['completed']} completed, {run['failed']} failed"
                  + (f"; phases {run['phases_p50_ms']}" if run["phases_p50_ms"] else ""), flush=True)
            if run.get("vllm_means_ms"):
                print(f"    vLLM's own means: {run['vllm_means_ms']}", flush=True)
            if run["phases_tail_ms"]:
                print(f"    slowest requests, over each phase's median: {run['phases_tail_ms']}", flush=True)
            for step, (ms, n) in run.get("events_p50_ms", {}).items():
                print(f"    {step:48s} {ms:8.2f} ms  ({n} requests)", flush=True)
    return rec


def run_gaps(dep: serving.Deployment, n: int, prefix: str) -> dict[str, list[float]]:
    """Of the run's requests (proxy request ids starting with ``prefix``): the gap between
    every two events that follow one another in P's and D's merged timelines, per order
    (``attribution.event_gaps``; kept in the JSON, one value per request)."""
    proxy, p, d = dep.timelines(4 * n)
    proxy = [line for line in proxy if str(line.get("request_id", "")).startswith(prefix)]
    return attribution.event_gaps(proxy, p, d)


def event_medians(gaps: dict[str, list[float]], n: int) -> dict[str, tuple[float, int]]:
    """The median of each order of ``gaps`` that at least a quarter of the run's ``n``
    requests took; in path order."""
    kept = [(k, v) for k, v in gaps.items() if 4 * len(v) >= n]
    return {k: (round(statistics.median(v), 3), len(v)) for k, v in kept}


def _by_point(res: dict) -> dict[tuple[int, int, str], dict]:
    """Every run, by (input length, concurrency, deployment)."""
    return {(r["input_len"], r["concurrency"], d["deployment"]): r for d in res["deployments"] for r in d["runs"]}


def table(res: dict) -> str:
    """One row per input length, concurrency and P/D deployment, beside colocated's TTFT."""
    runs = _by_point(res)
    head = ["input", "c", "deployment", "TTFT colocated", "TTFT P/D", "ratio", "p90/p50 P/D", *attribution.PHASES,
            "after_prefill", "tail owner"]
    rows = []
    for point in res["points"]:
        key = (point["input_len"], point["concurrency"])
        col = runs.get((*key, "colocated"))
        for name in PD_DEPLOYMENTS:
            pd = runs.get((*key, name))
            if col is None or pd is None:
                continue
            ph = pd["phases_p50_ms"] or {}
            rows.append([str(key[0]), str(key[1]), name, f"{col['ttft_p50_ms']:.1f}", f"{pd['ttft_p50_ms']:.1f}",
                         f"{pd['ttft_p50_ms'] / col['ttft_p50_ms']:.2f}x",
                         f"{pd['ttft_p90_ms'] / pd['ttft_p50_ms']:.2f}",
                         *(f"{ph[k]:.1f}" if k in ph else "-" for k in (*attribution.PHASES, "after_prefill")),
                         _owner(pd.get("phases_tail_ms") or {})])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)])


def _owner(tail: dict[str, float]) -> str:
    """The phase that holds the slowest requests' extra time, e.g. ``transfer +12.3``."""
    owner = attribution.tail_owner(tail)
    return "-" if owner is None else f"{owner[0]} +{owner[1]:.1f}"


def layerwise_goal(res: dict, layers: int) -> list[str]:
    """Per point with both P/D deployments: layer-wise push's P/D TTFT - P's prefill
    (``after_prefill`` p50) against one layer's transfer (whole-request push's transfer
    p50 / ``layers``) plus one D step (layer-wise's TPOT p50)."""
    runs = _by_point(res)
    out = []
    for point in res["points"]:
        key = (point["input_len"], point["concurrency"])
        whole, lw = runs.get((*key, "pushsvc")), runs.get((*key, "pushsvc-layerwise"))
        if whole is None or lw is None:
            continue
        after = (lw["phases_p50_ms"] or {}).get("after_prefill")
        transfer = (whole["phases_p50_ms"] or {}).get("transfer")
        step = lw.get("tpot_p50_ms")
        if after is None or transfer is None or step is None:
            continue
        bound = transfer / layers + step
        out.append(f"in{key[0]} c={key[1]}: layer-wise TTFT - prefill {after:.1f} ms vs one layer's transfer "
                   f"{transfer / layers:.2f} + one D step {step:.1f} = {bound:.1f} ms: "
                   f"{'met' if after <= bound else 'not met'} (whole-request push: "
                   f"{(whole['phases_p50_ms'] or {}).get('after_prefill', float('nan')):.1f} ms)")
    return out


OVERHEAD_GOAL_MS = {1: 2.0, 8: 5.0}  # concurrency -> the transfer overhead's p50 goal


def overhead_goal(res: dict) -> list[str]:
    """Per P/D run: the transfer overhead, P/D TTFT - (P's prefill + one D decode step), as
    ``after_prefill`` p50 - the run's TPOT p50, against its goal where the concurrency has
    one (<= 2 ms at 1, <= 5 ms at 8)."""
    runs = _by_point(res)
    out = []
    for point in res["points"]:
        key = (point["input_len"], point["concurrency"])
        for name in PD_DEPLOYMENTS:
            run = runs.get((*key, name))
            after = ((run or {}).get("phases_p50_ms") or {}).get("after_prefill")
            step = (run or {}).get("tpot_p50_ms")
            if after is None or step is None:
                continue
            overhead, goal = after - step, OVERHEAD_GOAL_MS.get(key[1])
            verdict = "no goal at this concurrency" if goal is None else (
                f"goal <= {goal:.0f} ms {'met' if overhead <= goal else 'not met'}")
            out.append(f"in{key[0]} c={key[1]} {name}: transfer overhead {overhead:.1f} ms (TTFT - prefill "
                       f"{after:.1f} - one D step {step:.1f}): {verdict}")
    return out


def chart(res: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = _by_point(res)
    points = [(p["input_len"], p["concurrency"]) for p in res["points"]
              if (p["input_len"], p["concurrency"], "pushsvc") in runs and (p["input_len"], p["concurrency"],
                                                                             "colocated") in runs]
    layerwise = [runs.get((*key, "pushsvc-layerwise")) for key in points]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(points)), 4))
    for i, key in enumerate(points):
        ax.bar(i - 0.2, runs[(*key, "colocated")]["ttft_p50_ms"], 0.38, color="0.6",
               label="colocated TTFT p50" if i == 0 else None)
        bottom = 0.0
        for j, phase in enumerate(attribution.PHASES):
            value = (runs[(*key, "pushsvc")]["phases_p50_ms"] or {}).get(phase, 0.0)
            ax.bar(i + 0.2, value, 0.38, bottom=bottom, color=f"C{j}", label=phase if i == 0 else None)
            bottom += value
        if layerwise[i] is not None:
            ax.plot([i + 0.01, i + 0.39], [layerwise[i]["ttft_p50_ms"]] * 2, color="k", linewidth=2,
                    label="layer-wise push TTFT p50" if i == 0 else None)
    ax.set_xticks(range(len(points)), [f"{n} tok\nc={c}" for n, c in points])
    ax.set_ylabel("ms (p50)")
    ax.set_title("pushsvc P/D TTFT by phase vs colocated (vLLM's serving client)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _layers(model: str) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"])


# vLLM's request histograms, by the name ``vllm_means`` gives them: arrival at the
# EngineCore -> scheduled, scheduled -> first token (both EngineCore's clock), arrival at
# the API server -> first token out of it.
VLLM_HISTOGRAMS = {"queue": "vllm:request_queue_time_seconds", "first_token": "vllm:request_prefill_time_seconds",
                   "ttft": "vllm:time_to_first_token_seconds"}
VLLM_TIMERS = tuple(VLLM_HISTOGRAMS.values())


def _metrics_urls(dep: serving.Deployment) -> dict[str, str]:
    return {label: f"{url}/metrics" for label, url in dep.servers.items()}


def vllm_means(before: dict[str, float], after: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per vLLM server of the deployment, the mean of each of ``VLLM_TIMERS`` over the
    requests between two scrapes (ms): ``queue`` (on D: the wait for the KV included),
    ``first_token`` (scheduled -> first token: on D, the step that computes the prompt's
    last token), ``ttft`` and ``frontend`` (ttft - queue - first_token: the API server's
    and the process hops' share)."""
    short = {f"{metric}_mean_ms": name for name, metric in VLLM_HISTOGRAMS.items()}
    out: dict[str, dict[str, float]] = {}
    for key, ms in serving._timer_means(before, after).items():
        label, metric = key.split(":", 1)
        out.setdefault(label, {})[short[metric]] = round(ms, 3)
    for times in out.values():
        if {"queue", "first_token", "ttft"} <= times.keys():
            times["frontend"] = round(times["ttft"] - times["queue"] - times["first_token"], 3)
    return out


def spin_env(spin_ms: float, env: dict[str, str]) -> None:
    """Put ``benchmarks/vllm_spin`` first on ``env``'s PYTHONPATH with the spin it sets, for
    every process the deployments then start."""
    env["BENCH_VLLM_SPIN_S"] = str(spin_ms / 1000.0)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent / "vllm_spin"),
                                                      env.get("PYTHONPATH")]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="output folder (default bench-results/latency-<time>)")
    ap.add_argument("--model-dir", default=str(ROOT / "bench-results" / "tiny-model"))
    ap.add_argument("--input-lens", default="64,256,1024,2048")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--prompts", type=int, default=16, help="requests per input length and concurrency")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--deployments", default="colocated,pushsvc,pushsvc-layerwise")
    ap.add_argument("--run-timeout-s", type=float, default=900.0)
    ap.add_argument("--events", action="store_true",
                    help="also print, per run, the median gap between consecutive events of P's and D's "
                         "daemon timelines (where the transfer goes)")
    ap.add_argument("--vllm-spin-ms", type=float,
                    help="diagnostic: how long vLLM's workers spin for their next step (vLLM's own: 1000), "
                         "in every deployment (benchmarks/vllm_spin)")
    ap.add_argument("--vllm-stats", action="store_true",
                    help="keep vLLM's statistics on and print, per run, the means of its request histograms "
                         "(queue, scheduled -> first token, TTFT) for each vLLM server")
    args = ap.parse_args(argv)
    if args.vllm_spin_ms is not None:
        spin_env(args.vllm_spin_ms, os.environ)
    out = Path(args.out or ROOT / "bench-results" / f"latency-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = ensure_tiny_model(args.model_dir)
    points = [Point(int(n), int(c)) for n in args.input_lens.split(",") for c in args.concurrency.split(",")]
    res: dict = {"model": model, "output_len": args.output_len, "prompts": args.prompts,
                 "client": "vllm.benchmarks.serve (random dataset, streamed /v1/completions, ignore_eos)",
                 "points": [{"input_len": p.input_len, "concurrency": p.concurrency} for p in points],
                 "deployments": [], "started": datetime.now().isoformat(timespec="seconds"),
                 "vllm_spin_ms": args.vllm_spin_ms}
    for name in args.deployments.split(","):
        if name not in DEPLOYMENTS:
            raise SystemExit(f"unknown deployment {name!r}; known: {sorted(DEPLOYMENTS)}")
        res["deployments"].append(run_deployment(name, model, points, args, out))
        (out / "latency.json").write_text(json.dumps(res, indent=2))
    goal = [*overhead_goal(res), *layerwise_goal(res, _layers(model))]
    text = "\n".join([table(res), "", *goal])
    print(text)
    (out / "latency.md").write_text(text + "\n")
    png = chart(res, out / "latency.png")
    print(f"results: {out / 'latency.json'}" + (f", {png}" if png else ""))
    failed = sum(r.get("failed") or 0 for d in res["deployments"] for r in d["runs"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
