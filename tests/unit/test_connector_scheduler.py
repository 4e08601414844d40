"""PushScheduler: the connector's scheduler-side bookkeeping, driven like vLLM drives it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import pytest

from pushsvc_connector.scheduler import PushScheduler


class Status(enum.Enum):
    RUNNING = 1
    FINISHED_LENGTH_CAPPED = 2
    FINISHED_STOPPED = 3
    FINISHED_ABORTED = 4


@dataclass
class Req:
    """The attributes of vllm.v1.request.Request that the scheduler side reads."""

    request_id: str
    kv_transfer_params: dict | None
    prompt_token_ids: list[int] = field(default_factory=lambda: list(range(300)))
    status: Status = Status.RUNNING


@dataclass
class Blocks:
    groups: list[list[int]]

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return self.groups


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def d_params(**extra) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill",
            "remote_host": "10.0.0.1", "remote_port": 8472, "remote_tp_size": 1, **extra}


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def sched(clock: Clock) -> PushScheduler:
    return PushScheduler(watchdog_s=30.0, lease_s=20.0, clock=clock)


def test_d_reserves_uncomputed_prompt_tokens_as_async(sched):
    req = Req("d1", d_params())
    assert sched.get_num_new_matched_tokens(req, 0) == (300, True)
    assert sched.get_num_new_matched_tokens(req, 128) == (172, True)  # prefix hit on D
    assert sched.get_num_new_matched_tokens(req, 300) == (0, False)
    assert sched.get_num_new_matched_tokens(Req("x", None), 0) == (0, False)
    assert sched.get_num_new_matched_tokens(Req("p", {"do_remote_decode": True}), 0) == (0, False)


def test_d_registration_is_shipped_once_with_ps_coordinates(sched):
    req = Req("d1", d_params(tp_size=1))
    sched.update_state_after_alloc(req, Blocks([[7, 3, 9]]), 300)
    assert sched.has_pending_push_work()
    meta = sched.build_connector_meta(1)
    reg = meta.recvs["d1"]
    assert reg.local_block_ids == [[7, 3, 9]] and reg.remote_engine_id == "prefill"
    assert (reg.remote_host, reg.remote_port, reg.remote_tp_size) == ("10.0.0.1", 8472, 1)
    # The second call after the load completes must not register again.
    sched.update_state_after_alloc(req, Blocks([[11]]), 0)
    assert sched.build_connector_meta(1).recvs == {}
    assert req.kv_transfer_params["do_remote_prefill"] is False


def test_full_prefix_hit_registers_nothing(sched):
    req = Req("d1", d_params())
    sched.update_state_after_alloc(req, Blocks([[]]), 0)
    assert sched.build_connector_meta(1).empty
    assert not sched.has_pending_push_work()


def test_d_watchdog_backstop_expires_and_completion_disarms(sched, clock):
    for rid in ("late", "ok"):
        sched.update_state_after_alloc(Req(rid, d_params()), Blocks([[1]]), 10)
    sched.build_connector_meta(1)
    sched.update_connector_output(None, {"ok"})
    clock.now += 30.0
    meta = sched.build_connector_meta(0)
    assert meta.expired_recvs == ["late"] and meta.idle
    assert sched.build_connector_meta(0).expired_recvs == []


def test_p_finished_prefill_holds_blocks_under_lease(sched, clock):
    req = Req("p1", {"do_remote_decode": True, "do_remote_prefill": False}, status=Status.FINISHED_LENGTH_CAPPED)
    delay, params = sched.request_finished(req, [4, 5, 6])  # vLLM passes one flat list for one group
    assert delay is True and params["transfer_mode"] == "push"
    assert sched.has_pending_push_work()
    meta = sched.build_connector_meta(0)
    assert meta.sends == {"p1": [[4, 5, 6]]}
    assert sched.has_pending_push_work()  # until the worker reports the push done
    sched.update_connector_output({"p1"}, None)
    assert not sched.has_pending_push_work()


def test_p_lease_backstop(sched, clock):
    req = Req("p1", {"do_remote_decode": True}, status=Status.FINISHED_STOPPED)
    sched.request_finished(req, [[1, 2]])
    sched.build_connector_meta(1)
    clock.now += 20.0
    assert sched.build_connector_meta(1).expired_sends == ["p1"]
    assert not sched.has_pending_push_work()


def test_p_aborted_or_empty_requests_do_not_hold_blocks(sched):
    aborted = Req("p1", {"do_remote_decode": True}, status=Status.FINISHED_ABORTED)
    assert sched.request_finished(aborted, [1, 2]) == (False, None)
    empty = Req("p2", {"do_remote_decode": True}, status=Status.FINISHED_LENGTH_CAPPED)
    assert sched.request_finished(empty, []) == (False, None)
    assert not sched.has_pending_push_work()


def test_d_aborted_before_its_registration_shipped_is_released_at_once(sched):
    req = Req("d1", d_params())
    sched.update_state_after_alloc(req, Blocks([[1, 2]]), 256)
    req.status = Status.FINISHED_ABORTED
    assert sched.request_finished(req, [1, 2]) == (False, None)
    meta = sched.build_connector_meta(1)
    assert meta.recvs == {} and meta.dropped_recvs == ["d1"] and meta.evictions == []


def test_d_aborted_while_receiving_is_evicted_through_the_daemon(sched):
    req = Req("d1", d_params())
    sched.update_state_after_alloc(req, Blocks([[1, 2]]), 256)
    sched.build_connector_meta(1)
    req.status = Status.FINISHED_ABORTED
    assert sched.request_finished(req, [1, 2]) == (False, None)  # vLLM holds the blocks
    meta = sched.build_connector_meta(1)
    assert meta.evictions == ["d1"]
    assert meta.expired_recvs == []  # the watchdog is disarmed: the daemon reports it


def test_metadata_is_empty_when_nothing_happened(sched):
    meta = sched.build_connector_meta(3)
    assert meta.empty and not meta.idle


def test_p_returns_its_daemons_coordinates(clock):
    coords = {"remote_engine_id": "prefill", "remote_host": "127.0.0.1", "remote_port": 8472, "remote_tp_size": 1}
    sched = PushScheduler(watchdog_s=30.0, lease_s=20.0, clock=clock, coordinates=lambda: coords)
    req = Req("p1", {"do_remote_decode": True}, status=Status.FINISHED_LENGTH_CAPPED)
    delay, params = sched.request_finished(req, [1])
    assert delay and {k: params[k] for k in coords} == coords


def test_d_never_scheduled_sends_an_empty_registration_that_releases_p(sched):
    req = Req("d1", d_params(), status=Status.FINISHED_ABORTED)
    assert sched.request_finished(req, []) == (False, None)
    meta = sched.build_connector_meta(1)
    assert meta.recvs == {} and meta.dropped_recvs == []  # vLLM waits for nothing
    [release] = meta.releases
    assert release.request_id == "d1" and release.local_block_ids == []
    assert (release.remote_engine_id, release.remote_port) == ("prefill", 8472)
