"""Where a P/D request's time to first token goes, from the three timelines of one host:
the proxy's (``request_timeline`` log events, side ``proxy``) and P's and D's daemons'
(``/v1/requests``). Joined on the request id the proxy sent as ``X-Request-Id``, which vLLM
builds its own request ids from (``cmpl-<id>-0``, with a suffix of its own at times).

Phases, in path order (milliseconds):

* ``p_queue_prefill``: the proxy got the request -> P's prefill ended: P's worker handed
  its blocks to its daemon (``send_ready``), or, with layer-wise push, the request's last
  layer was saved (``prefill_done``). P's queue and prefill, and the proxy's forwarding.
* ``transfer``: the prefill's end -> P's WRITE settled (a wait for D's registration
  included; with layer-wise push only what was left after the last layer).
* ``d_notified``: WRITE settled -> D's worker got ``RecvDone`` (completion notification, D's
  landing copy on a GPU, the daemon's final event).
* ``d_reported``: ``RecvDone`` -> D's connector handed the request to vLLM as
  ``finished_recving`` (its ``Reported``, worker protocol 1.4): the rest of the engine
  step in which the event arrived.
* ``d_first_step``: that moment -> D's first bytes at the proxy: D's scheduler taking the
  request, its first step, the API server (from ``RecvDone`` where the connector did not
  report).
* ``proxy_out``: D's first bytes -> the first chunk sent to the client.

And two totals: ``after_prefill`` (the prefill's end -> the first chunk sent: what P/D
adds to P's prefill, TTFT - ``p_queue_prefill``) and ``ttft`` (the proxy got the request
-> the first chunk sent).
"""

from __future__ import annotations

import json
import statistics
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

# phase -> (from moment, to moment), the moments as ``attribute`` names them
_SPANS = {"p_queue_prefill": ("arrival", "prefill_end"), "transfer": ("prefill_end", "write_settled"),
          "d_notified": ("write_settled", "recv_done"), "d_reported": ("recv_done", "reported"),
          "d_first_step": ("reported", "first_bytes"), "proxy_out": ("first_bytes", "sent"),
          "after_prefill": ("prefill_end", "sent"), "ttft": ("arrival", "sent")}
TOTALS = ("after_prefill", "ttft")
PHASES = tuple(k for k in _SPANS if k not in TOTALS)  # one after the other, from arrival to the first chunk


def _at(line: dict, event: str) -> float | None:
    """Wall-clock seconds of ``event`` in a timeline (None if it has no such event)."""
    ms = line.get("events_ms", {}).get(event)
    return None if ms is None else datetime.fromisoformat(line["start"]).timestamp() + ms / 1e3


def _owner(vllm_id: str, request_ids: set[str]) -> str | None:
    """The X-Request-Id a vLLM request id was built from."""
    for rid in request_ids:
        if f"-{rid}-" in vllm_id or vllm_id.endswith(f"-{rid}"):
            return rid
    return None


def _joined(proxy: list[dict], p: list[dict], d: list[dict]) -> Iterator[tuple[str, dict, dict, dict]]:
    """Each proxy request that both daemons have a timeline of: (request id, the proxy's
    line, P's send timeline, D's recv timeline)."""
    by_rid = {line["request_id"]: line for line in proxy if line.get("side") == "proxy"}
    ids = set(by_rid)
    sends = {_owner(t["request_id"], ids): t for t in p if t.get("side") == "send"}
    recvs = {_owner(t["request_id"], ids): t for t in d if t.get("side") == "recv"}
    for rid, line in by_rid.items():
        send, recv = sends.get(rid), recvs.get(rid)
        if send is not None and recv is not None:
            yield rid, line, send, recv


def attribute(proxy: list[dict], p: list[dict], d: list[dict]) -> dict[str, dict[str, float]]:
    """Per request id: each phase in ms (phases a request lacks the moments for are left out)."""
    out: dict[str, dict[str, float]] = {}
    for rid, line, send, recv in _joined(proxy, p, d):
        t = {
            "arrival": datetime.fromisoformat(line["start"]).timestamp(),
            "prefill_end": _at(send, "prefill_done") or _at(send, "send_ready"),
            "write_settled": _at(send, "write_settled"),
            "recv_done": _at(recv, "recv_done"),
            "reported": _at(recv, "finished_recving") or _at(recv, "recv_done"),
            "first_bytes": _at(line, "decode_first_chunk"),
            "sent": _at(line, "first_chunk_sent") or _at(line, "decode_first_chunk"),
        }
        out[rid] = {name: round((t[b] - t[a]) * 1e3, 3) for name, (a, b) in _SPANS.items()
                    if t[a] is not None and t[b] is not None}
    return out


def medians(per_request: dict[str, dict[str, float]]) -> dict[str, float]:
    """p50 of each phase over the requests that have it, and how many requests joined."""
    out: dict[str, float] = {"requests": len(per_request)}
    for phase in (*PHASES, *TOTALS):
        values = [v[phase] for v in per_request.values() if phase in v]
        if values:
            out[phase] = round(statistics.median(values), 3)
    return out


def tail_excess(per_request: dict[str, dict[str, float]], share: float = 0.125) -> dict[str, float]:
    """Where the slowest requests' extra time goes: over the slowest ``share`` of the
    requests by ``ttft`` (at least one), the mean excess of each phase, and of ``ttft``
    itself, over that phase's median (ms). The phase with the largest excess owns the
    TTFT's tail (with 16 requests, the two beyond the p90)."""
    timed = sorted((v for v in per_request.values() if "ttft" in v), key=lambda v: v["ttft"], reverse=True)
    if not timed:
        return {}
    slow, mid = timed[: max(1, round(len(timed) * share))], medians(per_request)
    out: dict[str, float] = {}
    for phase in (*PHASES, "ttft"):
        excess = [v[phase] - mid[phase] for v in slow if phase in v and phase in mid]
        if excess:
            out[phase] = round(statistics.fmean(excess), 3)
    return out


def tail_owner(excess: dict[str, float]) -> tuple[str, float] | None:
    """The phase of ``tail_excess`` with the largest excess, and that excess."""
    phases = {k: v for k, v in excess.items() if k != "ttft"}
    return max(phases.items(), key=lambda kv: kv[1]) if phases else None


def event_gaps(proxy: list[dict], p: list[dict], d: list[dict]) -> dict[str, list[float]]:
    """Where the path between the two daemons goes, event by event: each request's P
    (send side) and D (recv side) timelines merged in time order (one host, one clock), and
    for every two events that follow one another there, the gap in ms, per request that
    has them. Which events follow which varies between requests (D may hear
    ``write_announced`` before or after P's ``write_posted``): each order is its own entry."""
    out: dict[str, list[float]] = {}
    for _rid, _line, send, recv in _joined(proxy, p, d):
        events = sorted([(_at(send, e), f"p.{e}") for e in send.get("events_ms", {})]
                        + [(_at(recv, e), f"d.{e}") for e in recv.get("events_ms", {})])
        for (ta, a), (tb, b) in zip(events, events[1:]):
            out.setdefault(f"{a} -> {b}", []).append(round((tb - ta) * 1e3, 3))
    return out


def proxy_timelines(log_path: Path) -> list[dict]:
    """The proxy's ``request_timeline`` events from its JSON log."""
    out = []
    for raw in log_path.read_text(errors="replace").splitlines():
        if '"request_timeline"' not in raw:
            continue
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if line.get("event") == "request_timeline":
            out.append(line)
    return out


def daemon_timelines(base_url: str, limit: int) -> list[dict]:
    with urllib.request.urlopen(f"{base_url}/v1/requests?limit={limit}", timeout=10) as r:
        doc = json.loads(r.read())
    return doc["timelines"]
