"""Tables and goal checks over a results dict (what bench.py writes to results.json).

    python benchmarks/report.py bench-results/<run>/results.json   # re-print and rewrite table.md
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

TTFT_VS_COLOCATED = 1.2
PUSH_VS_INPROC = 0.90
PUSH_MIN_SIZE = 16 << 20
IDLE_DAEMON_PERCENT = 1.0
WORKER_STEP_US = 20.0


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def anchor_line(rec: dict) -> str:
    if "error" in rec:
        return f"  {rec['anchor']}: FAILED ({rec['error'][:300]})"
    parts = [f"{r['prompt_set']} c={r['concurrency']}: TTFT p50 {r['summary']['ttft_p50_ms']:.0f} ms"
             for r in rec["runs"]]
    return f"  {rec['anchor']} done in {rec['total_s']:.0f}s (start {rec.get('start_s', 0):.0f}s): " + "; ".join(parts)


# ---------------------------------------------------------------------------- transfer


def transfer_rows(tr: dict) -> list[list[str]]:
    rows = []
    for r in [*tr.get("size_sweep", []), *tr.get("block_sweep", [])]:
        gb_i, gb_d = r["size"] / r["inproc_s"] / 1e9, r["size"] / r["push_s"] / 1e9
        rows.append([_size(r["size"]), str(r["blocks"]), _size(r["block_len"]), f"{r['inproc_s'] * 1e3:.3f}",
                     f"{gb_i:.2f}", f"{r['push_s'] * 1e3:.3f}", f"{gb_d:.2f}", f"{gb_d / gb_i:.2f}"])
    return rows


TRANSFER_HEAD = ["size", "blocks", "block", "in-process ms", "GB/s", "daemon ms", "GB/s", "daemon/in-process"]


def _text_table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(head), *(line(r) for r in rows)])


def _md_table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def control_lines(tr: dict) -> list[str]:
    o = tr["one_block"]
    lines = [
        f"per-request control overhead: one {_size(o['block_len'])} block, SendReady -> SendDone at P and RecvDone at D: "
        f"{o['both_us']:.0f} us (P {o['send_done_us']:.0f}, D {o['recv_done_us']:.0f}); the same WRITE in-process: "
        f"{o['inproc_us']:.0f} us; overhead {o['overhead_us']:.0f} us",
        f"worker message round trip (Ping -> Pong through the daemon): {tr['rtt_us']:.1f} us; "
        f"idle DaemonClient.poll(): {tr['idle_poll_us']:.2f} us",
    ]
    if tr.get("idle_cpu_percent"):
        p, d = tr["idle_cpu_percent"]
        lines.append(f"idle daemon CPU ({tr['idle_window_s']:.0f} s, worker registered, after pushes): "
                     f"P {p:.2f}%, D {d:.2f}% of a core")
    if tr.get("idle_cpu_progress_thread"):
        i = tr["idle_cpu_progress_thread"]
        lines.append(f"idle daemon CPU, fresh daemon: NIXL progress thread off {i['off']:.2f}%, on {i['on']:.2f}% "
                     "of a core")
    if tr.get("worker_step"):
        w = tr["worker_step"]
        lines.append(f"worker cost per engine step (PushWorker.start_step(empty) + get_finished(), live daemon, "
                     f"nothing pending): {w['busy_step_us']:.2f} us")
    return lines


def transfer_tables(tr: dict) -> str:
    return "\n".join(["", "Transfer: daemon push vs in-process NIXL (post -> both sides notified, median)",
                      _text_table(TRANSFER_HEAD, transfer_rows(tr)), "", *control_lines(tr)])


# ---------------------------------------------------------------------------- serving


SERVING_HEAD = ["deployment", "prompts", "c", "TTFT p50 ms", "TTFT p90 ms", "TPOT p50 ms", "req/s", "CPU s/req",
                "= colocated c=1 (same c)", "foreign vLLM"]


def serving_rows(sv: dict) -> list[list[str]]:
    rows = []
    for a in sv["anchors"]:
        if "error" in a and not a.get("runs"):
            rows.append([a["anchor"], "-", "-", "failed", "", "", "", "", "", str(a.get("foreign_vllm_servers", "?"))])
            continue
        for r in a["runs"]:
            s = r["summary"]
            ok = s["n"] - s["failed"]
            same = "ref" if a["anchor"] == "colocated" and r["concurrency"] == 1 else (
                "n/a" if r["matches"] is None else f"{r['matches']}/{s['n']}")
            if r["concurrency"] != 1 and r.get("matches_same_c") is not None:
                same += f" ({'ref' if a['anchor'] == 'colocated' else r['matches_same_c']})"
            rows.append([a["anchor"], r["prompt_set"], str(r["concurrency"]), _f(s["ttft_p50_ms"]),
                         _f(s["ttft_p90_ms"]), _f(s["tpot_p50_ms"], ".2f"), _f(s["req_per_s"], ".2f"),
                         f"{r['cpu_s_per_req']:.2f}", same + ("" if ok == s["n"] else f" ({s['failed']} failed)"),
                         str(r.get("foreign_vllm_servers", "?"))])
    return rows


def timer_lines(sv: dict) -> list[str]:
    """Where pushsvc's requests spent their time, from the daemons' histograms."""
    lines = []
    for a in sv["anchors"]:
        for r in a.get("runs", []):
            t = r.get("daemon_timers_ms")
            if t:
                lines.append(f"{a['anchor']} {r['prompt_set']} c={r['concurrency']}: P blocks staged -> WRITE posted "
                             f"{_f(t.get('P:pushsvc_match_wait_seconds_mean_ms'))} ms, WRITE "
                             f"{_f(t.get('P:pushsvc_transfer_seconds_mean_ms'), '.2f')} ms, D registration -> KV in "
                             f"{_f(t.get('D:pushsvc_recv_seconds_mean_ms'))} ms (means)")
    return lines


def serving_table(sv: dict) -> str:
    return "\n".join(["", f"Serving ({sv.get('note', '')})", _text_table(SERVING_HEAD, serving_rows(sv)),
                      *timer_lines(sv)])


def _group(label: str) -> str:
    anchor, proc = label.split("/", 1)
    return f"{anchor}:{proc}"


def idle_rows(sv: dict) -> list[list[str]]:
    rows = []
    for a in sv["anchors"]:
        if "idle_cold_cpu_percent" not in a:
            continue
        warm = a.get("idle_cpu_percent")
        top = sorted((warm or a["idle_cold_cpu_percent"]).items(), key=lambda kv: -kv[1])
        rows.append([a["anchor"], f"{a['idle_cold_cpu_percent_total']:.1f}",
                     f"{a['idle_cpu_percent_total']:.1f}" if warm else "n/a",
                     ", ".join(f"{_group(k)} {v:.0f}" for k, v in top if v >= 1.0) or "-"])
    return rows


IDLE_HEAD = ["deployment", "idle before any request", "idle after warm-up", "largest (process: % of a core)"]


def idle_table(sv: dict) -> str:
    return "\n".join(["", f"Idle CPU of each deployment, % of one core ({sv.get('idle_window_s', 0):.0f} s windows)",
                      _text_table(IDLE_HEAD, idle_rows(sv))])


# ---------------------------------------------------------------------------- goals


def goals(res: dict) -> list[dict]:
    out = []
    sv = res.get("serving")
    if sv:
        runs = {(a["anchor"], r["prompt_set"], r["concurrency"]): r["summary"]["ttft_p50_ms"]
                for a in sv["anchors"] for r in a.get("runs", [])}
        for (anchor, pset, c), ours in sorted(runs.items()):
            if anchor != "pushsvc":
                continue
            # Against the best variant of each vLLM connector that ran (progress thread on or off).
            pull, push = (min((v for (a, ps, cc), v in runs.items() if a.startswith(prefix) and ps == pset
                               and cc == c and not math.isnan(v)), default=None)
                          for prefix in ("vllm-pull", "vllm-push"))
            col = runs.get(("colocated", pset, c))
            checks = []
            if pull is not None:
                checks.append(ours < pull)
            if push is not None:
                checks.append(ours < push)
            detail = f"pushsvc {ours:.1f} ms; best vLLM pull {_f(pull)} ms; best vLLM push {_f(push)} ms"
            out.append({"goal": f"TTFT p50 below both vLLM connectors ({pset}, c={c})",
                        "met": bool(checks) and all(checks) and len(checks) == 2, "detail": detail})
            if col is not None:
                out.append({"goal": f"TTFT p50 within {TTFT_VS_COLOCATED}x of colocated ({pset}, c={c})",
                            "met": ours <= TTFT_VS_COLOCATED * col,
                            "detail": f"pushsvc {ours:.1f} ms = {ours / col:.2f}x colocated {col:.1f} ms"})
    tr = res.get("transfer")
    if tr:
        big = [r for r in [*tr["size_sweep"], *tr.get("block_sweep", [])] if r["size"] >= PUSH_MIN_SIZE]
        ratios = [(r["inproc_s"] / r["push_s"], r) for r in big]
        if ratios:
            worst, r = min(ratios, key=lambda x: x[0])
            out.append({"goal": f"daemon push >= {PUSH_VS_INPROC:.0%} of in-process NIXL for transfers >= 16 MiB",
                        "met": worst >= PUSH_VS_INPROC,
                        "detail": f"worst {worst:.0%} ({_size(r['size'])} in {r['blocks']} blocks); all: "
                                  + ", ".join(f"{x:.0%}" for x, _ in ratios)})
        idle = []
        if tr.get("idle_cpu_percent"):
            idle += list(tr["idle_cpu_percent"])
        if tr.get("idle_cpu_progress_thread"):
            idle.append(tr["idle_cpu_progress_thread"]["off"])
        if idle:
            out.append({"goal": f"idle daemon < {IDLE_DAEMON_PERCENT:.0f}% of a core", "met": max(idle) < 1.0,
                        "detail": "max " + f"{max(idle):.2f}%"})
        if tr.get("worker_step"):
            us = tr["worker_step"]["busy_step_us"]
            out.append({"goal": f"worker-side cost per idle engine step < {WORKER_STEP_US:.0f} us",
                        "met": us < WORKER_STEP_US, "detail": f"{us:.2f} us"})
    return out


def goals_text(gs: list[dict]) -> str:
    return "\n".join(["", "Goals"] + [f"  [{'met' if g['met'] else 'NOT met'}] {g['goal']}: {g['detail']}"
                                      for g in gs])


# ---------------------------------------------------------------------------- markdown


def markdown(res: dict) -> str:
    parts = [f"Run {res.get('started', '')}, {res.get('elapsed_s', 0) / 60:.1f} min, host: {res.get('host', {})}"]
    sv = res.get("serving")
    if sv:
        parts += ["", f"### Serving ({sv.get('note', '')})", "", _md_table(SERVING_HEAD, serving_rows(sv)), "",
                  *[f"- {line}" for line in timer_lines(sv)],
                  "", "### Idle CPU per deployment", "", _md_table(IDLE_HEAD, idle_rows(sv))]
    tr = res.get("transfer")
    if tr:
        parts += ["", "### Transfer", "", _md_table(TRANSFER_HEAD, transfer_rows(tr)), "",
                  *[f"- {line}" for line in control_lines(tr)]]
    if res.get("goals"):
        parts += ["", "### Goals", ""] + [f"- **{'met' if g['met'] else 'not met'}**: {g['goal']} ({g['detail']})"
                                          for g in res["goals"]]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    src = Path(sys.argv[1])
    data = json.loads(src.read_text())
    data["goals"] = goals(data)
    if "transfer" in data:
        print(transfer_tables(data["transfer"]))
    if "serving" in data:
        print(serving_table(data["serving"]))
        print(idle_table(data["serving"]))
    print(goals_text(data["goals"]))
    (src.parent / "table.md").write_text(markdown(data))
