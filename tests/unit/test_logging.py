"""configure_logging: JSON lines carry the fields log shippers key on; levels filter."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from pushsvc.errors import ConfigError
from pushsvc.logging import configure_logging, get_logger


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    # configure_logging changes process-wide state; leave the next test what it found.
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    root.handlers[:] = handlers
    root.setLevel(level)


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_event_level_timestamp_and_bound_keys() -> None:
    out = io.StringIO()
    configure_logging("json", "info", out)
    log = get_logger("pushsvc.test").bind(request_id="req-1")
    log.info("transfer_done", peer="d0", blocks=3)
    with structlog.contextvars.bound_contextvars(engine_id="p0"):
        log.warning("lease_expired")

    first, second = lines(out)
    assert first["event"] == "transfer_done"
    assert first["level"] == "info"
    assert str(first["timestamp"]).endswith("Z")
    assert (first["request_id"], first["peer"], first["blocks"]) == ("req-1", "d0", 3)
    assert first["logger"] == "pushsvc.test"
    assert second["engine_id"] == "p0"
    assert second["level"] == "warning"


def test_auto_on_a_non_tty_stream_is_json_and_exceptions_stay_on_one_line() -> None:
    out = io.StringIO()
    configure_logging("auto", "info", out)
    try:
        raise RuntimeError("nixl went away")
    except RuntimeError:
        get_logger("t").exception("write_failed")
    (record,) = lines(out)
    assert "nixl went away" in str(record["exception"])


def test_info_level_drops_debug() -> None:
    out = io.StringIO()
    configure_logging("json", "info", out)
    log = get_logger("t")
    log.debug("hidden")
    log.info("shown")
    assert [r["event"] for r in lines(out)] == ["shown"]


def test_reconfigure_applies_to_existing_loggers() -> None:
    log = get_logger("t")
    first, second = io.StringIO(), io.StringIO()
    configure_logging("json", "info", first)
    log.debug("dropped")
    configure_logging("json", "debug", second)
    log.debug("kept")
    assert first.getvalue() == ""
    assert [r["event"] for r in lines(second)] == ["kept"]


def test_stdlib_warnings_reach_the_same_stream_once() -> None:
    out = io.StringIO()
    configure_logging("json", "debug", out)
    configure_logging("json", "debug", out)  # no duplicate handler
    logging.getLogger("ucx").info("chatter")
    logging.getLogger("ucx").warning("endpoint %s reset", "ep1")
    (record,) = lines(out)
    assert record["event"] == "endpoint ep1 reset"
    assert record["logger"] == "ucx"
    assert record["level"] == "warning"


def test_console_mode_is_not_json() -> None:
    out = io.StringIO()
    configure_logging("console", "info", out)
    get_logger("t").info("hello", peer="d0")
    text = out.getvalue()
    assert "hello" in text and "peer=d0" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_bad_format_rejected() -> None:
    with pytest.raises(ConfigError) as info:
        configure_logging("xml", "info", io.StringIO())
    assert info.value.field == "log_format"
