"""Tell systemd how the daemon is doing: the sd_notify protocol, with the standard library.

Under ``Type=notify`` systemd holds units ordered after ours until we send ``READY=1``,
so readiness is announced by the daemon at the moment ``/readyz`` turns 200 instead of
being polled for from outside. ``STOPPING=1`` marks the drain, ``STATUS=`` is the line
``systemctl status`` shows, and ``WATCHDOG=1`` comes from a task on the event loop: a loop
that stops turning stops the pings, and systemd restarts the daemon.

The protocol is one datagram of ``KEY=value`` lines to the ``AF_UNIX`` socket named by
``$NOTIFY_SOCKET`` (a leading ``@`` means the abstract namespace). Without that variable
every call is a no-op. Sending never raises and never blocks the loop (``MSG_DONTWAIT``):
a service manager that went away or a full socket costs a warning, logged once, not the
daemon.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable, Mapping

import structlog

log = structlog.get_logger("pushsvc.sdnotify")

# How often the STATUS line is recomputed; it is sent only when it changed.
STATUS_EVERY_S = 1.0


def notify_address(env: Mapping[str, str]) -> str | None:
    """The socket address ``$NOTIFY_SOCKET`` names, as ``socket.sendto`` takes it; None
    when unset, or when it is of a kind this module does not speak (``vsock:``)."""
    raw = env.get("NOTIFY_SOCKET", "")
    if raw.startswith("@"):
        return "\0" + raw[1:]
    if raw.startswith("/"):
        return raw
    return None


def watchdog_interval(env: Mapping[str, str], pid: int) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings: half of ``$WATCHDOG_USEC``, as sd_watchdog_enabled(3)
    advises, so one late ping is not yet a restart. None when systemd asks for no watchdog
    or asks it of another process (``$WATCHDOG_PID``)."""
    try:
        usec = int(env.get("WATCHDOG_USEC", "0"))
        wanted_pid = int(env.get("WATCHDOG_PID", str(pid)))
    except ValueError:
        return None
    if usec <= 0 or wanted_pid != pid:
        return None
    return usec / 2e6


class Notifier:
    """The daemon's line to its service manager; inert when there is none."""

    def __init__(self, address: str | None = None, watchdog_s: float | None = None) -> None:
        self.address = address
        self.watchdog_s = watchdog_s if address else None
        self._sock: socket.socket | None = None
        self._failed = False  # one warning per daemon, not one per ping
        self._ready_sent = False
        self._last_status = ""
        self.sent = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Notifier:
        """Read at the edge (the command line), like every other setting."""
        env = os.environ if env is None else env
        if env.get("NOTIFY_SOCKET") and notify_address(env) is None:
            log.warning("sd_notify_unsupported", notify_socket=env["NOTIFY_SOCKET"][:200])
        address = notify_address(env)
        return cls(address, watchdog_interval(env, os.getpid()) if address else None)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, **fields: str) -> bool:
        """Send one datagram of ``KEY=value`` lines (keys upper-cased); True when it went out."""
        if self.address is None:
            return False
        payload = "".join(f"{key.upper()}={value}\n" for key, value in fields.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(payload, socket.MSG_DONTWAIT, self.address)
        except OSError as exc:
            if not self._failed:
                self._failed = True
                log.warning("sd_notify_failed", notify_socket=self.address.replace("\0", "@"),
                            error=f"{type(exc).__name__}: {exc.strerror or exc}")
            return False
        self.sent += 1
        if "status" in fields:
            self._last_status = fields["status"]
        return True

    def update(self, ready: bool, status: str) -> None:
        """``READY=1`` the first time ``ready`` holds (systemd takes it once), afterwards a
        ``STATUS=`` line when ``status`` differs from the last one sent."""
        if ready and not self._ready_sent:
            # Marked before sending: a failed send is logged, and not retried every second.
            self._ready_sent = True
            self.notify(ready="1", status=status)
        elif status != self._last_status:
            self.notify(status=status)

    def stopping(self, status: str) -> bool:
        self._ready_sent = True  # a daemon that drains is never announced ready afterwards
        return self.notify(stopping="1", status=status)

    async def run(self, status: Callable[[], tuple[bool, str]]) -> None:
        """Until cancelled: ``WATCHDOG=1`` every ``watchdog_s``, and ``update(*status())``
        every ``STATUS_EVERY_S``. Both run on the event loop on purpose: they are what shows
        that the loop still turns."""
        if self.address is None:
            return
        loops = [self._status_loop(status)]
        if self.watchdog_s is not None:
            loops.append(self._watchdog_loop(self.watchdog_s))
        await asyncio.gather(*loops)

    async def _watchdog_loop(self, interval: float) -> None:
        while True:
            self.notify(watchdog="1")
            await asyncio.sleep(interval)

    async def _status_loop(self, status: Callable[[], tuple[bool, str]]) -> None:
        while True:
            await asyncio.sleep(STATUS_EVERY_S)
            self.update(*status())

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __repr__(self) -> str:
        where = "off" if self.address is None else self.address.replace("\0", "@")
        return f"<Notifier {where} watchdog={self.watchdog_s} sent={self.sent}>"
