"""P's daemon coordinates, for the ``kv_transfer_params`` P returns: where D must
register (the daemon's engine id and side-channel address) and P's TP size.

``get`` is called from ``request_finished`` on vLLM's scheduler thread, which must never
wait on a socket (it blocked up to 0.5 s once a second before), so:

* construction asks once with a bounded, blocking ``describe_daemon`` (``timeout_s``):
  engine start-up may wait, and the daemon is normally up by then (vLLM builds the
  workers, which connect to it, before the scheduler);
* after that, at most once per ``refresh_s``, a ``DescribeExchange`` runs over a
  non-blocking socket: one call starts it, later calls advance it (``get``, and
  ``refresh``, which the connector calls on every engine step), and it is dropped if no
  answer came within ``timeout_s``. A call costs a clock read, plus one non-blocking
  ``recv`` while an exchange is open.

The last answer is kept while the daemon cannot be asked; a restarted daemon's new
side-channel port is picked up within about ``refresh_s`` and one engine step.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from vllm.logger import init_logger

from pushsvc.client import DescribeExchange, describe_daemon
from pushsvc.errors import DaemonUnavailable
from pushsvc.protocol import worker as wp

log = init_logger("vllm.pushsvc_connector")


class DaemonCoordinates:
    def __init__(self, socket_path: str, tp_size: int, *, timeout_s: float = 2.0, refresh_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.socket_path = socket_path
        self.tp_size = tp_size
        self.timeout_s = timeout_s
        self.refresh_s = refresh_s
        self._clock = clock
        self._value: dict[str, Any] | None = None
        self._exchange: DescribeExchange | None = None
        self._started = 0.0
        self._next = clock() + refresh_s
        try:
            self._learn(describe_daemon(socket_path, timeout_s=timeout_s))
        except DaemonUnavailable as exc:
            log.warning("pushsvc: cannot describe the daemon at %s yet (%s); P returns no coordinates until it "
                        "answers", socket_path, exc)

    def get(self) -> dict[str, Any] | None:
        """The latest coordinates (None until the daemon first answered). Never blocks."""
        self.refresh()
        return self._value

    def refresh(self) -> None:
        """Advance the refresh exchange; returns at once."""
        now = self._clock()
        if self._exchange is None:
            if now < self._next:
                return
            self._next = now + self.refresh_s
            try:
                self._exchange, self._started = DescribeExchange(self.socket_path), now
            except DaemonUnavailable:
                return  # keep the last answer; ask again in refresh_s
        try:
            welcome = self._exchange.poll()
        except DaemonUnavailable:
            self._exchange = None
            return
        if welcome is not None:
            self._exchange = None
            self._learn(welcome)
        elif now - self._started > self.timeout_s:
            self._exchange.close()
            self._exchange = None

    def close(self) -> None:
        if self._exchange is not None:
            self._exchange.close()
            self._exchange = None

    def _learn(self, welcome: wp.Welcome) -> None:
        value = {"remote_engine_id": welcome.engine_id, "remote_host": welcome.side_channel_host,
                 "remote_port": welcome.side_channel_port, "remote_tp_size": self.tp_size}
        if value != self._value:
            log.info("pushsvc: P's daemon %s: engine %s, side channel %s:%d", welcome.daemon_id, welcome.engine_id,
                     welcome.side_channel_host, welcome.side_channel_port)
            self._value = value

    def __repr__(self) -> str:
        return (f"<DaemonCoordinates {self.socket_path} known={self._value is not None} "
                f"asking={self._exchange is not None}>")
