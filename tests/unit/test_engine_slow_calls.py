"""A NIXL call that holds the daemon's event loop is reported: every call of the real
engine's agents is timed, and one of ``SLOW_CALL_S`` or more reaches ``on_slow``, which the
daemon turns into an ``engine_call_slow`` event and ``pushsvc_engine_slow_calls_total``."""

from __future__ import annotations

import time

import pytest
import structlog

from pushsvc.engine import nixl
from pushsvc.errors import TransferError
from pushsvc.metrics import Metrics
from pushsvc.server.daemon import slow_call_reporter


@pytest.fixture
def reported():
    seen: list[tuple[str, str, float]] = []
    agent = nixl.NixlEngine(["UCX"], on_slow=lambda *call: seen.append(call)).create_agent("slow-probe")
    try:
        yield agent, seen
    finally:
        agent.close()


def _slowed(agent, method: str, seconds: float, fail: bool = False) -> None:
    """Make the NIXL agent's ``method`` take ``seconds`` (and then fail, with ``fail``)."""
    real = getattr(agent._agent, method)

    def slow(*args, **kwargs):
        time.sleep(seconds)
        if fail:
            raise RuntimeError("stuck, then gave up")
        return real(*args, **kwargs)

    setattr(agent._agent, method, slow)


def test_fast_calls_are_not_reported(reported) -> None:
    agent, seen = reported
    agent.metadata()
    assert agent.notifs() == {}
    assert seen == []


def test_a_call_that_holds_the_loop_is_reported_with_its_name_and_time(reported) -> None:
    agent, seen = reported
    _slowed(agent, "get_new_notifs", nixl.SLOW_CALL_S + 0.05)
    assert agent.notifs() == {}
    assert len(seen) == 1
    name, call, seconds = seen[0]
    assert (name, call) == ("slow-probe", "get_new_notifs") and seconds >= nixl.SLOW_CALL_S + 0.05


def test_a_slow_call_that_fails_is_reported_too(reported) -> None:
    agent, seen = reported
    _slowed(agent, "get_agent_metadata", nixl.SLOW_CALL_S + 0.05, fail=True)
    with pytest.raises(RuntimeError, match="gave up"):
        agent.metadata()
    _slowed(agent, "send_notif", nixl.SLOW_CALL_S, fail=True)
    with pytest.raises(TransferError):
        agent.send_notif("nobody", b"x")
    assert [call for _, call, _ in seen] == ["get_agent_metadata", "send_notif"]


def test_the_daemon_logs_and_counts_each_slow_call() -> None:
    metrics = Metrics()
    report = slow_call_reporter(metrics)
    with structlog.testing.capture_logs() as events:
        report("prefill-r0", "transfer", 5.2)
        report("prefill-r0", "transfer", 0.3)
        report("prefill-r0", "add_remote_agent", 0.4)
    assert metrics.registry.get_sample_value("pushsvc_engine_slow_calls_total", {"call": "transfer"}) == 2
    assert metrics.registry.get_sample_value("pushsvc_engine_slow_calls_total", {"call": "add_remote_agent"}) == 1
    assert events[0] == {"event": "engine_call_slow", "log_level": "warning", "agent": "prefill-r0",
                         "call": "transfer", "seconds": 5.2}
