"""What the daemons of a benchmark run say about it: histogram sums, the hot progress
passes, each request's path from their debug logs and from their request timelines
(``/v1/requests``). Readers of ``procs.DaemonProc`` daemons; no I/O beyond theirs."""

from __future__ import annotations

import json
import statistics


def hist(daemon, name: str) -> tuple[float, float]:
    return daemon.metric(f"{name}_sum"), daemon.metric(f"{name}_count")


PHASES = (("prefill", "send_ready"), ("prefill", "write_posted"), ("decode", "write_announced"),
           ("decode", "part_landed"), ("decode", "completion"), ("decode", "copies_done"), ("decode", "recv_done"),
           ("prefill", "write_settled"))


def phases(p_log: str, d_log: str) -> dict[str, dict[str, float]]:
    """Per request, ms from P's ``send_ready`` to each daemon event (debug logs, one
    host's wall clock): where the time of a push goes. ``part_landed`` is the last part."""
    from datetime import datetime

    seen: dict[str, dict[str, float]] = {}
    for side, text in (("prefill", p_log), ("decode", d_log)):
        for line in text.splitlines():
            if not line.startswith("{"):
                continue
            e = json.loads(line)
            if (side, e.get("event")) in PHASES and "request_id" in e:
                seen.setdefault(e["request_id"], {})[e["event"]] = datetime.fromisoformat(e["timestamp"]).timestamp()
    out = {}
    for rid, ev in seen.items():
        if "send_ready" in ev:
            out[rid] = {k: round((v - ev["send_ready"]) * 1e3, 3) for k, v in ev.items()}
    return out


def hot_passes(daemon) -> dict[str, float]:
    """The daemon's hot progress passes so far (``pushsvc_progress_pass_seconds``): how
    many, and how many held its loop over 0.5 ms and over 2.5 ms."""
    name = "pushsvc_progress_pass_seconds"
    total = daemon.metric(f"{name}_count", pace="hot")
    return {"passes": total,
            "over_0.5ms": total - daemon.metric(f"{name}_bucket", pace="hot", le="0.0005"),
            "over_2.5ms": total - daemon.metric(f"{name}_bucket", pace="hot", le="0.0025")}


def timeline_medians(p_daemon, d_daemon, rids: list[str], origin: str = "P send_ready") -> dict[str, float]:
    """Median ms from ``origin`` (P's ``send_ready``, or another event of either side) to
    every event of both daemons' request timelines (``/v1/requests``, kept whatever the log
    level) for ``rids``: where a push's time goes. Both daemons run on this host, so their
    wall clocks agree to a few microseconds."""
    from datetime import datetime

    want, at = set(rids), {}
    for side, daemon in (("P", p_daemon), ("D", d_daemon)):
        status, body = daemon.get(f"/v1/requests?limit={min(10000, 2 * len(rids) + 100)}")
        if status != 200:
            raise RuntimeError(f"{side}'s /v1/requests answered {status}")
        for t in json.loads(body)["timelines"]:
            if t["request_id"] in want:
                start = datetime.fromisoformat(t["start"]).timestamp() * 1e3
                for name, ms in t["events_ms"].items():
                    at.setdefault(t["request_id"], {})[f"{side} {name}"] = start + ms
    offsets: dict[str, list[float]] = {}
    for events in at.values():
        if origin in events:
            for name, t in events.items():
                offsets.setdefault(name, []).append(t - events[origin])
    return dict(sorted(((k, round(statistics.median(v), 3)) for k, v in offsets.items()), key=lambda kv: kv[1]))
