"""PushScheduler: the connector's scheduler-side bookkeeping, driven like vLLM drives it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pushsvc.protocol import worker as wp
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


def test_nothing_to_load_registers_nothing_and_releases_p_once(sched):
    # vLLM allocates with no external tokens when D's prefix hit leaves nothing to load,
    # or when it loads nothing for the request (``skip_reading_prefix_cache``, a local
    # hit it keeps instead). P holds its blocks for the exchange all the same: the empty
    # registration frees them now instead of at P's lease.
    req = Req("d1", d_params(transfer_id="xchg-3"))
    sched.update_state_after_alloc(req, Blocks([[]]), 0)
    meta = sched.build_connector_meta(1)
    assert meta.recvs == {} and meta.dropped_recvs == []
    [release] = meta.releases
    assert (release.request_id, release.local_block_ids, release.match_key) == ("d1", [], "xchg-3")
    assert not sched.has_pending_push_work()  # nobody on D waits for its answer
    sched.update_state_after_alloc(req, Blocks([[4]]), 0)  # scheduled again after a preemption
    req.status = Status.FINISHED_STOPPED
    assert sched.request_finished(req, [4]) == (False, None)
    assert sched.build_connector_meta(1).empty


def test_d_watchdog_backstop_expires_and_completion_disarms(sched, clock):
    for rid in ("late", "ok"):
        sched.update_state_after_alloc(Req(rid, d_params()), Blocks([[1]]), 10)
    sched.build_connector_meta(1)
    sched.update_connector_output(None, {"ok"})
    clock.now += 30.0
    meta = sched.build_connector_meta(0)
    assert meta.expired_recvs == ["late"] and meta.idle
    assert sched.build_connector_meta(0).expired_recvs == []
    assert sched.take_stats().count("backstop_expiries", "recv") == 1


def test_p_finished_prefill_holds_blocks_under_lease(sched, clock):
    req = Req("p1", {"do_remote_decode": True, "do_remote_prefill": False}, status=Status.FINISHED_LENGTH_CAPPED)
    delay, params = sched.request_finished(req, [4, 5, 6])  # vLLM passes one flat list for one group
    assert delay is True and params["transfer_mode"] == "push"
    assert sched.has_pending_push_work()
    meta = sched.build_connector_meta(0)
    assert list(meta.sends) == ["p1"] and meta.sends["p1"].block_ids == [[4, 5, 6]]
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
    assert sched.take_stats().count("backstop_expiries", "send") == 1


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


# ---------------------------------------------------------------- client-supplied params


def _p_req(rid: str = "p1", **params) -> Req:
    return Req(rid, {"do_remote_decode": True, "do_remote_prefill": False, **params},
               status=Status.FINISHED_LENGTH_CAPPED)


def _assert_local_prefill(sched: PushScheduler, req: Req, reason: str) -> None:
    """vLLM's sequence for a request that gets no async load, and nothing pushed."""
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert req.kv_transfer_params["do_remote_prefill"] is False
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # asked again: no second count
    sched.update_state_after_alloc(req, Blocks([[1, 2, 3]]), 0)
    req.status = Status.FINISHED_STOPPED
    assert sched.request_finished(req, [1, 2, 3]) == (False, None)
    assert sched.build_connector_meta(1).empty
    assert not sched.has_pending_push_work()
    stats = sched.take_stats()
    assert stats is not None and stats.to_dict() == {"refused_requests": {reason: 1}}


_BAD_D_PARAMS = {
    "only_the_flag": {"do_remote_prefill": True},
    "no_port": {k: v for k, v in d_params().items() if k != "remote_port"},
    "no_host": {k: v for k, v in d_params().items() if k != "remote_host"},
    "no_engine": {k: v for k, v in d_params().items() if k != "remote_engine_id"},
    "port_string": d_params(remote_port="8472"),
    "port_zero": d_params(remote_port=0),
    "port_too_big": d_params(remote_port=65536),
    "port_bool": d_params(remote_port=True),
    "port_float": d_params(remote_port=8472.0),
    "port_none": d_params(remote_port=None),
    "engine_empty": d_params(remote_engine_id=""),
    "engine_too_long": d_params(remote_engine_id="e" * 257),
    "engine_not_a_string": d_params(remote_engine_id=["prefill"]),
    "host_number": d_params(remote_host=10),
    "host_lone_surrogate": d_params(remote_host="10.0.0.\ud800"),
    "tp_zero": d_params(remote_tp_size=0),
    "tp_too_big": d_params(remote_tp_size=1025),
    "tp_string": d_params(remote_tp_size="1"),
    "legacy_tp_bad": {**{k: v for k, v in d_params().items() if k != "remote_tp_size"}, "tp_size": -1},
    "pull_mode_block_ids": d_params(remote_block_ids=[1, 2, 3]),
    "pull_mode": d_params(transfer_mode="pull"),
}


@pytest.mark.parametrize("params", _BAD_D_PARAMS.values(), ids=_BAD_D_PARAMS.keys())
def test_d_with_unusable_params_prefills_locally(sched, params, caplog) -> None:
    """Regression: update_state_after_alloc indexed the params straight from the client,
    so a direct request with only do_remote_prefill raised inside vLLM's schedule(),
    which kills the engine core."""
    req = Req("d-bad", dict(params))
    _assert_local_prefill(sched, req, "bad_kv_transfer_params")
    assert any("d-bad" in r.getMessage() and "prefilling it locally" in r.getMessage() for r in caplog.records)


def test_d_accepts_the_bounds_themselves(sched) -> None:
    req = Req("d" * 256, d_params(remote_port=65535, remote_tp_size=1024, remote_engine_id="e" * 256,
                                  remote_host="h" * 256, transfer_mode="push", remote_block_ids=[]))
    assert sched.get_num_new_matched_tokens(req, 0) == (300, True)
    sched.update_state_after_alloc(req, Blocks([[1]]), 300)
    reg = sched.build_connector_meta(1).recvs["d" * 256]
    assert wp.worker_decoder.decode(wp.encode(reg)) == reg  # the daemon's decoder takes it
    legacy = Req("legacy", {**{k: v for k, v in d_params().items() if k != "remote_tp_size"}, "tp_size": 2})
    assert sched.get_num_new_matched_tokens(legacy, 0) == (300, True)
    sched.update_state_after_alloc(legacy, Blocks([[2]]), 300)
    assert sched.build_connector_meta(1).recvs["legacy"].remote_tp_size == 2


def test_d_request_id_the_protocol_cannot_carry_prefills_locally(sched) -> None:
    """Regression: a 257-character id made the daemon answer Error{request_id: ""}, which
    ties to no request, so the request waited for the 180 s backstop."""
    _assert_local_prefill(sched, Req("x" * 257, d_params()), "request_id_too_long")


def test_p_does_not_hold_blocks_for_a_request_id_the_protocol_cannot_carry(sched) -> None:
    assert sched.request_finished(_p_req("x" * 257), [1, 2]) == (False, None)
    assert not sched.has_pending_push_work() and sched.build_connector_meta(1).empty
    assert sched.take_stats().to_dict() == {"refused_requests": {"request_id_too_long": 1}}


def test_never_scheduled_d_request_with_unusable_params_sends_no_release(sched) -> None:
    req = Req("d1", {"do_remote_prefill": True, "remote_port": "x"}, status=Status.FINISHED_ABORTED)
    assert sched.request_finished(req, []) == (False, None)
    assert sched.build_connector_meta(1).empty
    assert sched.take_stats().count("refused_requests", "bad_kv_transfer_params") == 1


def test_a_load_that_cannot_be_registered_fails_instead_of_hanging(sched) -> None:
    # Not reachable through vLLM (get_num_new_matched_tokens refuses these params first);
    # if it were, vLLM would wait for the load, so the worker must fail it.
    req = Req("d1", {"do_remote_prefill": True})
    sched.update_state_after_alloc(req, Blocks([[4, 5]]), 256)
    assert sched.has_pending_push_work()
    meta = sched.build_connector_meta(1)
    assert meta.recvs == {} and meta.failed_recvs == {"d1": [4, 5]}
    assert not sched.has_pending_push_work()


def test_non_dict_params_are_ignored(sched) -> None:
    req = Req("d1", ["do_remote_prefill"])  # type: ignore[arg-type]
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, Blocks([[1]]), 0)
    assert sched.request_finished(req, [1]) == (False, None)


_odd_text = st.sampled_from(["", "a\ud800", "x" * 257, "ok", "8472"])  # st.text never makes surrogates
_values = st.one_of(st.none(), st.booleans(), st.integers(-2, 70000), st.floats(allow_nan=True),
                    st.text(max_size=300), _odd_text, st.lists(st.integers(0, 10), max_size=3),
                    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_keys = st.sampled_from(["do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_host", "remote_port",
                         "remote_tp_size", "tp_size", "remote_block_ids", "transfer_mode", "transfer_id"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=st.dictionaries(_keys, _values, max_size=10), rid=st.one_of(st.text(max_size=300), _odd_text),
       abort_first=st.booleans())
def test_no_hook_raises_on_any_params_and_only_valid_messages_come_out(clock, params, rid, abort_first) -> None:
    sched = PushScheduler(watchdog_s=30.0, lease_s=20.0, clock=clock)
    d_req = Req(rid, dict(params))
    if abort_first:  # dropped before vLLM ever scheduled it
        d_req.status = Status.FINISHED_ABORTED
        sched.request_finished(d_req, [])
    else:
        count, is_async = sched.get_num_new_matched_tokens(d_req, 0)
        sched.update_state_after_alloc(d_req, Blocks([[1, 2]]), count if is_async else 0)
        d_req.status = Status.FINISHED_STOPPED
        sched.request_finished(d_req, [1, 2])
    p_req = Req(rid, dict(params), status=Status.FINISHED_LENGTH_CAPPED)
    delay, out = sched.request_finished(p_req, [3])
    meta = sched.build_connector_meta(1)
    for msg in [*meta.recvs.values(), *meta.releases, *meta.sends.values()]:
        assert wp.worker_decoder.decode(wp.encode(msg)) == msg
    if delay:
        assert out is not None and out["transfer_id"] == meta.sends[rid].match_key


# ---------------------------------------------------------------- match key (transfer_id)


def test_p_mints_a_match_key_and_returns_it_as_transfer_id(sched) -> None:
    delay, out = sched.request_finished(_p_req("p1"), [1, 2])
    ready = sched.build_connector_meta(1).sends["p1"]
    assert delay and out["transfer_id"] == ready.match_key
    assert len(ready.match_key) == 32 and int(ready.match_key, 16) >= 0  # uuid4().hex
    _, again = sched.request_finished(_p_req("p2"), [3])
    assert again["transfer_id"] != out["transfer_id"]


def test_p_keeps_the_proxys_transfer_id(sched) -> None:
    delay, out = sched.request_finished(_p_req("p1", transfer_id="xchg-1:a.b_c"), [1])
    assert delay and out["transfer_id"] == "xchg-1:a.b_c"
    assert sched.build_connector_meta(1).sends["p1"].match_key == "xchg-1:a.b_c"
    assert sched.take_stats() is None


@pytest.mark.parametrize("bad", ["has space", "x" * 65, "ünïcode", 12345, ["a"], "a\ud800"])
def test_p_ignores_an_invalid_transfer_id_and_mints_its_own(sched, bad, caplog) -> None:
    delay, out = sched.request_finished(_p_req("p1", transfer_id=bad), [1])
    ready = sched.build_connector_meta(1).sends["p1"]
    assert delay and out["transfer_id"] == ready.match_key != bad and len(ready.match_key) == 32
    assert wp.worker_decoder.decode(wp.encode(ready)) == ready
    assert sched.take_stats().to_dict() == {"ignored_transfer_ids": {"": 1}}
    assert any("not a valid match key" in r.getMessage() for r in caplog.records)


def test_d_registers_and_releases_with_the_transfer_id(sched) -> None:
    req = Req("d1", d_params(transfer_id="xchg-7"))
    assert sched.get_num_new_matched_tokens(req, 0) == (300, True)
    sched.update_state_after_alloc(req, Blocks([[1]]), 300)
    assert sched.build_connector_meta(1).recvs["d1"].match_key == "xchg-7"
    never = Req("d2", d_params(transfer_id="xchg-8"), status=Status.FINISHED_ABORTED)
    sched.request_finished(never, [])
    [release] = sched.build_connector_meta(1).releases
    assert release.request_id == "d2" and release.match_key == "xchg-8"


def test_d_ignores_an_invalid_transfer_id_and_still_receives(sched) -> None:
    req = Req("d1", d_params(transfer_id="no spaces allowed"))
    assert sched.get_num_new_matched_tokens(req, 0) == (300, True)
    sched.update_state_after_alloc(req, Blocks([[1]]), 300)
    reg = sched.build_connector_meta(1).recvs["d1"]
    assert reg.match_key == "" and reg.local_block_ids == [[1]]
    assert sched.take_stats().to_dict() == {"ignored_transfer_ids": {"": 1}}
