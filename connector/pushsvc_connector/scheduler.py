"""Scheduler side: which requests need KV pushed in or out, and for how long.

Pure bookkeeping over vLLM's hooks; no sockets (the worker side talks to the daemon).
D: a request with ``do_remote_prefill`` gets its uncomputed prompt tokens reserved as
"loaded asynchronously"; after allocation its registration is stashed for the next
step's metadata and a watchdog armed. P: a finished prefill with ``do_remote_decode``
keeps its blocks (delayed free) under a lease until the worker reports the push done.
The daemon runs the real lease and watchdog; these timers are a backstop that fires
later, for when the daemon cannot answer at all.

Whatever a client put in ``kv_transfer_params`` (and the request id) is checked by
``params.py`` before any hook uses it: what the worker protocol cannot carry falls back
(D prefills the request locally, P does not hold its blocks) with a warning and a count
in ``refused_requests``, never an exception inside vLLM's scheduler. Each P/D exchange
carries a match key, ``transfer_id``: the proxy's, else one P mints and returns.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from vllm.logger import init_logger

from pushsvc.protocol.worker import RegisterRecv, SendReady, SendStart
from pushsvc_connector.groups import TransferGroups
from pushsvc_connector.metadata import PushsvcMetadata
from pushsvc_connector.params import (
    Refusal,
    RemotePrefill,
    check_request_id,
    given_match_key,
    mint_match_key,
    params_of,
    remote_prefill,
)
from pushsvc_connector.prefills import Prefills
from pushsvc_connector.stats import PushsvcConnectorStats

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

log = init_logger("vllm.pushsvc_connector")

_FINISHED_OK = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")
_TRUNCATED = "_pushsvc_prompt_truncated"  # P: kv_transfer_params mark of on_new_request


class PushScheduler:
    def __init__(self, *, watchdog_s: float, lease_s: float, clock: Callable[[], float] = time.monotonic,
                 coordinates: Callable[[], dict[str, Any] | None] = lambda: None,
                 groups: TransferGroups | None = None, layerwise: bool = False) -> None:
        self.watchdog_s = watchdog_s
        # P, layer-wise push: the requests whose prefill ends in a step are told to the
        # worker in that step's metadata (``SendStart``), not after they finished.
        self._prefills = Prefills() if layerwise else None
        self._groups = groups or TransferGroups()
        # P: where D must register (the daemon's engine id and side channel), for the
        # kv_transfer_params P returns. None while the daemon cannot be asked.
        self._coordinates = coordinates
        self.lease_s = lease_s
        self._clock = clock
        self.stats = PushsvcConnectorStats()
        self._new_recvs: dict[str, RegisterRecv] = {}
        self._new_sends: dict[str, SendReady] = {}
        self._evictions: list[str] = []  # D: dropped after its registration was shipped
        self._dropped: list[str] = []  # D: dropped before its registration was shipped
        self._dropped_starts: list[str] = []  # P, layer-wise: dropped after its SendStart was scheduled
        self._failed: dict[str, list[int]] = {}  # D: allocated for a load that cannot be registered
        self._releases: list[RegisterRecv] = []  # D: takes no KV from P; P must free its blocks
        self._recv_deadlines: dict[str, float] = {}  # D: registered, not yet received
        self._send_deadlines: dict[str, float] = {}  # P: blocks held for the push

    # ------------------------------------------------------------------ D side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = params_of(request)
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        # Everything the later hooks and the worker will use is checked here, once:
        # what fails falls back to a local prefill instead of raising inside vLLM's
        # schedule() (fatal to the engine core) or reaching the daemon.
        refusal = check_request_id(request.request_id) or _refusal(remote_prefill(params))
        if refusal is not None:
            params["do_remote_prefill"] = False  # no later hook looks at these params again
            self._refused(request.request_id, refusal, "prefilling it locally")
            return 0, False
        # With a sliding-window group P stopped ``backoff`` tokens short (``on_new_request``).
        count = len(request.prompt_token_ids or ()) - self._groups.backoff - num_computed_tokens
        if count > 0:
            return count, True
        return 0, False

    # ------------------------------------------------------------------ P side

    def on_new_request(self, request: Request) -> None:
        """P, with a sliding-window group: drop the prompt's last ``backoff`` tokens before
        the prefill, which D computes itself (``groups.py`` says why). Once per request (a
        preempted request comes back with its params marked)."""
        backoff = self._groups.backoff
        params = params_of(request)
        if (not backoff or not params or not params.get("do_remote_decode") or params.get(_TRUNCATED)
                or request.prompt_token_ids is None or request.num_prompt_tokens <= backoff):
            return
        del request.prompt_token_ids[-backoff:]
        del request._all_token_ids[-backoff:]
        request.num_prompt_tokens -= backoff
        params[_TRUNCATED] = True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = params_of(request)
        if params and params.get("do_remote_decode") and self._prefills is not None and _ends_with_prefill(request):
            self._track_prefill(request, params)
        if not params or not params.get("do_remote_prefill"):
            return
        # Only the first call registers; a re-entry after the load must not.
        params["do_remote_prefill"] = False
        rid = request.request_id
        if num_external_tokens <= 0:
            # Nothing to load (with a sliding-window group, D's prefix hit reached all P
            # computed; or vLLM loads nothing for this request): D computes it itself, but
            # P holds its blocks for the exchange all the same.
            self._release(rid, params)
            return
        block_ids = self._groups.clip(blocks.get_unhashed_block_ids_all_groups())
        remote = remote_prefill(params)
        refusal = check_request_id(rid) or _refusal(remote)
        if refusal is not None or not isinstance(remote, RemotePrefill):
            # get_num_new_matched_tokens accepted the same params moments ago, so this
            # does not happen; if it did, vLLM waits for this load: fail it, never hang.
            log.error("pushsvc: request %s: cannot register the load it was promised: %s", rid[:300],
                      refusal.detail if refusal else "no coordinates")
            self._failed[rid] = [b for g in block_ids for b in g]
            return
        self._new_recvs[rid] = RegisterRecv(
            request_id=rid,
            local_block_ids=block_ids,
            remote_engine_id=remote.engine_id,
            remote_host=remote.host,
            remote_port=remote.port,
            remote_tp_size=remote.tp_size,
            match_key=self._given_match_key(rid, params),
        )
        self._recv_deadlines[rid] = self._clock() + self.watchdog_s

    def _track_prefill(self, request: Request, params: dict[str, Any]) -> None:
        """P, layer-wise: follow the request's blocks until the step that ends its prefill.
        Its match key is fixed now (the exchange's, else one minted here and kept in its
        params), since the worker hands it to the daemon before the request finishes."""
        assert self._prefills is not None
        rid = request.request_id
        if check_request_id(rid) is not None:
            return  # request_finished refuses it, counted there
        key = self._given_match_key(rid, params)
        if not key:
            key = params["transfer_id"] = mint_match_key()
        self._prefills.track(rid, request.num_prompt_tokens, key)

    # ------------------------------------------------------------------ both

    def request_finished(self, request: Request, block_ids: list[list[int]] | tuple) -> tuple[bool, dict | None]:
        params = params_of(request)
        rid = request.request_id
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Ended before it was ever scheduled on D: nothing was allocated.
            params["do_remote_prefill"] = False
            self._release(rid, params)
            return False, None
        if rid in self._recv_deadlines or rid in self._new_recvs:
            # D request dropped while its KV may still be arriving. vLLM keeps its
            # blocks until we report it finished receiving, which the worker does
            # once the daemon confirms nothing more can land in them.
            self._recv_deadlines.pop(rid, None)
            if self._new_recvs.pop(rid, None) is None:
                self._evictions.append(rid)
            else:
                self._dropped.append(rid)  # the daemon never heard of it
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        started = self._prefills is not None and self._prefills.forget(rid)
        groups = self._groups.clip(_grouped(block_ids))
        if request.status.name not in _FINISHED_OK or not any(len(g) for g in groups):
            if started:
                # Its daemon may be WRITing its blocks already: held until the worker's
                # Evict is answered, or at once by a worker whose SendStart reached no
                # daemon (the deadline set at its start stays the backstop).
                self._dropped_starts.append(rid)
                return True, None
            return False, None
        refusal = check_request_id(rid)
        if refusal is not None:
            self._refused(rid, refusal, "not holding its blocks for D")
            return False, None
        # The exchange's match key: the proxy's, else one minted here; returned to
        # whoever forwards P's params to D, so both legs carry the same one.
        key = self._given_match_key(rid, params) or mint_match_key()
        self._new_sends[rid] = SendReady(request_id=rid, block_ids=groups, match_key=key)
        self._send_deadlines[rid] = self._clock() + self.lease_s
        out: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_mode": "push",
                               "transfer_id": key}
        out.update(self._coordinates() or {})
        return True, out

    def build_connector_meta(self, scheduled_tokens: int = 1, output: Any = None) -> PushsvcMetadata:
        """This step's plan for the workers; ``output``: vLLM's ``SchedulerOutput`` (read
        only for layer-wise push)."""
        now = self._clock()
        meta = PushsvcMetadata(recvs=self._new_recvs, sends=self._new_sends, evictions=self._evictions,
                               dropped_recvs=self._dropped, failed_recvs=self._failed, releases=self._releases,
                               dropped_starts=self._dropped_starts)
        (self._new_recvs, self._new_sends, self._evictions, self._dropped, self._failed, self._releases,
         self._dropped_starts) = ({}, {}, [], [], {}, [], [])
        if self._prefills is not None and output is not None:
            # vLLM names the requests it preempted since the last step in this one's
            # output; a started one's blocks are back in the pool (``StepPlan``). First,
            # so that one resumed and ending its prefill in this very step starts anew.
            for rid in getattr(output, "preempted_req_ids", None) or ():
                if self._prefills.preempted(rid) or rid in meta.dropped_starts:
                    meta.preempted_starts.append(rid)
                    self._send_deadlines.pop(rid, None)
            for rid, ending in self._prefills.finishing(output).items():
                groups = self._groups.clip(ending.blocks)
                if any(len(g) for g in groups):
                    meta.layerwise[rid] = SendStart(request_id=rid, block_ids=groups, step=self._prefills.step,
                                                    match_key=ending.match_key)
                    self._send_deadlines[rid] = now + self.lease_s
            meta.step = self._prefills.step
        meta.expired_recvs = [r for r, t in self._recv_deadlines.items() if t <= now]
        for rid in meta.expired_recvs:
            self._recv_deadlines.pop(rid, None)
        meta.expired_sends = [r for r, t in self._send_deadlines.items() if t <= now]
        for rid in meta.expired_sends:
            del self._send_deadlines[rid]
        if meta.expired_recvs:
            self.stats.record("backstop_expiries", "recv", len(meta.expired_recvs))
        if meta.expired_sends:
            self.stats.record("backstop_expiries", "send", len(meta.expired_sends))
        meta.idle = scheduled_tokens == 0
        return meta

    def update_connector_output(self, finished_sending: Any, finished_recving: Any) -> None:
        for rid in finished_sending or ():
            self._send_deadlines.pop(rid, None)
        for rid in finished_recving or ():
            self._recv_deadlines.pop(rid, None)

    def has_pending_block_frees(self) -> bool:
        # P, layer-wise: a request whose push started still runs until vLLM processed the
        # step that ends its prefill. With async scheduling (or a pipeline-parallel P) vLLM
        # schedules the next step(s) first and, short of KV blocks, would preempt it there:
        # its blocks back in the pool at once while its daemon may be reading them. True
        # makes vLLM skip what does not fit this step instead of preempting; it is false
        # again once those requests finished (request_finished), one processed step later,
        # whatever their pushes and the daemon do (vLLM's delayed free holds them then).
        return self._prefills is not None and self._prefills.started > 0

    def has_pending_push_work(self) -> bool:
        # P's finished requests leave the running set; the engine must keep stepping
        # so the worker can report their pushes done and free the blocks.
        return bool(self._send_deadlines or self._new_sends or self._new_recvs or self._evictions
                    or self._dropped or self._failed or self._releases or self._dropped_starts)

    def take_stats(self) -> PushsvcConnectorStats | None:
        return self.stats.take()

    # ------------------------------------------------------------------ internals

    def _release(self, rid: str, params: dict[str, Any]) -> None:
        """D: the request takes no KV from P. An empty registration tells P to free the
        blocks it holds for the exchange now rather than at its lease."""
        remote = remote_prefill(params)
        refusal = check_request_id(rid) or _refusal(remote)
        if refusal is not None or not isinstance(remote, RemotePrefill):
            if refusal is not None:
                self._refused(rid, refusal, "no release sent to P")
            return
        self._releases.append(RegisterRecv(
            request_id=rid, local_block_ids=[], remote_engine_id=remote.engine_id, remote_host=remote.host,
            remote_port=remote.port, remote_tp_size=remote.tp_size, match_key=self._given_match_key(rid, params)))

    def _given_match_key(self, rid: str, params: dict[str, Any]) -> str:
        key, problem = given_match_key(params)
        if problem:
            # Never sent to the daemon (it would refuse the whole message); the request
            # goes on, paired by request id.
            log.warning("pushsvc: request %s: %s; ignoring it", rid[:300], problem)
            self.stats.record("ignored_transfer_ids")
        return key

    def _refused(self, rid: Any, refusal: Refusal, consequence: str) -> None:
        shown = rid if isinstance(rid, str) and len(rid) <= 300 else f"{str(rid)[:300]}..."
        log.warning("pushsvc: request %s: %s; %s", shown, refusal.detail, consequence)
        self.stats.record("refused_requests", refusal.reason)

    def __repr__(self) -> str:
        return (f"<PushScheduler recv={len(self._recv_deadlines)} send={len(self._send_deadlines)} "
                f"queued={len(self._new_recvs)}/{len(self._new_sends)}/{len(self._evictions)}>")


def _ends_with_prefill(request: Request) -> bool:
    """P, layer-wise: the request finishes with the token its prefill samples (the
    exchange's P leg, ``max_tokens`` 1), so vLLM can preempt it only until that step is
    processed. One that goes on decoding (a client calling P directly) or waits for more
    input (a resumable session) keeps running with its blocks preemptible (and, in a
    sliding-window group, freed as it decodes): it is pushed whole once it finished."""
    return request.max_tokens == 1 and not request.resumable


def _refusal(outcome: RemotePrefill | Refusal) -> Refusal | None:
    return outcome if isinstance(outcome, Refusal) else None


def _grouped(block_ids: list[int] | list[list[int]] | tuple) -> list[list[int]]:
    """vLLM passes one flat list for a single KV-cache group, one list per group else."""
    if len(block_ids) and isinstance(block_ids[0], int):
        return [list(block_ids)]
    return [list(g) for g in block_ids]
