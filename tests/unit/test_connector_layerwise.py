"""Layer-wise push on the connector's side: which requests the scheduler starts in which
step (vLLM's own SchedulerOutput objects), the verdicts it gives later, and a worker that
tells vLLM of a request only once both the daemon and the scheduler said it ended."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import pytest
from daemon_fixtures import P_ENGINE, daemon_config, metric, wait_until
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

from pushsvc.engine.fake import FakeEngine
from pushsvc.protocol import worker as wp
from pushsvc.server.daemon import Daemon
from pushsvc.shm import SharedBuffer
from pushsvc_connector.connector import layerwise_setting
from pushsvc_connector.kvshare import KVShare
from pushsvc_connector.metadata import PushsvcMetadata
from pushsvc_connector.prefills import Prefills
from pushsvc_connector.scheduler import PushScheduler
from pushsvc_connector.worker import PushWorker


class Status(enum.Enum):
    RUNNING = 1
    FINISHED_LENGTH_CAPPED = 2
    FINISHED_ABORTED = 4


@dataclass
class Req:
    request_id: str
    kv_transfer_params: dict | None
    num_prompt_tokens: int = 80
    status: Status = Status.RUNNING
    prompt_token_ids: list[int] = field(default_factory=list)
    max_tokens: int = 1  # P's leg of an exchange
    resumable: bool = False


def _new(rid: str, blocks: list[int], computed: int = 0) -> NewRequestData:
    return NewRequestData(req_id=rid, prompt_token_ids=None, mm_features=[], sampling_params=None,
                          pooling_params=None, block_ids=(blocks,), num_computed_tokens=computed, lora_request=None)


def _step(scheduled: dict[str, int], new: list[NewRequestData] = (), cached: list[tuple] = (),
          resumed: set[str] = frozenset(), preempted: set[str] = frozenset()) -> SchedulerOutput:
    """vLLM's output for one step; ``cached``: (request id, new blocks or None, computed tokens)."""
    data = dataclasses.replace(CachedRequestData.make_empty(), req_ids=[c[0] for c in cached],
                               resumed_req_ids=set(resumed),
                               new_block_ids=[(c[1],) if c[1] is not None else None for c in cached],
                               num_computed_tokens=[c[2] for c in cached], num_output_tokens=[0] * len(cached))
    return dataclasses.replace(SchedulerOutput.make_empty(), scheduled_new_reqs=list(new), scheduled_cached_reqs=data,
                               num_scheduled_tokens=dict(scheduled), preempted_req_ids=set(preempted),
                               total_num_scheduled_tokens=sum(scheduled.values()))


def _p_params(**extra) -> dict:
    return {"do_remote_decode": True, "do_remote_prefill": False, **extra}


def _scheduler(**opts) -> PushScheduler:
    return PushScheduler(watchdog_s=30.0, lease_s=20.0, layerwise=True, **opts)


# ---------------------------------------------------------------- scheduler


def test_a_chunked_prefill_starts_in_its_last_chunk_with_every_block() -> None:
    sched = _scheduler()
    req = Req("p1", _p_params(transfer_id="xfer-7"))
    sched.update_state_after_alloc(req, None, 0)
    first = sched.build_connector_meta(32, _step({"p1": 32}, new=[_new("p1", [4, 9])]))
    assert first.layerwise == {}, "32 of 80 prompt tokens: not its last chunk"
    second = sched.build_connector_meta(32, _step({"p1": 32}, cached=[("p1", [2, 11], 32)]))
    assert second.layerwise == {}
    third = sched.build_connector_meta(16, _step({"p1": 16}, cached=[("p1", [5], 64)]))
    start = third.layerwise["p1"]
    assert start == wp.SendStart(request_id="p1", block_ids=[[4, 9, 2, 11, 5]], step=3, match_key="xfer-7")
    assert third.step == 3 and sched.has_pending_push_work()
    assert sched.build_connector_meta(1, _step({"p1": 1}, cached=[("p1", None, 80)])).layerwise == {}, "once"
    req.status = Status.FINISHED_LENGTH_CAPPED
    held, params = sched.request_finished(req, [4, 9, 2, 11, 5])
    assert held and params["transfer_id"] == "xfer-7"
    verdict = sched.build_connector_meta(0, _step({}))
    assert verdict.sends["p1"].block_ids == [[4, 9, 2, 11, 5]] and verdict.layerwise == {}


def test_a_request_without_a_key_gets_one_minted_at_its_start_and_keeps_it() -> None:
    sched = _scheduler()
    req = Req("p2", _p_params(), num_prompt_tokens=20)
    sched.update_state_after_alloc(req, None, 0)
    start = sched.build_connector_meta(20, _step({"p2": 20}, new=[_new("p2", [1, 2])])).layerwise["p2"]
    assert start.match_key
    req.status = Status.FINISHED_LENGTH_CAPPED
    _held, params = sched.request_finished(req, [1, 2])
    assert params["transfer_id"] == start.match_key, "D must hear the key the daemon staged P's blocks under"


def test_a_prefix_hit_and_a_resumed_request_start_with_the_blocks_they_hold() -> None:
    sched = _scheduler()
    for rid in ("hit", "resumed"):
        sched.update_state_after_alloc(Req(rid, _p_params()), None, 0)
    meta = sched.build_connector_meta(16, _step({"hit": 16, "resumed": 16}, new=[
        _new("hit", [7, 8, 9, 10, 11], computed=64), _new("resumed", [1, 2])]))
    assert meta.layerwise["hit"].block_ids == [[7, 8, 9, 10, 11]]
    assert "resumed" not in meta.layerwise
    # Preempted, its blocks freed, resumed later with all of its blocks anew.
    meta = sched.build_connector_meta(64, _step({"resumed": 64}, cached=[("resumed", [20, 21, 22, 23, 24], 16)],
                                                resumed={"resumed"}))
    assert meta.layerwise["resumed"].block_ids == [[20, 21, 22, 23, 24]]


def test_an_aborted_request_is_held_and_evicted_only_if_it_started() -> None:
    sched = _scheduler()
    started, early = Req("started", _p_params()), Req("early", _p_params(), num_prompt_tokens=500)
    for req in (started, early):
        sched.update_state_after_alloc(req, None, 0)
    sched.build_connector_meta(96, _step({"started": 80, "early": 16}, new=[_new("started", [1, 2, 3, 4, 5]),
                                                                          _new("early", [6])]))
    started.status = early.status = Status.FINISHED_ABORTED
    assert sched.request_finished(started, [1, 2, 3, 4, 5]) == (True, None), "its daemon may be reading them"
    assert sched.request_finished(early, [6]) == (False, None), "never started: nothing reads its blocks"
    meta = sched.build_connector_meta(0, _step({}))
    assert meta.dropped_starts == ["started"] and meta.evictions == [] and meta.sends == {}
    sched.update_connector_output({"started"}, None)
    assert not sched.has_pending_push_work()


def test_vllm_waits_instead_of_preempting_only_while_a_started_request_runs() -> None:
    sched = _scheduler()
    ended, aborted = Req("ended", _p_params(), num_prompt_tokens=20), Req("aborted", _p_params(), num_prompt_tokens=20)
    for req in (ended, aborted):
        sched.update_state_after_alloc(req, None, 0)
    assert not sched.has_pending_block_frees(), "nothing started: vLLM preempts as usual"
    sched.build_connector_meta(40, _step({"ended": 20, "aborted": 20}, new=[_new("ended", [1, 2]),
                                                                          _new("aborted", [3, 4])]))
    assert sched.has_pending_block_frees(), "running with their pushes started"
    ended.status, aborted.status = Status.FINISHED_LENGTH_CAPPED, Status.FINISHED_ABORTED
    sched.request_finished(ended, [1, 2])
    assert sched.has_pending_block_frees()
    sched.request_finished(aborted, [3, 4])
    assert not sched.has_pending_block_frees(), "both ended: vLLM holds their blocks, whatever their pushes do"
    assert sched.has_pending_push_work()


def test_a_started_request_vllm_preempted_is_fenced_and_starts_anew_with_the_blocks_it_holds_then() -> None:
    """Preempted after its start (vLLM's own preemption, or ``reset_prefix_cache`` with
    running requests): its blocks are back in vLLM's pool without ``request_finished``."""
    now = [0.0]
    sched = _scheduler(clock=lambda: now[0])
    again, waits = Req("again", _p_params(), num_prompt_tokens=20), Req("waits", _p_params(), num_prompt_tokens=20)
    for req in (again, waits):
        sched.update_state_after_alloc(req, None, 0)
    first = sched.build_connector_meta(40, _step({"again": 20, "waits": 20}, new=[_new("again", [1, 2]),
                                                                                _new("waits", [3, 4])]))
    assert set(first.layerwise) == {"again", "waits"}
    # Both preempted; "again" runs again at once, its whole prefill in this step.
    meta = sched.build_connector_meta(20, _step({"again": 20}, cached=[("again", [5, 6], 0)], resumed={"again"},
                                                preempted={"again", "waits", "never-started"}))
    assert sorted(meta.preempted_starts) == ["again", "waits"]
    assert meta.layerwise["again"].block_ids == [[5, 6]], "started anew, with the blocks it holds now"
    assert sched.has_pending_block_frees(), "'again' runs with its new push started"
    # "waits" was not rescheduled: not started any more, and no backstop reports it to the worker.
    now[0] += sched.lease_s + 1
    later = sched.build_connector_meta(0, _step({}))
    assert later.preempted_starts == [] and later.expired_sends == ["again"]
    again.status = Status.FINISHED_LENGTH_CAPPED
    assert sched.request_finished(again, [5, 6])[0]
    assert not sched.has_pending_block_frees()
    # "waits" comes back later: a later start of its own.
    meta = sched.build_connector_meta(20, _step({"waits": 20}, cached=[("waits", [7, 8], 0)], resumed={"waits"}))
    assert meta.layerwise["waits"].block_ids == [[7, 8]] and meta.preempted_starts == []


def test_a_started_request_aborted_after_its_preemption_is_fenced_then_reported() -> None:
    sched = _scheduler()
    req = Req("p", _p_params(), num_prompt_tokens=20)
    sched.update_state_after_alloc(req, None, 0)
    sched.build_connector_meta(20, _step({"p": 20}, new=[_new("p", [1, 2])]))
    # Preempted (blocks freed), then aborted while it waits, before the next schedule.
    req.status = Status.FINISHED_ABORTED
    assert sched.request_finished(req, []) == (True, None), "vLLM waits for the workers' report"
    meta = sched.build_connector_meta(0, _step({}, preempted={"p"}))
    assert meta.preempted_starts == ["p"] and meta.dropped_starts == ["p"]


def test_a_request_that_decodes_on_or_waits_for_input_is_not_started() -> None:
    sched = _scheduler()
    for req in (Req("decodes", _p_params(), num_prompt_tokens=20, max_tokens=4),
                Req("session", _p_params(), num_prompt_tokens=20, resumable=True)):
        sched.update_state_after_alloc(req, None, 0)
    meta = sched.build_connector_meta(40, _step({"decodes": 20, "session": 20}, new=[_new("decodes", [1, 2]),
                                                                                   _new("session", [3, 4])]))
    assert meta.layerwise == {} and not sched.has_pending_block_frees()


def test_without_layerwise_nothing_is_tracked() -> None:
    sched = PushScheduler(watchdog_s=30.0, lease_s=20.0)
    sched.update_state_after_alloc(Req("p", _p_params()), None, 0)
    assert sched.build_connector_meta(80, _step({"p": 80}, new=[_new("p", [1])])).layerwise == {}


def test_prefills_forget_what_finished() -> None:
    prefills = Prefills()
    prefills.track("a", 10, "k")
    assert len(prefills) == 1 and not prefills.forget("a") and len(prefills) == 0
    prefills.track("b", 10, "k")
    assert prefills.finishing(_step({"b": 10}, new=[_new("b", [3])]))["b"].blocks == [[3]]
    assert prefills.forget("b") and not prefills.forget("b")


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_the_setting_is_a_bool(value) -> None:
    assert layerwise_setting({}) is False and layerwise_setting({"layerwise_push": True}) is True
    with pytest.raises(ValueError, match="layerwise_push"):
        layerwise_setting({"layerwise_push": value})


# ---------------------------------------------------------------- worker


def _regions(blocks: int) -> list[wp.Region]:
    return [wp.Region(buffer=0, offset=r * blocks * 64, block_len=64, num_blocks=blocks,
                      layer_names=[f"model.layers.{r // 2}.self_attn"]) for r in range(4)]


@pytest.fixture
def base():
    path = tempfile.mkdtemp(prefix="pl")
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def _reported(worker: PushWorker, timeout: float = 5.0) -> set[str]:
    got: set[str] = set()

    def any_sent() -> bool:
        got.update(worker.get_finished()[0])
        return bool(got)

    await wait_until(any_sent, "finished_sending", timeout)
    return got


@contextlib.asynccontextmanager
async def _layerwise_p(base: str, **config):
    """P's daemon on this event loop, and a layer-wise worker registered with it."""
    daemon = Daemon(daemon_config(f"{base}/rt", P_ENGINE, **config), engine=FakeEngine())
    await daemon.startup()
    buf = SharedBuffer.create(4 * 8 * 64)
    worker = PushWorker(socket_path=daemon.config.socket_path, rank=0, tp_size=1, role="producer",
                        connect_timeout_s=5.0, layerwise=True)
    try:
        await asyncio.to_thread(worker.register, KVShare(_regions(8), buffers=[buf]))
        yield daemon, worker
    finally:
        worker.close()
        buf.close()
        await daemon.shutdown()


@pytest.mark.asyncio
async def test_the_worker_tells_its_layers_and_reports_only_after_the_schedulers_verdict(base) -> None:
    async with _layerwise_p(base, lease_s=0.3) as (daemon, worker):
        start = wp.SendStart(request_id="p1", block_ids=[[1, 2]], step=9, match_key="k1")
        meta = PushsvcMetadata(layerwise={"p1": start}, step=9)
        # vLLM's order: the metadata bound before the forward pass, start_load_kv after it.
        worker.begin_step(meta)
        worker.layer_saved("model.layers.1.self_attn")
        worker.layer_saved("not.a.registered.layer")  # a layer of a group the connector does not push
        worker.start_step(meta)
        worker.step_saved()
        worker.layer_saved("model.layers.0.self_attn")  # after the step: nothing to say
        rank = daemon.service.ranks.current[0]
        await wait_until(lambda: metric(daemon, "pushsvc_worker_messages_total", type="StepSaved") == 1, "StepSaved")
        assert metric(daemon, "pushsvc_worker_messages_total", type="SendStart") == 1
        assert metric(daemon, "pushsvc_worker_messages_total", type="LayerSaved") == 1
        assert daemon.service.sender.layerwise.open_steps(rank) == 0
        # No D registers: P's lease (0.3 s) ends the push; vLLM still runs the request.
        await wait_until(lambda: metric(daemon, "pushsvc_leases_expired_total") == 1, "the lease")
        for _ in range(20):
            assert worker.get_finished() == (set(), set()), "told before the scheduler finished it"
            await asyncio.sleep(0.01)
        worker.start_step(PushsvcMetadata(sends={"p1": wp.SendReady(request_id="p1", block_ids=[[1, 2]])}))
        assert worker.get_finished() == ({"p1"}, set())
        assert metric(daemon, "pushsvc_worker_messages_total", type="SendReady") == 0, "SendStart stood in for it"
        # Aborted while its push runs: the worker evicts it, and reports it once the daemon answers.
        worker.begin_step(PushsvcMetadata(layerwise={"p2": wp.SendStart(request_id="p2", block_ids=[[3]], step=10)},
                                          step=10))
        worker.start_step(PushsvcMetadata(dropped_starts=["p2"]))
        assert await _reported(worker) == {"p2"}
        assert metric(daemon, "pushsvc_worker_messages_total", type="Evict") == 1


@pytest.mark.asyncio
async def test_a_start_the_daemon_never_got_is_pushed_whole_at_the_verdict(base) -> None:
    """The daemon restarts while the step runs: its SendStart reached nobody, so nothing
    is tracked as layer-wise, and the scheduler's verdict sends the usual SendReady to the
    new daemon."""
    config = daemon_config(f"{base}/rt", P_ENGINE)
    daemon = Daemon(config, engine=FakeEngine())
    await daemon.startup()
    buf = SharedBuffer.create(4 * 8 * 64)
    worker = PushWorker(socket_path=config.socket_path, rank=0, tp_size=1, role="producer", connect_timeout_s=5.0,
                        reconnect_interval_s=0.05)
    try:
        await asyncio.to_thread(worker.register, KVShare(_regions(8), buffers=[buf]))
        await daemon.shutdown()
        worker.begin_step(PushsvcMetadata(layerwise={"p": wp.SendStart(request_id="p", block_ids=[[1]], step=1)},
                                          step=1))
        worker.layer_saved("model.layers.0.self_attn")
        worker.step_saved()
        daemon = Daemon(config, engine=FakeEngine())
        await daemon.startup()
        await asyncio.sleep(0.1)  # the worker's next attempt to reconnect is due
        # In a thread: the worker reconnects (blocking) to a daemon on this event loop.
        await asyncio.to_thread(worker.start_step, PushsvcMetadata(sends={"p": wp.SendReady(request_id="p",
                                                                                               block_ids=[[1]])}))
        await wait_until(lambda: metric(daemon, "pushsvc_worker_messages_total", type="SendReady") == 1, "SendReady")
        assert metric(daemon, "pushsvc_worker_messages_total", type="SendStart") == 0
        assert metric(daemon, "pushsvc_worker_messages_total", type="StepSaved") == 0
    finally:
        worker.close()
        buf.close()
        await daemon.shutdown()


@pytest.mark.asyncio
async def test_a_preempted_start_is_fenced_before_the_next_forward_pass_and_vllm_hears_nothing(base) -> None:
    """vLLM preempted p1 after the step that ends its prefill (its blocks back in the pool),
    and runs it again in the next step: before that step's forward pass the worker waits
    for the daemon to let go of the first push, then starts the second."""
    async with _layerwise_p(base, lease_s=0.3) as (daemon, worker):
        worker.begin_step(PushsvcMetadata(layerwise={"p1": wp.SendStart(request_id="p1", block_ids=[[1, 2]], step=1,
                                                                        match_key="k1")}, step=1))
        worker.layer_saved("model.layers.0.self_attn")
        worker.step_saved()
        await wait_until(lambda: metric(daemon, "pushsvc_worker_messages_total", type="StepSaved") == 1, "StepSaved")
        again = wp.SendStart(request_id="p1", block_ids=[[5, 6]], step=2, match_key="k1")
        # In a thread: the worker blocks until the daemon, on this event loop, answers.
        await asyncio.to_thread(worker.begin_step, PushsvcMetadata(preempted_starts=["p1"], layerwise={"p1": again},
                                                                   step=2))
        assert worker.stats.count("preempted_pushes", "fenced") == 1, "returned only once the daemon confirmed"
        assert metric(daemon, "pushsvc_worker_messages_total", type="Evict") == 1
        await wait_until(lambda: metric(daemon, "pushsvc_worker_messages_total", type="SendStart") == 2, "SendStart")
        assert worker.get_finished() == (set(), set()), "vLLM runs p1 again: nothing to report"
        # The second push ends at P's lease (no D), and is reported at the scheduler's verdict, once.
        await wait_until(lambda: metric(daemon, "pushsvc_leases_expired_total") == 1, "the lease")
        worker.start_step(PushsvcMetadata(sends={"p1": wp.SendReady(request_id="p1", block_ids=[[5, 6]])}))
        assert await _reported(worker) == {"p1"}
        assert worker.get_finished() == (set(), set())


@pytest.mark.asyncio
async def test_a_fence_the_daemon_does_not_answer_ends_at_its_timeout_loudly(base, monkeypatch, caplog) -> None:
    monkeypatch.setattr("pushsvc_connector.worker.FENCE_TIMEOUT_S", 0.3)
    async with _layerwise_p(base) as (daemon, worker):
        worker.begin_step(PushsvcMetadata(layerwise={"p1": wp.SendStart(request_id="p1", block_ids=[[1, 2]], step=1)},
                                          step=1))
        # On the daemon's own event loop: it cannot answer while the worker waits.
        began = time.monotonic()
        worker.begin_step(PushsvcMetadata(preempted_starts=["p1", "never-sent"], step=2))
        assert 0.3 <= time.monotonic() - began < 2.0
        assert worker.stats.count("preempted_pushes", "unconfirmed") == 1
        assert worker.stats.count("preempted_pushes", "fenced") == 0
        assert "did not confirm" in caplog.text and "p1" in caplog.text
        # The daemon's late answer names a request the worker no longer tracks: nothing reaches vLLM.
        await wait_until(lambda: metric(daemon, "pushsvc_worker_messages_total", type="Evict") == 1, "Evict")
        for _ in range(20):
            assert worker.get_finished() == (set(), set())
            await asyncio.sleep(0.01)


@pytest.fixture
def daemonless(base):
    """A layer-wise P worker whose daemon is not listening (restarting, say): it starts,
    and tries to connect again at every step."""
    buf = SharedBuffer.create(4 * 8 * 64)
    worker = PushWorker(socket_path=f"{base}/absent.sock", rank=0, tp_size=1, role="producer",
                        connect_timeout_s=0.5, reconnect_interval_s=0.0, layerwise=True)
    try:
        worker.register(KVShare(_regions(8), buffers=[buf]))
        yield worker
    finally:
        worker.close()
        buf.close()


def test_a_request_dropped_after_a_start_that_reached_no_daemon_is_reported_at_once(daemonless) -> None:
    """vLLM holds a started request's blocks until the workers report it; a worker that
    handed its SendStart to no daemon has no final event to wait for."""
    sched = _scheduler()
    req = Req("p", _p_params())
    sched.update_state_after_alloc(req, None, 0)
    meta = sched.build_connector_meta(80, _step({"p": 80}, new=[_new("p", [1, 2, 3, 4, 5])]))
    assert "p" in meta.layerwise
    daemonless.begin_step(meta)  # the SendStart reaches nobody
    daemonless.start_step(meta)
    daemonless.step_saved()
    # A backstop expiry of a start the worker does not track reports nothing: vLLM may
    # still run the request, and counts every report of every worker.
    daemonless.start_step(PushsvcMetadata(expired_sends=["p"]))
    assert daemonless.get_finished() == (set(), set())
    req.status = Status.FINISHED_ABORTED  # the client went away before the step's output
    assert sched.request_finished(req, [1, 2, 3, 4, 5]) == (True, None)
    daemonless.start_step(sched.build_connector_meta(0, _step({})))
    finished, _ = daemonless.get_finished()
    assert finished == {"p"}, "nothing else would ever free its blocks"
    sched.update_connector_output(finished, None)
    assert not sched.has_pending_push_work()
