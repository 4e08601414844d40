"""Shared fixtures for the pure-state and protocol unit tests, and the fuzz-size option."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pushsvc.protocol.notif import PushReg

MakePushReg = Callable[..., PushReg]


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
    """Factory for a valid ``PushReg``; keyword arguments override single fields."""
    return _push_reg
