"""Worker side: a thin client of the daemon. No thread, no NIXL agent.

Each engine step, ``start_load_kv`` forwards what the scheduler decided (registrations,
finished blocks, evictions) with non-blocking sends, and ``get_finished`` drains the
daemon's events with one non-blocking read. Every request handed to the daemon ends in
exactly one report to vLLM: finished sending (P's blocks can be freed) or finished
receiving (D's request may run; failed loads are listed by
``get_block_ids_with_load_errors``).

If the daemon goes away, requests in flight are reported at once (D's as failed
loads, so vLLM fails them cleanly), new ones fail fast, and the worker reconnects -
re-registering the same shared KV memory - when the daemon is back.
"""

from __future__ import annotations

import select
import time

import msgspec
from vllm.logger import init_logger

from pushsvc.client import DaemonClient
from pushsvc.errors import DaemonUnavailable, PushsvcError
from pushsvc.protocol import worker as wp
from pushsvc.protocol.worker import Region
from pushsvc.shm import SharedBuffer
from pushsvc_connector.metadata import PushsvcMetadata
from pushsvc_connector.stats import PushsvcConnectorStats

# Under the "vllm" logger so vLLM's own handler and level apply.
log = init_logger("vllm.pushsvc_connector")

RECONNECT_INTERVAL_S = 0.25
# While the daemon is away, every attempt fails; one warning per this many is enough.
_WARN_EVERY = 40


class PushWorker:
    def __init__(self, *, socket_path: str, rank: int, tp_size: int, role: wp.Role,
                 connect_timeout_s: float = 10.0, reconnect_interval_s: float = RECONNECT_INTERVAL_S) -> None:
        self.reconnect_interval_s = reconnect_interval_s
        self.client = DaemonClient(socket_path, engine_id="", rank=rank, tp_size=tp_size, role=role,
                                   timeout_s=connect_timeout_s)
        self._buffers: list[SharedBuffer] = []
        self._regions: list[Region] = []
        self._blocks_per_logical = 1
        self._registered = False
        self._next_connect = 0.0
        self._connect_failures = 0
        self._recving: dict[str, list[int]] = {}  # D: request -> its block ids
        self._evicted: set[str] = set()  # D: evicted, final report pending
        self._sending: set[str] = set()
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self.stats = PushsvcConnectorStats()

    # ------------------------------------------------------------------ set-up

    def register(self, buffers: list[SharedBuffer], regions: list[Region], blocks_per_logical: int) -> None:
        self._buffers, self._regions, self._blocks_per_logical = buffers, regions, blocks_per_logical
        self._connect()

    def _connect(self) -> bool:
        self._next_connect = time.monotonic() + self.reconnect_interval_s
        try:
            welcome = self.client.connect()
            self.client.register_kv([b.fd for b in self._buffers], self._regions, self._blocks_per_logical)
        except PushsvcError as exc:
            self.client.close()
            self._registered = False
            if self._connect_failures % _WARN_EVERY == 0:
                log.warning("pushsvc daemon unavailable at %s (attempt %d): %s", self.client.socket_path,
                            self._connect_failures + 1, exc)
            self._connect_failures += 1
            return False
        self._connect_failures = 0
        self._registered = True
        log.info("pushsvc connected: engine %s, side channel %s:%d, %d regions", welcome.engine_id,
                 welcome.side_channel_host, welcome.side_channel_port, len(self._regions))
        return True

    @property
    def welcome(self) -> wp.Welcome | None:
        return self.client.welcome if self._registered else None

    def _available(self) -> bool:
        if self._registered:
            return True
        if self._regions and time.monotonic() >= self._next_connect:
            return self._connect()
        return False

    # ------------------------------------------------------------------ each step

    def start_step(self, meta: PushsvcMetadata) -> None:
        if meta.recvs or meta.sends or meta.evictions:
            log.debug("pushsvc step: %d registrations, %d sends, %d evictions", len(meta.recvs), len(meta.sends),
                      len(meta.evictions))
        for rid in meta.dropped_recvs:
            self._done_recving.add(rid)
        for rid, blocks in meta.failed_recvs.items():
            self._load_errors.update(blocks)
            self._done_recving.add(rid)
        for release in meta.releases:
            self._send(release)  # best effort: P's lease frees the blocks otherwise
        for rid in meta.expired_recvs:
            self._fail_recv(rid, "no push before the connector's watchdog")
            self._send(wp.Evict(request_ids=[rid]))
        for rid in meta.expired_sends:
            if rid in self._sending:
                self._sending.discard(rid)
                self._done_sending.add(rid)
                self._send(wp.Evict(request_ids=[rid]))
        for rid in meta.evictions:
            if rid in self._recving:
                self._evicted.add(rid)
                self._send(wp.Evict(request_ids=[rid]))
        for rid, reg in meta.recvs.items():
            self._recving[rid] = [b for g in reg.local_block_ids for b in g]
            if not self._send(reg):
                self._fail_recv(rid, "pushsvc daemon unavailable")
        for rid, ready in meta.sends.items():
            self._sending.add(rid)
            if not self._send(ready):
                self._sending.discard(rid)
                self._done_sending.add(rid)

    def get_finished(self, wait_s: float = 0.0) -> tuple[set[str], set[str]]:
        """Completed transfers. With ``wait_s`` > 0 (an idle engine step) and transfers
        pending but nothing to report yet, first wait up to ``wait_s`` for an event."""
        # ``connected`` too: the client closes its socket as soon as it reads the
        # daemon's EOF and reports the loss on the next poll, below.
        if (wait_s > 0 and self._registered and self.client.connected and (self._recving or self._sending)
                and not (self._done_sending or self._done_recving)):
            try:
                select.select([self.client], [], [], wait_s)
            except (OSError, ValueError, DaemonUnavailable):
                pass  # reported by the poll below
        if self._available():
            try:
                events = self.client.poll()
            except DaemonUnavailable as exc:
                events = []
                self._daemon_lost(exc)
            for event in events:
                self._on_event(event)
        sending, recving = self._done_sending, self._done_recving
        self._done_sending, self._done_recving = set(), set()
        return sending, recving

    def take_stats(self) -> PushsvcConnectorStats | None:
        return self.stats.take()

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ------------------------------------------------------------------ internals

    def _on_event(self, event: wp.DaemonMessage) -> None:
        if isinstance(event, wp.RecvDone):
            if self._recving.pop(event.request_id, None) is not None:
                self._evicted.discard(event.request_id)
                self._done_recving.add(event.request_id)
        elif isinstance(event, wp.RecvFailed):
            self._fail_recv(event.request_id, event.reason)
        elif isinstance(event, (wp.SendDone, wp.SendFailed)):
            if isinstance(event, wp.SendFailed):
                log.warning("pushsvc: push of %s failed: %s", event.request_id, event.reason)
            if event.request_id in self._sending:
                self._sending.discard(event.request_id)
                self._done_sending.add(event.request_id)
        elif isinstance(event, wp.Error):
            log.error("pushsvc daemon refused a message: %s: %s (request %s)", event.code, event.message,
                      event.request_id or "-")
            if event.request_id in self._recving:
                self._fail_recv(event.request_id, event.message)
            elif event.request_id in self._sending:
                self._sending.discard(event.request_id)
                self._done_sending.add(event.request_id)

    def _fail_recv(self, rid: str, reason: str) -> None:
        blocks = self._recving.pop(rid, None)
        if blocks is None:
            return
        if rid in self._evicted:
            self._evicted.discard(rid)  # the request is gone: just release its blocks
        else:
            log.warning("pushsvc: KV for %s not received: %s", rid, reason)
            self._load_errors.update(blocks)
        self._done_recving.add(rid)

    def _send(self, msg: wp.WorkerMessage) -> bool:
        if not self._available():
            return False
        if isinstance(msg, (wp.RegisterRecv, wp.SendReady)) and msg.match_key and not self.client.supports(
                wp.MATCH_KEY_MINOR):
            msg = msgspec.structs.replace(msg, match_key="")  # a 1.0 daemon refuses the field
        try:
            self.client.send(msg)
            return True
        except DaemonUnavailable as exc:
            self._daemon_lost(exc)
            return False

    def _daemon_lost(self, exc: Exception) -> None:
        log.error("pushsvc daemon connection lost (%s); failing %d receives and releasing %d sends",
                  exc, len(self._recving), len(self._sending))
        self._registered = False
        self.client.close()
        self._next_connect = time.monotonic() + self.reconnect_interval_s
        for rid in list(self._recving):
            self._fail_recv(rid, "pushsvc daemon went away")
        self._done_sending |= self._sending
        self._sending.clear()

    def close(self) -> None:
        self.client.close()
        for b in self._buffers:
            b.close()
        self._buffers = []

    def __repr__(self) -> str:
        return (f"<PushWorker connected={self._registered} recving={len(self._recving)} "
                f"sending={len(self._sending)}>")
