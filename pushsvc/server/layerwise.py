"""P's layer-wise pushes: the requests of each running step, and the posting of a WRITE
as its layers become final. Composed into the ``Sender``, which owns the tables and
settles the WRITEs; the pure part is ``state/layerwise.py``. See docs/architecture.md,
"Layer-wise push (P)".

A ``SendStart`` puts the request into its step here; ``LayerSaved`` and ``StepSaved`` say
which of the step's layers are final. A request matched meanwhile gets a ``LayerPost``
on its ``Write``: the whole WRITE planned once, posted piece by piece as its source
regions become final, without a notification (into a landing D, in parts of whole
layers, each with its part notification). Once every piece is posted and has landed, D
hears ``WriteStarted`` (with the digests in verify mode) and the completion (after parts:
none more).
Once the step ended, every request of it is complete and the step is forgotten (a
request matched later is pushed whole). A step whose layer event failed is forgotten too,
and every request of it not pushed yet fails: none goes as if its KV were final. A
same-host push gets a ``LayerCopy`` instead (``server/ipcpush.py``): its copies into D's
KV are launched as the layers become final, each after the fence check, and it completes
as a WRITE does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from pushsvc.devmem.base import DeviceEvent
from pushsvc.engine.base import XferState
from pushsvc.errors import DeviceError, ProtocolError, TransferError
from pushsvc.metrics import Metrics
from pushsvc.protocol import notif
from pushsvc.server.ipcpush import LayerCopy, launch_check, launch_together
from pushsvc.server.peers import Peer, PeerLink
from pushsvc.server.ranks import Rank
from pushsvc.server.timelines import Timelines
from pushsvc.server.writes import LayerPost, Write, write_started
from pushsvc.state.layerwise import LayerMap, Progress
from pushsvc.state.producer import Match
from pushsvc.state.stages import keys
from pushsvc.state.timeline import SEND

log = structlog.get_logger("pushsvc.sender")

MAX_OPEN_STEPS = 16  # per rank: steps whose StepSaved has not come (vLLM runs one, or two pipelined)
MAX_STEP_REQUESTS = 65536  # requests one step may start

Settle = Callable[[Rank, Write, list[XferState]], None]
Unposted = Callable[[Rank, str, tuple[str, str]], None]  # (rank, P's request id, (kind, reason))


@dataclass(eq=False)
class _Step:
    requests: dict[str, Progress] = field(default_factory=dict)  # by P's request id


@dataclass(frozen=True, slots=True)
class _Saved:
    """A ``LayerSaved`` (``layer``) or ``StepSaved`` (``layer`` None) of a GPU worker, held
    until the event the worker recorded before it says the kernels ran."""

    step: int
    layer: int | None
    event: DeviceEvent
    at: float  # loop time it came


class Layerwise:
    def __init__(self, *, metrics: Metrics, timelines: Timelines, peers: PeerLink, verify: bool,
                 writes: Callable[[Rank], dict[str, Write]], settle: Settle, unposted: Unposted,
                 wake: Callable[[], None], now: Callable[[], float]) -> None:
        self._metrics = metrics
        self._timelines = timelines
        self._peers = peers
        self._verify = verify
        self._writes = writes  # the rank's posted WRITEs, by P's request id
        self._settle = settle  # release what settled of a WRITE; settle it once nothing is left
        self._unposted = unposted  # end a request with nothing posted (staged, or matched before its WRITE)
        self._wake = wake
        self._now = now
        self._maps: dict[Rank, LayerMap] = {}
        self._steps: dict[Rank, dict[int, _Step]] = {}
        self._held: dict[Rank, deque[_Saved]] = {}  # GPU workers' saves whose events are pending, in order

    def _map(self, rank: Rank) -> LayerMap:
        layers = self._maps.get(rank)
        if layers is None:
            assert rank.memory is not None
            layers = self._maps[rank] = LayerMap(keys(r.layer_names for r in rank.memory.regions))
        return layers

    # ------------------------------------------------------------------ steps

    def refusal(self, rank: Rank, step: int) -> str:
        """Why ``rank`` cannot start a layer-wise request in ``step``, or ''."""
        if rank.memory is None:
            return "no KV memory registered for this rank"
        if rank.memory.mem_type != "DRAM" and not rank.memory.layer_events:
            return ("layer-wise push from a GPU needs the worker's layer events (RegisterKV.layer_events): a layer is "
                    "final only when its kernels ran, which they tell")
        steps = self._steps.get(rank, {})
        if step not in steps and len(steps) >= MAX_OPEN_STEPS:
            return f"layer-wise push: {len(steps)} steps of this worker never said StepSaved"
        if step in steps and len(steps[step].requests) >= MAX_STEP_REQUESTS:
            return f"layer-wise push: step {step} started {MAX_STEP_REQUESTS} requests already"
        return ""

    def start(self, rank: Rank, step: int, rid: str) -> None:
        """``rid`` finishes its prefill in ``step`` (``refusal`` said it may)."""
        self._steps.setdefault(rank, {}).setdefault(step, _Step()).requests[rid] = Progress(self._map(rank))

    def progress(self, rank: Rank, rid: str) -> Progress | None:
        """``rid``'s layers, while the step that finishes its prefill is running."""
        for step in self._steps.get(rank, {}).values():
            progress = step.requests.get(rid)
            if progress is not None:
                return progress
        return None

    def pending(self, rank: Rank, rid: str) -> Progress | None:
        """``rid``'s layers where some are not final yet (its WRITE goes layer by layer)."""
        progress = self.progress(rank, rid)
        return progress if progress is not None and not progress.complete else None

    def layer_saved(self, rank: Rank, step: int, layer: int) -> None:
        """Layer ``layer`` of ``step`` is final (a GPU worker's: once its event says so):
        post what it makes final. ProtocolError for a layer the worker did not register."""
        layers = self._map(rank) if rank.memory is not None else None
        if layers is None or not 0 <= layer < layers.layers:
            raise ProtocolError(f"layer {layer}: this worker registered {layers.layers if layers else 0} layers")
        if not self._hold(rank, step, layer):
            self._apply(rank, [(step, layer)])

    def step_saved(self, rank: Rank, step: int) -> None:
        """``step``'s forward pass ended (a GPU worker's: once its event says so): its
        requests are complete and the step is forgotten; post what was still pending."""
        if not self._hold(rank, step, None):
            self._apply(rank, [(step, None)])

    def _hold(self, rank: Rank, step: int, layer: int | None) -> bool:
        """A GPU worker's save waits for its event (and for the saves before it) until the
        next ``poll``: the progress pass that the worker's message wakes, after every
        message of the same read, so that saves which came together apply together."""
        events = rank.memory.layer_events if rank.memory is not None else []
        if not events:
            return False
        held = self._held.setdefault(rank, deque())
        if len(held) >= MAX_OPEN_STEPS * len(events):  # a worker saves each layer and the pass once a step
            raise ProtocolError(f"layer-wise push: {len(held)} saves of this worker wait for their events already")
        held.append(_Saved(step, layer, events[layer if layer is not None else -1], self._now()))
        return True

    def poll(self, rank: Rank) -> None:
        """Apply the held saves whose events say their kernels ran, in the order they came.
        Those found done in one poll apply as one: a P that fell behind the pass (its
        layers came faster than it posts them) catches up in one launch or post per run of
        regions, not one per layer."""
        held = self._held.get(rank)
        done: list[tuple[int, int | None]] = []
        while held:
            saved = held[0]
            try:
                if not saved.event.done():
                    break
            except DeviceError as exc:  # the worker's context failed: its step's KV is not known final
                held.popleft()
                self._apply(rank, done)  # the saves before it did run
                done = []
                self._event_failed(rank, saved.step, str(exc))
                continue
            held.popleft()
            done.append((saved.step, saved.layer))
        self._apply(rank, done)

    def _event_failed(self, rank: Rank, step: int, error: str) -> None:
        """The step's KV is never known final: every request of it that is not pushed
        whole already fails. The step is forgotten, so one left staged would later look
        like a request whose step ended, and go whole over never-computed KV."""
        current = self._steps.get(rank, {}).pop(step, None)
        log.error("layer_event_failed", rank=rank.number, step=step, error=error)
        failure = ("layer_event", f"the worker's layer event failed: {error}")
        writes = self._writes(rank)
        for rid in current.requests if current is not None else ():
            write = writes.get(rid)
            if write is None:  # staged, or matched with nothing posted yet
                self._unposted(rank, rid, failure)
            elif write.layered is not None:
                self.stop(rank, write, failure)

    def _apply(self, rank: Rank, saves: list[tuple[int, int | None]]) -> None:
        """Apply ``saves`` (step, layer; layer None: the step ended, and it is forgotten)
        in order, then post once what they made final."""
        if not saves:
            return
        steps = self._steps.get(rank, {})
        touched: dict[str, Progress] = {}  # the requests of the steps saved, by P's request id
        changed: dict[str, None] = {}  # those a region of which became final, in order
        for step, layer in saves:
            current = steps.pop(step, None) if layer is None else steps.get(step)
            if current is None:  # a step none of whose requests is layer-wise any more
                continue
            for rid, progress in current.requests.items():
                touched[rid] = progress
                if progress.finish() if layer is None else progress.save(layer):
                    changed[rid] = None
        self._prefilled(rank, [rid for rid, progress in touched.items() if progress.complete])
        self._post_final(rank, list(changed))

    def busy(self, rank: Rank) -> bool:
        """A GPU worker's saves wait for their events."""
        return bool(self._held.get(rank))

    def hot(self, rank: Rank, now: float, hot_max_s: float) -> bool:
        """... for less than ``hot_max_s``: a GPU layer's kernels take well under a millisecond."""
        held = self._held.get(rank)
        return bool(held) and now - held[0].at < hot_max_s

    def _prefilled(self, rank: Rank, rids: list[str]) -> None:
        """Every layer of ``rids`` is final: P's prefill of them is done (the timeline keeps
        the first time, so a request marked at its last layer keeps that moment)."""
        for rid in rids:
            self._timelines.mark(rank, SEND, rid, "prefill_done")

    def drop(self, rank: Rank, rid: str) -> None:
        """``rid`` ended before its step did (evicted, refused)."""
        for step in self._steps.get(rank, {}).values():
            step.requests.pop(rid, None)

    def forget(self, rank: Rank) -> None:
        self._maps.pop(rank, None)
        self._steps.pop(rank, None)
        self._held.pop(rank, None)

    def open_steps(self, rank: Rank) -> int:
        return len(self._steps.get(rank, {}))

    # ------------------------------------------------------------------ the WRITE

    def begin(self, rank: Rank, match: Match, peer: Peer, remote_agent: str, layered: LayerPost | LayerCopy,
              now: float, started: float) -> None:
        """A layer-wise request matched: its WRITE (or same-host copy), with what is final
        now (maybe nothing)."""
        self._metrics.match_wait_seconds.observe(now - match.staged.staged_at)
        write = Write(match, [], remote_agent, layered.nbytes, now, started, layered=layered)
        self._writes(rank)[match.request_id] = write
        self._metrics.transfer_blocks.inc(layered.logical_blocks)
        log.debug("write_planned", request_id=match.request_id, peer=peer.engine_id, bytes=layered.nbytes,
                  layerwise=True, copy=isinstance(layered, LayerCopy))
        self._post_more(rank, write, now)

    def _post_final(self, rank: Rank, rids: list[str]) -> None:
        """Layers of ``rids`` became final: post what that allows of their WRITEs, and
        launch their same-host copies together (``_copy_more``)."""
        writes = self._writes(rank)
        copies: list[Write] = []
        for rid in rids:
            write = writes.get(rid)
            if write is None or not write.waiting_for_layers:
                continue
            if isinstance(write.layered, LayerCopy):
                copies.append(write)
            else:
                self._post_more(rank, write, self._now())
        if copies:
            self._copy_more(rank, copies, self._now())

    def _post_more(self, rank: Rank, write: Write, now: float) -> None:
        layered = write.layered
        assert layered is not None
        if isinstance(layered, LayerCopy):
            self._copy_more(rank, [write], now)
            return
        earlier = len(write.handles)
        handles, xstates, failed = layered.post_final(rank.agent, write.remote_agent)
        if failed:
            write.failed = ("write_submit_failed", failed)
        if handles:
            write.handles.extend(handles)
            write.posted_at = now
            self._metrics.write_parts.inc(len(handles))
            self._mark_posted(rank, write, layered.all_posted)
        # The parts posted before are checked after this post: one that landed meanwhile
        # gets its notification sent now (``post_parts``).
        self._settle(rank, write, [rank.agent.state(h) for h in write.handles[:earlier]] + xstates)
        self._wake()

    def _copy_more(self, rank: Rank, writes: list[Write], now: float) -> None:
        """Launch the copies of what is final and not copied yet of ``writes`` (same-host
        layer-wise pushes), of each whose D may still be written. Those into one D with the
        same regions ready (a step's requests, at each of its layers) go in one launch per
        KV group and run of regions (``launch_together``): a pass of 8 requests makes 32
        launches, not 256."""
        batches: dict[tuple[int, bytes], list[tuple[Write, LayerCopy]]] = {}
        live: list[Write] = []  # those not stopped here (``stop`` settles what it stops)
        for write in writes:
            copy = write.layered
            assert isinstance(copy, LayerCopy)
            ready = copy.ready()
            if len(ready):
                failure = launch_check(rank, self._peers.find_agent(write.remote_agent), copy, write.remote_agent)
                if failure is not None:
                    self.stop(rank, write, failure)
                    continue
                batches.setdefault((id(copy.plan.target), ready.tobytes()), []).append((write, copy))
            live.append(write)
        for batch in batches.values():
            firsts = [not copy.copied.any() for _, copy in batch]
            jobs, errors = launch_together([copy for _, copy in batch])
            for (write, copy), first, error in zip(batch, firsts, errors):
                if jobs:  # each of the batch waits for every launch of it: none settles before all ran
                    write.copies.extend(jobs)
                    write.posted_at = now
                    if first:
                        self._metrics.ipc_copies.inc()
                    self._mark_posted(rank, write, copy.all_posted)
                if error:
                    write.failed = ("write_submit_failed", error)
        for write in live:
            self._settle(rank, write, [])
        self._wake()

    def _mark_posted(self, rank: Rank, write: Write, last: bool) -> None:
        """The timeline's ``write_posted`` (the first piece) and ``write_all_posted`` (the
        last): after the pass, what P's loop took to post the last layer, apart from what
        the transfer took after it (``write_settled``)."""
        rid = write.match.request_id
        self._timelines.mark(rank, SEND, rid, "write_posted")
        if last:
            self._timelines.mark(rank, SEND, rid, "write_all_posted")

    def stop(self, rank: Rank, write: Write, failure: tuple[str, str]) -> None:
        """Post nothing more of a layer-wise WRITE: it fails once what was posted settled."""
        write.failed = write.failed or failure
        self._settle(rank, write, [rank.agent.state(h) for h in write.handles])

    def complete(self, rank: Rank, write: Write) -> None:
        """All of a layer-wise WRITE landed: D hears of it (the digests first, in verify
        mode), then gets the completion, as a notification of its own (a WRITE in parts
        had each part's go with it: D counted them)."""
        layered = write.layered
        assert layered is not None
        reg = write.match.registration.reg
        memory = rank.memory
        digests = layered.digests(memory) if self._verify and memory is not None else b""
        peer = self._peers.find_agent(write.remote_agent)
        if peer is not None:
            self._peers.send(peer, write_started(rank, reg, write.nbytes, digests))
        if isinstance(layered, LayerPost) and layered.parts > 1:
            return
        try:
            rank.agent.send_notif(write.remote_agent, notif.encode_completion(reg.request_id, rank.tp_size))
        except TransferError as exc:
            write.failed = ("write_failed", f"the completion could not be sent: {exc}")

    def __repr__(self) -> str:
        return f"<Layerwise ranks={len(self._steps)} steps={sum(len(s) for s in self._steps.values())}>"
