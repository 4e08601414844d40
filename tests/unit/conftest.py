"""Shared fixtures for the pure-state and protocol unit tests, and the fuzz-size option."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pushsvc.protocol.notif import PushReg
from pushsvc.state.consumer import ConsumerTable, PendingRecv, Remote
from pushsvc.state.producer import ProducerTable

MakePushReg = Callable[..., PushReg]
MakeRemote = Callable[..., Remote]
SendRecv = Callable[..., PendingRecv]


@pytest.fixture
def fuzz_cases(request: pytest.FixtureRequest) -> int:
    """How many inputs each fuzz test feeds its decoder (``--fuzz-examples``, declared in
    tests/conftest.py)."""
    return request.config.getoption("--fuzz-examples")


def _push_reg(request_id: str = "cmpl-abc-0-deadbeef", **overrides: Any) -> PushReg:
    fields: dict[str, Any] = dict(
        request_id=request_id,
        decode_engine_id="decode-engine",
        decode_host="10.0.0.2",
        decode_port=5601,
        decode_tp_size=1,
        local_block_ids=[[3, 4, 5]],
        remote_engine_id="prefill-engine",
        remote_host="10.0.0.1",
        remote_port=5600,
        remote_tp_size=1,
    )
    fields.update(overrides)
    return PushReg(**fields)


@pytest.fixture
def push_reg() -> MakePushReg:
    """Factory for a valid ``PushReg``; keyword arguments override single fields (its
    owner is ``decode_engine_id``, "decode-engine" unless given; ``match_key`` is unset
    unless given)."""
    return _push_reg


# ---------------------------------------------------------------- the matching tables


@pytest.fixture
def producer() -> ProducerTable:
    """A P-side table with a 30 s lease and a 10 s registration TTL, default bounds."""
    return ProducerTable(lease_s=30.0, registration_ttl_s=10.0)


def _remote(tp_size: int = 1, engine_id: str = "prefill-0") -> Remote:
    return Remote(engine_id=engine_id, host="10.0.0.1", port=5600, tp_size=tp_size)


@pytest.fixture
def p_remote() -> MakeRemote:
    """Factory for the P engine a D registration waits on (TP 1, "prefill-0" unless given)."""
    return _remote


@pytest.fixture
def consumer(request: pytest.FixtureRequest) -> ConsumerTable:
    """A D-side table (D TP 1): 60 s watchdog, 5 s cancel grace, 5 s digest wait. Verify
    mode is off unless the test parametrizes this fixture indirectly with ``True``
    (``@pytest.mark.parametrize("consumer", [True], indirect=True)``)."""
    verify = getattr(request, "param", False)
    return ConsumerTable(watchdog_s=60.0, cancel_grace_s=5.0, digest_wait_s=5.0, verify=verify)


@pytest.fixture
def sent_recv(consumer: ConsumerTable) -> SendRecv:
    """Factory: track a registration on ``consumer`` and mark its PUSH_REG delivered to a
    P incarnation (``p-daemon-0``) and agent (``p-agent-0`` unless given; with ``tp_size``
    k > 1, the agents ``p-agent-0`` .. ``p-agent-{k-1}`` of P ranks 0..k-1)."""

    def make(request_id: str, block_ids: list[list[int]] | None = None, *, now: float = 0.0, tp_size: int = 1,
             p_daemon: str = "p-daemon-0", p_agent: str = "p-agent-0", match_key: str = "") -> PendingRecv:
        entry = consumer.add(request_id, [[1]] if block_ids is None else block_ids, _remote(tp_size), now,
                             match_key=match_key)
        assert entry is not None, f"{request_id} is tracked already"
        # A registration of P TP k (D TP 1) goes to P ranks 0..k-1: agents p-agent-0.. .
        sources = {p_agent: 0} if tp_size == 1 else {f"p-agent-{i}": i for i in range(tp_size)}
        assert consumer.mark_sent(request_id, p_daemon, sources)
        return entry

    return make
