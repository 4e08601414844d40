"""The TTFT attribution of ``make bench`` (benchmarks/attribution.py): the three timelines
of one request joined on the proxy's request id, whatever vLLM adds around it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import attribution  # noqa: E402

START = "2026-12-01T12:00:00+00:00"


def _proxy(rid: str, **ms: float) -> dict:
    return {"event": "request_timeline", "side": "proxy", "request_id": rid, "start": START, "events_ms": ms}


def _daemon(rid: str, side: str, start_ms: float, **ms: float) -> dict:
    start = f"2026-12-01T12:00:00.{int(start_ms * 1000):06d}+00:00"
    return {"request_id": rid, "side": side, "start": start, "events_ms": ms}


def test_phases_follow_one_request_across_the_three_timelines() -> None:
    proxy = [_proxy("run-p1", prefill_answered=40, decode_first_chunk=70, first_chunk_sent=71, done=90),
             _proxy("run-p10", prefill_answered=10, decode_first_chunk=30, first_chunk_sent=31, done=40)]
    p = [_daemon("cmpl-run-p10-0-1a2b3c4d", "send", 5, send_ready=0, matched=0.5, write_settled=3),
         _daemon("cmpl-run-p1-0", "send", 30, send_ready=0, matched=1, write_settled=4)]
    d = [_daemon("cmpl-run-p1-0", "recv", 2, registered=0, recv_done=34),
         _daemon("cmpl-run-p10-0-9f8e7d6c", "recv", 1, registered=0, recv_done=10, finished_recving=12)]
    got = attribution.attribute(proxy, p, d)
    # run-p1's connector did not report (an older daemon): D's first step counts from RecvDone.
    assert got["run-p1"] == {"p_queue_prefill": 30.0, "transfer": 4.0, "d_notified": 2.0, "d_reported": 0.0,
                             "d_first_step": 34.0, "proxy_out": 1.0, "after_prefill": 41.0, "ttft": 71.0}
    assert got["run-p10"]["p_queue_prefill"] == 5.0
    assert (got["run-p10"]["d_reported"], got["run-p10"]["d_first_step"]) == (2.0, 17.0)
    assert attribution.medians(got)["requests"] == 2 and attribution.medians(got)["ttft"] == 51.0


def test_a_request_without_all_three_sides_or_moments_is_left_out_or_partial() -> None:
    proxy = [_proxy("a", decode_first_chunk=20, done=21), _proxy("b", decode_first_chunk=5, done=6)]
    p = [_daemon("cmpl-a-0", "send", 1, send_ready=0, send_failed=2)]  # no WRITE settled
    d = [_daemon("cmpl-a-0", "recv", 0, registered=0, recv_failed=3)]
    got = attribution.attribute(proxy, p, d)
    assert set(got) == {"a"}  # b has no daemon side
    assert got["a"] == {"p_queue_prefill": 1.0, "proxy_out": 0.0, "after_prefill": 19.0, "ttft": 20.0}


def test_with_layer_wise_push_the_prefill_ends_at_its_last_layer() -> None:
    """``prefill_done`` (every layer saved) ends P's prefill, not the step's start
    (``send_start``), and the transfer counts only what was left after it."""
    proxy = [_proxy("lw", decode_first_chunk=60, first_chunk_sent=61)]
    p = [_daemon("cmpl-lw-0", "send", 10, send_start=0, matched=1, write_posted=2, prefill_done=40,
                 write_settled=41.5)]
    d = [_daemon("cmpl-lw-0", "recv", 5, registered=0, recv_done=47)]
    got = attribution.attribute(proxy, p, d)["lw"]
    assert (got["p_queue_prefill"], got["transfer"], got["after_prefill"]) == (50.0, 1.5, 11.0)


def test_the_proxy_log_is_read_for_its_timelines_only(tmp_path) -> None:
    log = tmp_path / "proxy.log"
    log.write_text("\n".join([json.dumps({"event": "proxy_started"}), "not json request_timeline",
                              json.dumps(_proxy("x", done=1)), ""]))
    assert [line["request_id"] for line in attribution.proxy_timelines(log)] == ["x"]


def test_event_gaps_merge_both_daemons_timelines_in_time_order() -> None:
    """P's and D's events of one request, in the order they happened on the host's clock:
    D hearing ``WriteStarted`` before or after P's post makes two different steps."""
    proxy = [_proxy("x", decode_first_chunk=30), _proxy("y", decode_first_chunk=30), _proxy("z", done=1)]
    p = [_daemon("cmpl-x-0", "send", 10, send_ready=0, write_posted=1, write_settled=4),
         _daemon("cmpl-y-0", "send", 10, send_ready=0, write_posted=2, write_settled=3)]
    d = [_daemon("cmpl-x-0", "recv", 0, registered=0, write_announced=12, recv_done=15),
         _daemon("cmpl-y-0", "recv", 0, registered=0, write_announced=11, recv_done=14)]
    got = attribution.event_gaps(proxy, p, d)
    assert got["d.registered -> p.send_ready"] == [10.0, 10.0]
    assert got["p.send_ready -> p.write_posted"] == [1.0]  # x: P posted, then D heard of it
    assert got["p.write_posted -> d.write_announced"] == [1.0]
    assert got["d.write_announced -> p.write_settled"] == [2.0]
    assert got["p.send_ready -> d.write_announced"] == [1.0]  # y: D heard of it first
    assert got["d.write_announced -> p.write_posted"] == [1.0]
    assert got["p.write_settled -> d.recv_done"] == [1.0, 1.0]
    assert sum(len(v) for v in got.values()) == 10  # five steps each for x and y; z has no daemon side


def test_the_tail_is_the_slowest_eighths_excess_over_each_phases_median() -> None:
    """Sixteen requests: fourteen alike, two slow ones whose extra time is all in D's first
    step; the tail owner is that phase, with the slow two's mean excess."""
    per_request = {f"r{i}": {"p_queue_prefill": 20.0, "transfer": 3.0, "d_first_step": 8.0, "ttft": 31.0}
                   for i in range(14)}
    per_request["slow1"] = {"p_queue_prefill": 20.0, "transfer": 3.0, "d_first_step": 48.0, "ttft": 71.0}
    per_request["slow2"] = {"p_queue_prefill": 21.0, "transfer": 3.0, "d_first_step": 88.0, "ttft": 112.0}
    tail = attribution.tail_excess(per_request)
    assert tail == {"p_queue_prefill": 0.5, "transfer": 0.0, "d_first_step": 60.0, "ttft": 60.5}
    assert attribution.tail_owner(tail) == ("d_first_step", 60.0)
    # One request is its own tail (at least one), with no excess; nothing timed, no tail.
    assert attribution.tail_excess({"a": {"transfer": 2.0, "ttft": 9.0}}) == {"transfer": 0.0, "ttft": 0.0}
    assert attribution.tail_excess({"a": {"transfer": 2.0}}) == {} and attribution.tail_owner({}) is None
