"""Scheduler side: which requests need KV pushed in or out, and for how long.

Pure bookkeeping over vLLM's hooks; no sockets (the worker side talks to the daemon).
D: a request with ``do_remote_prefill`` gets its uncomputed prompt tokens reserved as
"loaded asynchronously"; after allocation its registration is stashed for the next
step's metadata and a watchdog armed. P: a finished prefill with ``do_remote_decode``
keeps its blocks (delayed free) under a lease until the worker reports the push done.
The daemon runs the real lease and watchdog; these timers are a backstop that fires
later, for when the daemon cannot answer at all.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from pushsvc.protocol.worker import RegisterRecv
from pushsvc_connector.metadata import PushsvcMetadata

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

_FINISHED_OK = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


class PushScheduler:
    def __init__(self, *, watchdog_s: float, lease_s: float, clock: Callable[[], float] = time.monotonic,
                 coordinates: Callable[[], dict[str, Any] | None] = lambda: None) -> None:
        self.watchdog_s = watchdog_s
        # P: where D must register (the daemon's engine id and side channel), for the
        # kv_transfer_params P returns. None while the daemon cannot be asked.
        self._coordinates = coordinates
        self.lease_s = lease_s
        self._clock = clock
        self._new_recvs: dict[str, RegisterRecv] = {}
        self._new_sends: dict[str, list[list[int]]] = {}
        self._evictions: list[str] = []
        self._dropped: list[str] = []  # D: dropped before its registration was shipped
        self._releases: list[RegisterRecv] = []  # D: never scheduled; P must free its blocks
        self._recv_deadlines: dict[str, float] = {}  # D: registered, not yet received
        self._send_deadlines: dict[str, float] = {}  # P: blocks held for the push

    # ------------------------------------------------------------------ D side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        # Only the first call registers; a re-entry after the load must not.
        params["do_remote_prefill"] = False
        if num_external_tokens <= 0:
            return  # full prefix hit on D: nothing to receive
        rid = request.request_id
        self._new_recvs[rid] = RegisterRecv(
            request_id=rid,
            local_block_ids=[list(g) for g in blocks.get_unhashed_block_ids_all_groups()],
            remote_engine_id=str(params["remote_engine_id"]),
            remote_host=str(params["remote_host"]),
            remote_port=int(params["remote_port"]),
            remote_tp_size=int(params.get("remote_tp_size", params.get("tp_size", 1))),
        )
        self._recv_deadlines[rid] = self._clock() + self.watchdog_s

    # ------------------------------------------------------------------ both

    def request_finished(self, request: Request, block_ids: list[list[int]] | tuple) -> tuple[bool, dict | None]:
        params = request.kv_transfer_params
        rid = request.request_id
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Ended before it was ever scheduled on D: nothing was allocated. An empty
            # registration tells P to free its blocks now rather than at its lease.
            params["do_remote_prefill"] = False
            if all(k in params for k in ("remote_engine_id", "remote_host", "remote_port")):
                self._releases.append(RegisterRecv(
                    request_id=rid, local_block_ids=[], remote_engine_id=str(params["remote_engine_id"]),
                    remote_host=str(params["remote_host"]), remote_port=int(params["remote_port"]),
                    remote_tp_size=int(params.get("remote_tp_size", params.get("tp_size", 1)))))
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
        groups = _grouped(block_ids)
        if request.status.name not in _FINISHED_OK or not any(len(g) for g in groups):
            return False, None
        self._new_sends[rid] = groups
        self._send_deadlines[rid] = self._clock() + self.lease_s
        out: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_mode": "push"}
        out.update(self._coordinates() or {})
        return True, out

    def build_connector_meta(self, scheduled_tokens: int = 1) -> PushsvcMetadata:
        now = self._clock()
        meta = PushsvcMetadata(recvs=self._new_recvs, sends=self._new_sends, evictions=self._evictions,
                               dropped_recvs=self._dropped, releases=self._releases)
        self._new_recvs, self._new_sends, self._evictions, self._dropped, self._releases = {}, {}, [], [], []
        meta.expired_recvs = [r for r, t in self._recv_deadlines.items() if t <= now]
        for rid in meta.expired_recvs:
            self._recv_deadlines.pop(rid, None)
        meta.expired_sends = [r for r, t in self._send_deadlines.items() if t <= now]
        for rid in meta.expired_sends:
            del self._send_deadlines[rid]
        meta.idle = scheduled_tokens == 0
        return meta

    def update_connector_output(self, finished_sending: Any, finished_recving: Any) -> None:
        for rid in finished_sending or ():
            self._send_deadlines.pop(rid, None)
        for rid in finished_recving or ():
            self._recv_deadlines.pop(rid, None)

    def has_pending_push_work(self) -> bool:
        # P's finished requests leave the running set; the engine must keep stepping
        # so the worker can report their pushes done and free the blocks.
        return bool(self._send_deadlines or self._new_sends or self._new_recvs or self._evictions
                    or self._dropped or self._releases)

    def __repr__(self) -> str:
        return (f"<PushScheduler recv={len(self._recv_deadlines)} send={len(self._send_deadlines)} "
                f"queued={len(self._new_recvs)}/{len(self._new_sends)}/{len(self._evictions)}>")


def _grouped(block_ids: list[int] | list[list[int]] | tuple) -> list[list[int]]:
    """vLLM passes one flat list for a single KV-cache group, one list per group else."""
    if len(block_ids) and isinstance(block_ids[0], int):
        return [list(block_ids)]
    return [list(g) for g in block_ids]
