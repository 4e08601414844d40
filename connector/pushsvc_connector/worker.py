"""Worker side: a thin client of the daemon. No thread, no NIXL agent.

Each engine step, ``start_step`` forwards what the scheduler decided (registrations,
finished blocks, evictions) with non-blocking sends when vLLM binds the step's metadata,
before its forward pass, and ``get_finished`` drains the
daemon's events with one non-blocking read. Every request handed to the daemon ends in
exactly one report to vLLM: finished sending (P's blocks can be freed) or finished
receiving (D's request may run; failed loads are listed by
``get_block_ids_with_load_errors``).

A lost connection is not a dead daemon: a live one may still be writing into D's
blocks or reading P's for a WRITE, so reporting them would hand vLLM blocks that are
still in use. Requests outstanding when the connection drops are therefore *held*, and
the worker tries to reconnect every ``reconnect_interval_s``. What an attempt finds
decides about them:

* nothing listening on the socket (ENOENT, ECONNREFUSED): the process that owned the
  NIXL registration is gone and nothing can land any more; held requests are released
  (D's as failed loads, so vLLM fails or recomputes them; P's as finished sending). With
  CUDA KV, D's only after ``IPC_RELEASE_GRACE_S``: a same-host P daemon may be copying
  into them itself;
* a daemon with another ``daemon_id``: a new incarnation, likewise;
* the same daemon: they stay held; it delivers their final events (``RecvDone`` ...
  ``SendFailed``) to the new connection of the same rank from the same pid.

The scheduler's backstop timers (``expired_recvs`` / ``expired_sends``) release a held
request as well. While connected, a backstop expiry frees nothing by itself: the worker
sends ``Evict`` and waits for the final event, which the daemon sends once the blocks
are safe. Requests that arrive while disconnected fail fast. Reconnecting registers the
same shared KV memory again, without restarting vLLM.

At start-up a daemon that refuses the worker (its ``Error`` without a request id for the
hello or the KV registration: rank taken, layout refused) fails ``register`` with its
message; only a daemon that is not there (yet) is retried.
"""

from __future__ import annotations

import logging
import select
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from pushsvc.client import DaemonClient
from pushsvc.errors import DaemonNotListening, DaemonRefused, DaemonUnavailable, PushsvcError
from pushsvc.protocol import worker as wp
from pushsvc_connector.counters import BACKSTOP, DAEMON_GONE, DAEMON_RESTARTED, FENCED, UNCONFIRMED, Counts
from pushsvc_connector.cudashare import LayerEvents
from pushsvc_connector.kvshare import KVShare
from pushsvc_connector.steps import StepPlan

# Under the "vllm" logger so vLLM's own handler and level apply. This module imports no
# vLLM: the worker role runs (and is tested) without it.
log = logging.getLogger("vllm.pushsvc_connector")

RECONNECT_INTERVAL_S = 0.25
# D with CUDA KV: how long requests held from a daemon that is gone stay held before vLLM
# gets their blocks back. A same-host P daemon may copy into them itself (docs/gpu.md,
# "Same-host push"), and it launches a copy only while it heard from our daemon within
# its fence (``ipcpush.IPC_FENCE_S``, 2.5 s): past that plus the copy, nothing lands.
IPC_RELEASE_GRACE_S = 5.0
# P, layer-wise: how long the worker waits, before a forward pass, for its daemon to
# confirm it reads no block of a started request vLLM preempted (``_fence``).
FENCE_TIMEOUT_S = 10.0
# While the daemon is away, every attempt fails; one warning per this many is enough.
_WARN_EVERY = 40


@dataclass(slots=True)
class _Transfer:
    """A request handed to the daemon, until its one report to vLLM."""

    blocks: list[int]  # D: its block ids, all groups (load errors if it fails); P: unused
    held: bool = False  # outstanding on a connection that was lost
    evicted: bool = False  # D: vLLM dropped the request: release its blocks, do not fail them
    backstop: bool = False  # the scheduler's backstop fired: Evict sent, the final event awaited
    # P, layer-wise: started while its prefill ran, so vLLM hears of it only once the
    # scheduler said it finished (``ended``) and the daemon's final event came (``final``).
    layerwise: bool = False
    ended: bool = False
    final: bool = False
    # ... and vLLM preempted it: its first push ends unreported (the request runs again).
    preempted: bool = False
    # D with CUDA KV, its daemon gone: released at this time (monotonic), for this cause and why.
    release_at: float = 0.0
    release_why: tuple[str, str] = ("", "")


class PushWorker:
    def __init__(self, *, socket_path: str, rank: int, tp_size: int, role: wp.Role,
                 connect_timeout_s: float = 10.0, reconnect_interval_s: float = RECONNECT_INTERVAL_S,
                 pp_rank: int = 0, pp_size: int = 1, layerwise: bool = False,
                 stream: Callable[[], int] | None = None) -> None:
        """``layerwise``: push each layer as vLLM saves it; with CUDA KV, ``stream`` gives
        the handle of the stream vLLM computes on (the layer events are recorded there)."""
        self.reconnect_interval_s = reconnect_interval_s
        self._layerwise = layerwise
        self._stream = stream
        self.client = DaemonClient(socket_path, engine_id="", rank=rank, tp_size=tp_size, role=role,
                                   timeout_s=connect_timeout_s, pp_rank=pp_rank, pp_size=pp_size)
        self.stats = Counts()
        self._share: KVShare | None = None
        self._graced = False  # D requests wait out IPC_RELEASE_GRACE_S (``_release_due``)
        self._registered = False
        self._daemon_id = ""  # the incarnation last connected to
        self._next_connect = 0.0
        self._connect_failures = 0
        self._recving: dict[str, _Transfer] = {}  # D
        self._sending: dict[str, _Transfer] = {}  # P
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._load_errors: set[int] = set()
        # P, layer-wise push: each registered layer name's index (``LayerSaved``), and the
        # step whose forward pass is running with layer-wise requests in it.
        self._layers: dict[str, int] = {}
        self._open_step: int | None = None
        # ... with CUDA KV: interprocess events, one per layer and one for the forward
        # pass's end, recorded before each LayerSaved / StepSaved (the daemon waits on them).
        self._events: LayerEvents | None = None

    # ------------------------------------------------------------------ set-up

    def register(self, share: KVShare) -> None:
        """Share the KV memory with the daemon. Raises ``DaemonRefused`` if the daemon
        refuses this worker; a daemon not there yet is retried from the engine steps."""
        self._share = share
        self._layers = {}
        for region in share.regions:
            for name in region.layer_names:
                self._layers.setdefault(name, len(self._layers))
        if self._layerwise and share.kind == "cuda":
            if self._stream is None:
                raise ValueError("layer-wise push from CUDA KV needs the stream vLLM computes on")
            self._events = LayerEvents(len(self._layers) + 1)
        self._connect(startup=True)

    def _connect(self, startup: bool = False) -> bool:
        """One attempt to connect and register the KV memory; what it finds also decides
        about the requests held from a lost connection (see the module docstring)."""
        self._next_connect = time.monotonic() + self.reconnect_interval_s
        try:
            welcome = self.client.connect()
            if welcome.daemon_id != self._daemon_id:
                if self._daemon_id:
                    self._release_held(DAEMON_RESTARTED, f"the daemon restarted (now {welcome.daemon_id})")
                self._daemon_id = welcome.daemon_id
            share = self._share
            assert share is not None
            self.client.register_kv(share.fds, share.regions, share.blocks_per_logical, memory=share.cuda,
                                    layer_events=self._events.handles if self._events is not None else None)
        except DaemonRefused as exc:
            self.client.close()
            if startup:
                raise DaemonRefused(f"pushsvc daemon at {self.client.socket_path} refused this worker (TP rank "
                                    f"{self.client.hello.rank}): {exc}") from None
            self._attempt_failed(exc)  # e.g. the daemon has not yet seen our old connection close
            return False
        except DaemonNotListening as exc:
            self.client.close()
            self._release_held(DAEMON_GONE, "no pushsvc daemon is listening any more")
            self._attempt_failed(exc)
            return False
        except PushsvcError as exc:
            self.client.close()
            self._attempt_failed(exc)
            return False
        self._connect_failures = 0
        self._registered = True
        held = sum(t.held for t in self._recving.values()) + sum(t.held for t in self._sending.values())
        log.info("pushsvc connected: daemon %s, engine %s, side channel %s:%d, %d regions of %s memory%s",
                 welcome.daemon_id, welcome.engine_id, welcome.side_channel_host, welcome.side_channel_port,
                 len(share.regions), share.kind,
                 f"; {held} requests of the previous connection await their final events" if held else "")
        # Evictions that may not have reached the daemon before the connection dropped.
        evicted = [*(rid for rid, t in self._recving.items() if t.held and t.evicted),
                   *(rid for rid, t in self._sending.items() if t.held and t.preempted)]
        if evicted:
            self._send(wp.Evict(request_ids=evicted))
        return True

    def _attempt_failed(self, exc: Exception) -> None:
        self._registered = False
        if self._connect_failures % _WARN_EVERY == 0:
            log.warning("pushsvc daemon unavailable at %s (attempt %d): %s", self.client.socket_path,
                        self._connect_failures + 1, exc)
        self._connect_failures += 1

    @property
    def welcome(self) -> wp.Welcome | None:
        return self.client.welcome if self._registered else None

    def _available(self) -> bool:
        if self._registered:
            return True
        if self._share is not None and time.monotonic() >= self._next_connect:
            return self._connect()
        return False

    # ------------------------------------------------------------------ each step

    def start_step(self, meta: StepPlan) -> None:
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
        evict = [*self._backstop(meta.expired_recvs, self._recving), *self._backstop(meta.expired_sends,
                                                                                      self._sending)]
        for rid in meta.evictions:
            transfer = self._recving.get(rid)
            if transfer is not None:
                transfer.evicted = True
                if not transfer.held:  # a held one is evicted again once the daemon is back
                    evict.append(rid)
        for rid in meta.dropped_starts:
            if self._drop_start(rid):
                evict.append(rid)
        if evict:
            self._send(wp.Evict(request_ids=evict))
        for rid, reg in meta.recvs.items():
            blocks = [b for g in reg.local_block_ids for b in g]
            if self._send(reg):
                self._recving[rid] = _Transfer(blocks)
            else:
                log.warning("pushsvc: KV for %s not received: pushsvc daemon unavailable", rid)
                self._load_errors.update(blocks)
                self._done_recving.add(rid)
        for rid, ready in meta.sends.items():
            transfer = self._sending.get(rid)
            if transfer is not None and transfer.layerwise:
                self._ended(rid, transfer)  # its SendStart stood in for a SendReady
            elif self._send(ready):
                self._sending[rid] = _Transfer([])
            else:
                self._done_sending.add(rid)

    def begin_step(self, meta: StepPlan) -> None:
        """Before the step's forward pass, ahead of ``start_step``: the requests whose
        prefill ends in it (``SendStart``), after the started ones vLLM preempted are fenced."""
        self._open_step = None
        if meta.preempted_starts:
            self._fence(meta.preempted_starts)
        for rid, start in meta.layerwise.items():
            # An older daemon, or none: the request is pushed whole once it finished.
            if self._available() and self.client.supports(wp.LAYERWISE_MINOR) and self._send(start):
                self._sending[rid] = _Transfer([], layerwise=True)
                self._open_step = meta.step

    def layer_saved(self, name: str) -> None:
        """vLLM saved layer ``name`` in this step's forward pass (``save_kv_layer``; on a
        GPU its kernels are queued, and the layer's event marks their end)."""
        if self._open_step is not None:
            index = self._layers.get(name)
            if index is not None:
                self._record(index)
                self._send(wp.LayerSaved(step=self._open_step, layer=index))

    def step_saved(self) -> None:
        """This step's forward pass ended (``wait_for_save``)."""
        if self._open_step is not None:
            self._record(-1)
            self._send(wp.StepSaved(step=self._open_step))
            self._open_step = None

    def _record(self, index: int) -> None:
        if self._events is not None and self._stream is not None:
            self._events.record(index, self._stream())

    def get_finished(self, wait_s: float = 0.0) -> tuple[set[str], set[str]]:
        """Completed transfers. With ``wait_s`` > 0 (an idle engine step) and transfers
        pending but nothing to report yet, first wait up to ``wait_s`` for an event."""
        waiting = (self._recving or self._sending) and not (self._done_sending or self._done_recving)
        self._pump(wait_s if waiting else 0.0)
        sending, recving = self._done_sending, self._done_recving
        self._done_sending, self._done_recving = set(), set()
        if (sending or recving) and self._registered and self.client.supports(wp.REPORTED_MINOR):
            # The moment vLLM learns of them, for the daemon's request timelines.
            self._send(wp.Reported(sending=list(sending), recving=list(recving), at=time.monotonic()))
        return sending, recving

    def take_stats(self) -> Counts | None:
        return self.stats.take()

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ------------------------------------------------------------------ internals

    def _pump(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` (0: not at all) for the daemon, then take in its events."""
        if wait_s > 0:
            # ``connected`` too: the client closes its socket as soon as it reads the
            # daemon's EOF and reports the loss on the next poll, below.
            if self._registered and self.client.connected:
                try:
                    select.select([self.client], [], [], wait_s)
                except (OSError, ValueError, DaemonUnavailable):
                    pass  # reported by the poll below
            elif not self._registered:
                # Only held requests: nothing can arrive before the next attempt to reconnect.
                time.sleep(max(0.0, min(wait_s, self._next_connect - time.monotonic())))
        self._release_due()
        if self._available():
            try:
                events = self.client.poll()
            except DaemonUnavailable as exc:
                events = []
                self._daemon_lost(exc)
            for event in events:
                self._on_event(event)

    def _fence(self, rids: list[str]) -> None:
        """P, layer-wise: vLLM preempted ``rids`` after the step that ends their prefill was
        scheduled, and their blocks are back in its pool: the forward pass about to run may
        write another request's KV into them while the daemon still reads them for D.
        Evict each and wait for its final event (the daemon sends it once nothing of the
        request is read any more), or for the daemon to be known gone, up to
        ``FENCE_TIMEOUT_S``. vLLM hears nothing of these pushes: a request it runs again
        starts anew (an aborted one is reported by ``dropped_starts``, once fenced)."""
        tracked = [rid for rid in rids if rid in self._sending]  # else its SendStart reached no daemon
        waiting = []
        for rid in tracked:
            transfer = self._sending[rid]
            transfer.preempted = True
            if transfer.final:
                del self._sending[rid]
            else:
                waiting.append(rid)
        # A held one is evicted once the daemon is back (``_connect``), or released if it is gone.
        evict = [rid for rid in waiting if not self._sending[rid].held]
        if evict:
            self._send(wp.Evict(request_ids=evict))
        deadline = time.monotonic() + FENCE_TIMEOUT_S
        while (left := [rid for rid in waiting if rid in self._sending]) and time.monotonic() < deadline:
            self._pump(min(0.05, max(0.0, deadline - time.monotonic())))
        if len(tracked) > len(left):
            self.stats.record("preempted_pushes", FENCED, len(tracked) - len(left))
        if left:
            self.stats.record("preempted_pushes", UNCONFIRMED, len(left))
            log.error("pushsvc: vLLM preempted %d requests while their layer-wise pushes ran, and the daemon did "
                      "not confirm within %.0f s that it reads none of their blocks, which vLLM may now give to "
                      "other requests: %s", len(left), FENCE_TIMEOUT_S, ", ".join(left))
            for rid in left:
                del self._sending[rid]

    def _on_event(self, event: wp.DaemonMessage) -> None:
        if isinstance(event, wp.RecvDone):
            self._finish_recv(event.request_id, failure=None)
        elif isinstance(event, wp.RecvFailed):
            self._finish_recv(event.request_id, failure=event.reason)
        elif isinstance(event, (wp.SendDone, wp.SendFailed)):
            if isinstance(event, wp.SendFailed):
                log.warning("pushsvc: push of %s failed: %s", event.request_id, event.reason)
            self._finish_send(event.request_id)
        elif isinstance(event, wp.Error):
            log.error("pushsvc daemon refused a message: %s: %s (request %s)", event.code, event.message,
                      event.request_id or "-")
            if event.request_id:
                # The daemon does not track a request it refused: no other event follows.
                self._finish_recv(event.request_id, failure=f"refused by the daemon: {event.message}")
                self._finish_send(event.request_id)

    def _drop_start(self, rid: str) -> bool:
        """P, layer-wise: vLLM dropped ``rid`` after the step that ends its prefill was
        scheduled. True if its push must be evicted (its daemon may be reading its blocks)."""
        sending = self._sending.get(rid)
        if sending is None:
            # Its SendStart went to no daemon (none was connected, or one too old for it):
            # nothing reads its blocks, and nothing else would ever report it.
            self._done_sending.add(rid)
            return False
        evict = not (sending.held or sending.final)  # a held one is settled once the daemon is back or gone
        self._ended(rid, sending)
        return evict

    def _backstop(self, expired: list[str], table: dict[str, _Transfer]) -> list[str]:
        """The scheduler's backstop fired for ``expired``: release the held ones now,
        return the ids to evict (their blocks are freed when the daemon answers)."""
        evict = []
        for rid in expired:
            transfer = table.get(rid)
            if transfer is None or transfer.final:  # a final held for the scheduler's word: nothing to evict
                continue
            if transfer.held:
                self._release(rid, table, BACKSTOP, "the connector's backstop fired while the daemon was away")
            else:
                log.warning("pushsvc: %s: the connector's backstop fired; evicting it, its blocks are freed "
                            "when the daemon confirms", rid)
                transfer.backstop = True
                evict.append(rid)
        return evict

    def _release(self, rid: str, table: dict[str, _Transfer], cause: str, why: str) -> None:
        """Report ``rid`` without the daemon's final event."""
        log.warning("pushsvc: %s released without the daemon's final event: %s", rid, why)
        self.stats.record("released_requests", cause)
        if table is self._recving:
            self._finish_recv(rid, failure=why)
        else:
            self._finish_send(rid)

    def _release_held(self, cause: str, why: str) -> None:
        cuda = self._share is not None and self._share.kind == "cuda"
        now = time.monotonic()
        for table in (self._recving, self._sending):
            for rid, transfer in [(rid, t) for rid, t in table.items() if t.held]:
                if cuda and table is self._recving:  # a same-host P may still copy into its blocks
                    if not transfer.release_at:
                        transfer.release_at, transfer.release_why = now + IPC_RELEASE_GRACE_S, (cause, why)
                        self._graced = True
                else:
                    self._release(rid, table, cause, why)
        self._release_due()

    def _release_due(self) -> None:
        """Release D's held requests whose grace after the daemon's loss ran out."""
        if not self._graced:
            return
        now = time.monotonic()
        graced = [(r, t) for r, t in self._recving.items() if t.held and t.release_at]
        for rid, transfer in graced:
            if now >= transfer.release_at:
                self._release(rid, self._recving, *transfer.release_why)
        self._graced = any(now < t.release_at for _, t in graced)

    def _finish_recv(self, rid: str, failure: str | None) -> None:
        transfer = self._recving.pop(rid, None)
        if transfer is None:
            return
        if failure is not None and not transfer.evicted:
            log.warning("pushsvc: KV for %s not received: %s", rid, failure)
            self._load_errors.update(transfer.blocks)
        self._done_recving.add(rid)

    def _finish_send(self, rid: str) -> None:
        transfer = self._sending.get(rid)
        if transfer is None:
            return
        if transfer.preempted:  # fenced: vLLM runs the request again, and hears nothing of this push
            del self._sending[rid]
            return
        if transfer.layerwise and not transfer.ended:
            transfer.final = True  # vLLM still runs it: told once the scheduler says it ended
            return
        del self._sending[rid]
        self._done_sending.add(rid)

    def _ended(self, rid: str, transfer: _Transfer) -> None:
        """The scheduler finished (or dropped) a layer-wise request: reported with its final."""
        transfer.ended = True
        if transfer.final:
            self._finish_send(rid)

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
        self._registered = False
        self.client.close()
        self._next_connect = time.monotonic() + self.reconnect_interval_s
        self.stats.record("daemon_disconnects")
        newly_held = 0
        for table in (self._recving, self._sending):
            for rid, transfer in list(table.items()):
                if transfer.backstop:  # its backstop fired already: nothing else would release it
                    self._release(rid, table, BACKSTOP, "the daemon connection was lost after the backstop fired")
                elif not transfer.held:
                    transfer.held = True
                    newly_held += 1
        if newly_held:
            self.stats.record("held_requests", n=newly_held)
        log.error("pushsvc daemon connection lost (%s); holding %d receives and %d sends until the daemon reports "
                  "them or is known to be gone", exc, len(self._recving), len(self._sending))

    def close(self) -> None:
        self.client.close()
        if self._share is not None:
            self._share.close()
        if self._events is not None:
            self._events.close()
            self._events = None

    def __repr__(self) -> str:
        held = sum(t.held for t in self._recving.values()) + sum(t.held for t in self._sending.values())
        return (f"<PushWorker connected={self._registered} recving={len(self._recving)} "
                f"sending={len(self._sending)} held={held}>")
