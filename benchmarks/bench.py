"""``make bench``: every pushsvc benchmark in one run, on this machine.

1. Transfer engine: daemon push vs the same WRITE in-process with NIXL (64 KiB..256 MiB,
   1..4096 blocks; and 16 MiB cut into 1..4096 blocks), per-request control overhead
   (worker message -> completion events), worker message round trip, idle daemon CPU
   (NIXL progress thread off and on), worker-side cost per engine step.
2. Serving: colocated vLLM, vLLM NixlConnector (pull), vLLM NixlPushConnector (push) and
   pushsvc, the same tiny model and prompts, concurrency 1 and 8, a mixed-length and a
   long-prompt set (see serving.py).

Writes ``results.json``, ``table.md`` and PNG charts to ``bench-results/<time>/`` and
prints the tables and which goals are met.

    python benchmarks/bench.py [--quick] [--anchors colocated,pushsvc] [--skip-transfer] ...
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tqdm import tqdm  # noqa: E402

import charts  # noqa: E402
import report  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KiB, MiB = 1 << 10, 1 << 20


def log(msg: str) -> None:
    tqdm.write(msg, file=sys.stderr)


# ---------------------------------------------------------------------------- quiet machine


def foreign_vllm_servers() -> list[str]:
    """vLLM API servers on this host not started by this process."""
    try:
        out = subprocess.run(["pgrep", "-af", "vllm.entrypoints"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return []
    import psutil

    mine = {p.pid for p in psutil.Process().children(recursive=True)}
    return [line for line in out.splitlines() if line and int(line.split()[0]) not in mine]


class HostWatch:
    """Samples the number of foreign vLLM servers every few seconds in a thread, so each
    measurement can say whether someone else's servers shared the cores meanwhile."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)

    def _run(self, every_s: float) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), len(foreign_vllm_servers())))
            self._stop.wait(every_s)

    def seen(self, start: float, end: float) -> int:
        """Most foreign servers seen between two ``time.time()`` stamps."""
        return max((n for t, n in self.samples if start - 5 <= t <= end + 5), default=0)

    def __enter__(self) -> HostWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def wait_quiet(limit_s: float, every_s: float = 30.0) -> bool:
    """Wait (up to ``limit_s``) until no other vLLM server runs: they would share our 2 cores."""
    start = time.monotonic()
    while True:
        others = foreign_vllm_servers()
        if not others:
            return True
        waited = time.monotonic() - start
        if waited >= limit_s:
            log(f"still {len(others)} foreign vLLM server(s) after {waited:.0f}s; running anyway (numbers polluted)")
            return False
        log(f"waiting for {len(others)} foreign vLLM server(s) to go away ({waited:.0f}/{limit_s:.0f}s): "
            f"{others[0][:100]}")
        time.sleep(every_s)


# ---------------------------------------------------------------------------- transfer


def run_transfer(args, bar) -> dict:
    import daemon_push
    import idle_cpu
    import nixl_pair
    import worker_step

    out: dict = {}
    block = 64 * KiB
    sizes = [s for s in (64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB) if s <= args.max_size]

    bar.set_description("transfer: in-process NIXL, 64 KiB blocks")
    base = {r["size"]: r for r in nixl_pair.run(sizes, block, args.repeats)}
    one = nixl_pair.run([block], block, 50)[0]
    bar.update(1)
    bar.set_description("transfer: daemon push, 64 KiB blocks")
    res = daemon_push.run(sizes, block, args.repeats, control=True, idle_window=args.idle_window)
    bar.update(1)
    for r in res["push"]:
        b = base[r["size"]]
        r.update(inproc_s=b["notified_s"], inproc_write_s=b["write_s"])
    out["size_sweep"] = res["push"]
    out["rtt_us"] = res["rtt_us"]
    out["idle_poll_us"] = res["idle_poll_us"]
    out["idle_cpu_percent"] = res.get("idle_cpu_percent")
    out["idle_window_s"] = res.get("idle_window_s")
    out["one_block"] = {**res["one_block"], "inproc_us": one["notified_s"] * 1e6,
                        "overhead_us": res["one_block"]["both_us"] - one["notified_s"] * 1e6}

    total = min(16 * MiB, args.max_size)
    rows = []
    for block_len in (total, total // 16, total // 256, total // 4096):
        if block_len < 4 * KiB:
            continue
        bar.set_description(f"transfer: {total >> 20} MiB as {total // block_len} blocks")
        b = nixl_pair.run([total], block_len, args.repeats)[0]
        d = daemon_push.run([total], block_len, args.repeats, control=False)["push"][0]
        d.update(inproc_s=b["notified_s"], inproc_write_s=b["write_s"])
        rows.append(d)
        bar.update(1)
    out["block_sweep"] = rows

    out["idle_cpu_progress_thread"] = {}
    for on in (False, True):
        bar.set_description(f"transfer: idle daemon, NIXL progress thread {'on' if on else 'off'}")
        out["idle_cpu_progress_thread"]["on" if on else "off"] = idle_cpu.measure(on, args.idle_window)
        bar.update(1)
    bar.set_description("transfer: worker cost per engine step")
    out["worker_step"] = worker_step.measure(args.worker_steps)
    bar.update(1)
    return out


TRANSFER_STEPS = 2 + 4 + 2 + 1


# ---------------------------------------------------------------------------- serving


WAITED = [0.0]  # seconds spent waiting for a quiet host, over the whole run


def run_serving(args, model: str, out_dir: Path, watch: HostWatch) -> dict:
    from tokenizers import Tokenizer

    import serving

    from pushsvc.loadgen.prompts import long_prompts, mixed_prompts

    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    sets = {"mixed": mixed_prompts(args.mixed, tokenizer=tok), "long": long_prompts(tok, args.long)}
    sets = {k: v for k, v in sets.items() if v}
    warmup = [*mixed_prompts(2, prefix="warm", tokenizer=tok), *long_prompts(tok, 1, prefix="warm-long")]
    conc = [int(c) for c in args.concurrency.split(",")]
    workloads = [serving.Workload(s, c) for s in sets for c in conc]
    chosen = serving.anchors(json.loads(args.nixl_extra) if args.nixl_extra else None)
    names = [n for n in args.anchors.split(",") if n]
    unknown = [n for n in names if n not in chosen]
    if unknown:
        raise SystemExit(f"unknown anchors {unknown}; known: {sorted(chosen)}")
    if "colocated" in names:  # it defines the reference outputs: run it first
        names = ["colocated"] + [n for n in names if n != "colocated"]
    per_anchor = sum(len(sets[w.prompt_set]) for w in workloads)
    result: dict = {
        "model": model, "max_tokens": args.max_tokens, "idle_window_s": args.idle_s,
        "prompt_sets": {k: {"n": len(v), "tokens": [p.tokens for p in v], "words": [p.words for p in v]}
                        for k, v in sets.items()},
        "workloads": [[w.prompt_set, w.concurrency] for w in workloads],
        "note": f"{args.max_tokens} output tokens, greedy, 1 run per workload",
        "anchors": [],
    }
    reference: dict = {}
    with tqdm(total=per_anchor * len(names), unit="req", dynamic_ncols=True, file=sys.stderr) as bar:
        for i, name in enumerate(names):
            if args.wait_quiet_s > 0:
                t0 = time.monotonic()
                wait_quiet(max(0.0, args.wait_quiet_s - WAITED[0]))
                WAITED[0] += time.monotonic() - t0
            rec = serving.run_anchor(chosen[name], model, out_dir / "logs", sets, workloads, warmup,
                                     args.max_tokens, args.idle_s, reference, bar, log)
            for run in rec["runs"]:
                run["foreign_vllm_servers"] = watch.seen(run["started"], run["ended"])
            rec["foreign_vllm_servers"] = watch.seen(rec["started"], rec["ended"])
            result["anchors"].append(rec)
            bar.n = per_anchor * (i + 1)  # an anchor that failed skips its requests
            bar.refresh()
            log(report.anchor_line(rec))
    return result


# ---------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="output folder (default bench-results/<time>)")
    ap.add_argument("--model-dir", default=str(ROOT / "bench-results" / "tiny-model"))
    ap.add_argument("--anchors", default="colocated,vllm-pull,vllm-push,vllm-pull-noprog,vllm-push-noprog,pushsvc")
    ap.add_argument("--mixed", type=int, default=24, help="mixed-length prompts (8-600 words)")
    ap.add_argument("--long", type=int, default=8, help="long prompts (1000-1500 tokens)")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--idle-s", type=float, default=5.0, help="idle CPU window per deployment")
    ap.add_argument("--nixl-extra", help="JSON kv_connector_extra_config for vLLM's NIXL connectors")
    ap.add_argument("--repeats", type=int, default=10, help="transfer repeats per size (after a warm-up)")
    ap.add_argument("--max-size", type=int, default=256 * MiB)
    ap.add_argument("--idle-window", type=float, default=10.0, help="idle daemon CPU window (s)")
    ap.add_argument("--worker-steps", type=int, default=200_000)
    ap.add_argument("--skip-transfer", action="store_true")
    ap.add_argument("--skip-serving", action="store_true")
    ap.add_argument("--quick", action="store_true", help="a smoke run: few prompts, small transfers, short windows")
    ap.add_argument("--wait-quiet-s", type=float, default=1500.0,
                    help="wait this long for other vLLM servers on the host to stop (0: do not wait)")
    args = ap.parse_args()
    # SIGTERM (and SIGINT even where a shell started us with it ignored) unwinds like
    # Ctrl-C, so every Stack stops the servers it started.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.quick:
        args.mixed, args.long, args.max_size, args.repeats = 4, 2, 16 * MiB, 2
        args.idle_window, args.idle_s, args.worker_steps, args.max_tokens = 2.0, 2.0, 20_000, 8

    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = (Path(args.out) if args.out else ROOT / "bench-results" / stamp).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    quiet = wait_quiet(args.wait_quiet_s) if args.wait_quiet_s > 0 else None
    WAITED[0] = time.monotonic() - t0
    started = time.monotonic()
    watch = HostWatch().__enter__()
    res: dict = {"quiet_at_start": quiet, "started": stamp, "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                            "machine": platform.machine()},
                 "args": vars(args)}
    try:
        import vllm
        res["host"]["vllm"] = vllm.__version__
    except Exception:  # noqa: BLE001
        pass

    if not args.skip_transfer:
        with tqdm(total=TRANSFER_STEPS, unit="step", dynamic_ncols=True, file=sys.stderr) as bar:
            t = time.time()
            res["transfer"] = run_transfer(args, bar)
            res["transfer"]["foreign_vllm_servers"] = watch.seen(t, time.time())
        print(report.transfer_tables(res["transfer"]), flush=True)
    if not args.skip_serving:
        from pushsvc.tinymodel import ensure_tiny_model

        model = ensure_tiny_model(args.model_dir)
        res["serving"] = run_serving(args, model, out_dir, watch)
        print(report.serving_table(res["serving"]), flush=True)
        print(report.idle_table(res["serving"]), flush=True)
    watch.__exit__()
    res["goals"] = report.goals(res)
    res["waited_for_quiet_s"] = WAITED[0]
    res["elapsed_s"] = time.monotonic() - started - (WAITED[0] - (started - t0))  # benchmark time, waits excluded
    (out_dir / "results.json").write_text(json.dumps(res, indent=1))
    pngs = charts.write_all(res, out_dir)
    md = report.markdown(res)
    (out_dir / "table.md").write_text(md)
    print(report.goals_text(res["goals"]))
    print(f"\nresults: {out_dir / 'results.json'}; table: {out_dir / 'table.md'}; charts: "
          + ", ".join(p.name for p in pngs))
    print(f"elapsed: {res['elapsed_s'] / 60:.1f} min (after {res['waited_for_quiet_s']:.0f} s waiting for a quiet host)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
