"""P, layer-wise push: which requests finish their prefill in the step being scheduled,
and every block each holds by then.

vLLM's scheduler output names a request's blocks once when it is first scheduled
(``scheduled_new_reqs``) and then only the blocks each later step adds
(``scheduled_cached_reqs.new_block_ids``; a request resumed after preemption gets all of
them again). A request's prefill ends in the step where its computed tokens plus the
step's reach its prompt: with chunked prefill that is its last chunk, whose step is the
only one the daemon needs to hear about (the KV of earlier chunks is final for every
layer by then). No vLLM import: the output is read by its attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class _Prefill:
    prompt_tokens: int
    match_key: str
    blocks: list[list[int]] = field(default_factory=list)  # per KV-cache group


@dataclass(frozen=True, slots=True)
class Finishing:
    """A request whose prefill ends in the step being scheduled."""

    blocks: list[list[int]]  # every block it holds, per KV-cache group
    match_key: str


class Prefills:
    def __init__(self) -> None:
        self._tracked: dict[str, _Prefill] = {}
        self._started: set[str] = set()  # their last step was scheduled (its SendStart in its metadata)
        self.step = 0  # the number of the last step ``finishing`` looked at

    def track(self, request_id: str, prompt_tokens: int, match_key: str) -> None:
        """``request_id`` is a P request whose KV D will take (scheduled from now on)."""
        self._tracked.setdefault(request_id, _Prefill(prompt_tokens, match_key))

    def finishing(self, output: Any) -> dict[str, Finishing]:
        """The tracked requests whose prefill ends in the step ``output`` schedules;
        ``step`` numbers that step."""
        self.step += 1
        scheduled: dict[str, int] = output.num_scheduled_tokens
        done: dict[str, Finishing] = {}
        for new in output.scheduled_new_reqs:
            prefill = self._tracked.get(new.req_id)
            if prefill is not None:
                prefill.blocks = [list(g) for g in new.block_ids]
                self._check(new.req_id, prefill, new.num_computed_tokens, scheduled, done)
        cached = output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            prefill = self._tracked.get(rid)
            if prefill is None:
                continue
            added = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:  # preempted and back: all of its blocks anew
                prefill.blocks = [list(g) for g in added or ()]
            elif added is not None:
                for g, ids in enumerate(added):
                    while len(prefill.blocks) <= g:
                        prefill.blocks.append([])
                    prefill.blocks[g].extend(ids)
            self._check(rid, prefill, cached.num_computed_tokens[i], scheduled, done)
        return done

    def _check(self, rid: str, prefill: _Prefill, computed: int, scheduled: dict[str, int],
               done: dict[str, Finishing]) -> None:
        if rid not in self._started and computed + scheduled.get(rid, 0) >= prefill.prompt_tokens:
            self._started.add(rid)
            done[rid] = Finishing([list(g) for g in prefill.blocks], prefill.match_key)

    @property
    def started(self) -> int:
        """How many requests had their last step scheduled and have not finished yet
        (``forget``): vLLM may still preempt them, the daemon may be reading their blocks."""
        return len(self._started)

    def preempted(self, request_id: str) -> bool:
        """vLLM preempted ``request_id`` (its blocks back in the pool): True if its last step
        was scheduled. It stays tracked: when it runs again, the step that ends its prefill
        starts it anew, with the blocks it holds then."""
        if request_id in self._started:
            self._started.discard(request_id)
            return True
        return False

    def forget(self, request_id: str) -> bool:
        """``request_id`` finished (or was dropped): True if its last step was scheduled."""
        self._tracked.pop(request_id, None)
        if request_id in self._started:
            self._started.discard(request_id)
            return True
        return False

    def __len__(self) -> int:
        return len(self._tracked)
