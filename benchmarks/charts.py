"""PNG charts of a results.json (matplotlib, no display needed).

    python benchmarks/charts.py bench-results/<run>/results.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

def _bytes_label(x: float, _pos: object = None) -> str:
    return f"{x / 2**20:g} MiB" if x >= 2**20 else f"{x / 2**10:g} KiB"


COLORS = {"colocated": "#888888", "vllm-pull": "#d62728", "vllm-push": "#ff7f0e", "vllm-pull-noprog": "#e377c2",
          "vllm-push-noprog": "#bcbd22", "pushsvc": "#1f77b4"}


def _runs(res: dict) -> tuple[list[str], list[tuple[str, int]], dict]:
    anchors = [a["anchor"] for a in res.get("serving", {}).get("anchors", []) if a.get("runs")]
    workloads: list[tuple[str, int]] = []
    table = {}
    for a in res.get("serving", {}).get("anchors", []):
        for r in a.get("runs", []):
            key = (r["prompt_set"], r["concurrency"])
            if key not in workloads:
                workloads.append(key)
            table[(a["anchor"], *key)] = r
    return anchors, workloads, table


def serving_chart(res: dict, out: Path) -> Path | None:
    anchors, workloads, table = _runs(res)
    if not table:
        return None
    panels = [("TTFT p50 (ms), bar; p90, tick", lambda r: r["summary"]["ttft_p50_ms"],
               lambda r: r["summary"]["ttft_p90_ms"], True),
              ("time per output token p50 (ms)", lambda r: r["summary"]["tpot_p50_ms"], None, True),
              ("requests / s", lambda r: r["summary"]["req_per_s"], None, False),
              ("CPU seconds per request (all processes)", lambda r: r["cpu_s_per_req"], None, False)]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    width = 0.8 / max(1, len(anchors))
    for ax, (title, value, upper, log) in zip(axes.flat, panels):
        for i, anchor in enumerate(anchors):
            xs, ys, tops = [], [], []
            for j, wl in enumerate(workloads):
                r = table.get((anchor, *wl))
                if r is None:
                    continue
                xs.append(j + (i - (len(anchors) - 1) / 2) * width)
                ys.append(value(r))
                tops.append(upper(r) if upper else None)
            ax.bar(xs, ys, width, label=anchor, color=COLORS.get(anchor))
            if upper:
                ax.scatter(xs, tops, marker="_", s=200, color="black", zorder=3)
        ax.set_xticks(range(len(workloads)), [f"{s} c={c}" for s, c in workloads])
        ax.set_title(title)
        if log:
            ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
    axes.flat[0].legend()
    fig.suptitle("Serving: tiny Llama, vLLM CPU 0.32, 2 cores (" + res.get("serving", {}).get("note", "") + ")")
    fig.tight_layout()
    path = out / "serving.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def idle_chart(res: dict, out: Path) -> Path | None:
    rows = [(a["anchor"], a.get("idle_cpu_percent") or a["idle_cold_cpu_percent"])
            for a in res.get("serving", {}).get("anchors", []) if "idle_cold_cpu_percent" in a]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(11, 4.5))
    labels = sorted({k.split("/", 1)[0] + "/" + k.split("/", 1)[1] for _, d in rows for k in d})
    bottom = [0.0] * len(rows)
    cmap = plt.get_cmap("tab20")
    for n, label in enumerate(labels):
        vals = [d.get(label, 0.0) for _, d in rows]
        if max(vals) < 0.5:
            continue
        ax.bar(range(len(rows)), vals, bottom=bottom, label=label, color=cmap(n % 20))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(rows)), [a for a, _ in rows], rotation=12, fontsize=8)
    ax.set_ylabel("% of one core")
    ax.set_title("CPU of each deployment while idle (after warm-up; before any request if warm-up failed)")
    ax.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path = out / "idle_cpu.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def transfer_chart(res: dict, out: Path) -> Path | None:
    tr = res.get("transfer")
    if not tr:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.5))
    rows = tr["size_sweep"]
    sizes = [r["size"] for r in rows]
    a1.plot(sizes, [r["size"] / r["inproc_s"] / 1e9 for r in rows], "o-", label="in-process NIXL", color="#888888")
    a1.plot(sizes, [r["size"] / r["push_s"] / 1e9 for r in rows], "o-", label="pushsvc daemon", color="#1f77b4")
    a1.set_xscale("log", base=2)
    a1.set_xticks(sizes, [_bytes_label(x) for x in sizes], fontsize=8)
    a1.set_xlabel(f"bytes per transfer ({rows[0]['block_len'] >> 10} KiB blocks: "
                  f"{rows[0]['blocks']}..{rows[-1]['blocks']} blocks)")
    a1.set_ylabel("GB/s (post -> both sides notified)")
    a1.set_title("DRAM->DRAM WRITE between two processes")
    a1.legend()
    a1.grid(alpha=0.3)
    rows = tr.get("block_sweep", [])
    if rows:
        blocks = [r["blocks"] for r in rows]
        a2.plot(blocks, [r["size"] / r["inproc_s"] / 1e9 for r in rows], "o-", label="in-process NIXL",
                color="#888888")
        a2.plot(blocks, [r["size"] / r["push_s"] / 1e9 for r in rows], "o-", label="pushsvc daemon",
                color="#1f77b4")
        a2.set_xscale("log", base=2)
        a2.set_xticks(blocks, [str(b) for b in blocks])
        a2.set_xlabel(f"blocks per transfer ({rows[0]['size'] >> 20} MiB total)")
        a2.set_ylabel("GB/s")
        a2.set_title("Same bytes, more descriptors")
        a2.legend()
        a2.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "transfer.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(res: dict, out: Path) -> list[Path]:
    return [p for p in (serving_chart(res, out), idle_chart(res, out), transfer_chart(res, out)) if p]


if __name__ == "__main__":
    src = Path(sys.argv[1])
    for p in write_all(json.loads(src.read_text()), src.parent):
        print(p)
