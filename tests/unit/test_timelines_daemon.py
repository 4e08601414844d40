"""Request timelines through two real daemons (fake engine): what /v1/requests, the
phase histogram and the log show for pushes that finish and for ones that fail."""

from __future__ import annotations

import time

import pytest
from daemon_fixtures import http_get, metric, push_pair, wait_until

from pushsvc.protocol import worker as wp


def _names(timeline: dict) -> list[str]:
    events = timeline["events_ms"]
    names = sorted(events, key=lambda n: events[n])
    assert list(events) == names, f"events out of time order: {events}"
    return names


async def _timelines(daemon, query: str = "") -> list[dict]:
    status, body = await http_get(daemon, "/v1/requests" + query)
    assert status == 200, body
    return body["timelines"]


@pytest.mark.asyncio
async def test_a_push_leaves_one_timeline_per_side_joined_by_request_id() -> None:
    async with push_pair() as pair:
        pair.register_recv("d-req", [3, 4])  # D first: P's blocks then match at once
        await wait_until(lambda: metric(pair.p, "pushsvc_notifications_total", kind="push_reg") == 1, "PUSH_REG at P")
        pair.send_ready("d-req", [0, 1])
        await pair.dw.wait_for(wp.RecvDone, "d-req")
        await pair.pw.wait_for(wp.SendDone, "d-req")
        [p_line] = await _timelines(pair.p)
        [d_line] = await _timelines(pair.d)
        assert p_line["side"] == "send" and p_line["outcome"] == "send_done"
        assert _names(p_line) == ["send_ready", "matched", "write_planned", "write_posted", "write_settled", "send_done"]
        assert p_line["peer_request_id"] == "d-req"
        assert d_line["side"] == "recv" and d_line["outcome"] == "recv_done"
        # P's WriteStarted races its completion notification (side channel against NIXL):
        # D marks write_announced only when the announcement came first.
        names = _names(d_line)
        assert names in (["registered", "push_reg_sent", "completion", "recv_done"],
                         ["registered", "push_reg_sent", "write_announced", "completion", "recv_done"]), names
        assert d_line["events_ms"]["registered"] == 0.0 and d_line["start"].endswith("+00:00")
        for daemon, side, phases in ((pair.p, "send", ("matched", "write_planned", "write_posted", "write_settled", "send_done")),
                                     (pair.d, "recv", ("push_reg_sent", "completion", "recv_done"))):
            for phase in (*phases, "total"):
                assert metric(daemon, "pushsvc_phase_seconds_count", side=side, phase=phase) == 1, (side, phase)
            _, info = await http_get(daemon, "/v1/info")
            assert info["open_timelines"] == 0
        # Filtered by either side's id; bounded by limit.
        assert [t["side"] for t in await _timelines(pair.p, "?request_id=d-req")] == ["send"]
        assert await _timelines(pair.d, "?request_id=nope") == []


@pytest.mark.asyncio
async def test_failed_and_withdrawn_requests_end_their_timelines_and_refused_ones_open_none() -> None:
    async with push_pair() as pair:
        pair.register_recv("gone", [5])
        await wait_until(lambda: metric(pair.p, "pushsvc_notifications_total", kind="push_reg") == 1, "PUSH_REG at P")
        pair.dw.send(wp.Evict(request_ids=["gone"]))  # withdrawn before P's blocks came
        await pair.dw.wait_for(wp.RecvFailed, "gone")
        pair.pw.send(wp.SendReady(request_id="lonely", block_ids=[[2]]))
        pair.pw.send(wp.Evict(request_ids=["lonely"]))
        await pair.pw.wait_for(wp.SendFailed, "lonely")
        pair.register_recv("bad", [10_000])  # outside D's layout: refused, never tracked
        await pair.dw.wait_for(wp.RecvFailed, "bad")
        [d_line] = await _timelines(pair.d)
        assert d_line["request_id"] == "gone" and d_line["outcome"] == "recv_failed"
        assert _names(d_line)[0] == "registered" and _names(d_line)[-1] == "recv_failed"
        [p_line] = await _timelines(pair.p)
        assert p_line["request_id"] == "lonely" and _names(p_line) == ["send_ready", "send_failed"]
        assert metric(pair.d, "pushsvc_phase_seconds_count", side="recv", phase="total") == 1
        assert pair.d.service.timelines.open_count == 0 and pair.p.service.timelines.open_count == 0


@pytest.mark.asyncio
async def test_requests_endpoint_checks_its_query_and_keeps_what_the_config_says() -> None:
    async with push_pair(d_config={"timelines_kept": 2}) as pair:
        for i in range(4):
            pair.register_recv(f"r{i}", [i])
            pair.dw.send(wp.Evict(request_ids=[f"r{i}"]))
            await pair.dw.wait_for(wp.RecvFailed, f"r{i}")
        assert [t["request_id"] for t in await _timelines(pair.d)] == ["r3", "r2"]
        assert [t["request_id"] for t in await _timelines(pair.d, "?limit=1")] == ["r3"]
        for bad in ("?limit=0", "?limit=x", "?limit=10001"):
            status, body = await http_get(pair.d, "/v1/requests" + bad)
            assert status == 400 and "limit" in body["error"], bad
        assert metric(pair.d, "pushsvc_phase_seconds_count", side="recv", phase="total") == 4


@pytest.mark.asyncio
async def test_the_workers_report_to_vllm_is_the_last_moment_and_a_phase_of_its_own() -> None:
    """``Reported`` (worker protocol 1.4): the moment the connector handed the request to
    vLLM as finished ends each side's timeline; a repeat, an unknown id or an implausible
    time changes nothing it should not."""
    async with push_pair() as pair:
        pair.register_recv("d-req", [3, 4])
        await wait_until(lambda: metric(pair.p, "pushsvc_notifications_total", kind="push_reg") == 1, "PUSH_REG at P")
        pair.send_ready("d-req", [0, 1])
        await pair.dw.wait_for(wp.RecvDone, "d-req")
        await pair.pw.wait_for(wp.SendDone, "d-req")
        pair.dw.send(wp.Reported(recving=["d-req", "unknown"], at=time.monotonic()))
        pair.pw.send(wp.Reported(sending=["d-req"], at=0.0))  # before the final: taken as the final's time
        def reported() -> bool:
            return (metric(pair.d, "pushsvc_phase_seconds_count", side="recv", phase="finished_recving") == 1
                    and metric(pair.p, "pushsvc_phase_seconds_count", side="send", phase="finished_sending") == 1)
        await wait_until(reported, "both reports")
        [d_line] = await _timelines(pair.d)
        assert _names(d_line)[-2:] == ["recv_done", "finished_recving"] and d_line["outcome"] == "recv_done"
        [p_line] = await _timelines(pair.p)
        assert _names(p_line)[-1] == "finished_sending"
        assert p_line["events_ms"]["finished_sending"] == p_line["events_ms"]["send_done"]
        # Again, and from the future: the first report stands, nothing observed twice.
        pair.dw.send(wp.Reported(recving=["d-req"], at=time.monotonic() + 3600))
        await pair.dw.ping(7)
        assert metric(pair.d, "pushsvc_phase_seconds_count", side="recv", phase="finished_recving") == 1
        [again] = await _timelines(pair.d)
        assert again["events_ms"] == d_line["events_ms"]
        assert metric(pair.d, "pushsvc_malformed_total", source="worker", reason="decode") == 0


@pytest.mark.asyncio
async def test_a_report_from_the_future_is_taken_as_now() -> None:
    async with push_pair() as pair:
        pair.register_recv("gone", [5])
        pair.dw.send(wp.Evict(request_ids=["gone"]))
        await pair.dw.wait_for(wp.RecvFailed, "gone")
        pair.dw.send(wp.Reported(recving=["gone"], at=time.monotonic() + 3600))
        await wait_until(lambda: metric(pair.d, "pushsvc_phase_seconds_count", side="recv",
                                        phase="finished_recving") == 1, "the report")
        [line] = await _timelines(pair.d)
        assert line["events_ms"]["finished_recving"] - line["events_ms"]["recv_failed"] < 60_000
