"""Abort-storm driver: one process, a P worker and a D worker on two real daemons.

It drives a seeded random mix of normal pushes, client aborts at random points
(evicting either side before, during or after the other side started), duplicate
registrations (same id, same or other blocks), registrations the daemon must refuse
(blocks out of range, named twice, or held by another live request), late or foreign
completion notifications to D and late PUSH_REGs to P (sent from a NIXL agent of our
own). With ``--layerwise``, that fraction of P's requests is pushed layer by layer: they
join the open step (``SendStart``) with their blocks still holding stale bytes, each
``layer_step`` writes the next layer's final bytes of the step's live requests and says
``LayerSaved``, the last one ``StepSaved``; a layer posted before it was final would
reach D with stale bytes. It checks, as it goes:

* every request it started gets exactly one final event, never a second;
* a D block is never written while it is free: freed blocks are poisoned and the
  poison is checked when the block is handed out again and at the end;
* every ``RecvDone`` carries exactly the bytes P staged for that request.

Driven over stdin/stdout (JSON lines) like ``kvworker.py``: it prints ``{"ready": ...}``
once both workers are registered and warmed up, runs on ``go`` and prints a summary,
then waits for stdin to close (so the test can read the daemons' state while the
workers are still connected).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import sys
import time
from collections import Counter

from kvworker import KVWorker
from storm_support import FINAL, MAX_BLOCKS, POISON, Notifier, Pair, Pool, Req, tag_bytes

from pushsvc.protocol import notif
from pushsvc.protocol import worker as wp

# ---------------------------------------------------------------- the storm


class Storm:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        common = dict(rank=0, tp_size=1, layers=args.layers, block_len=args.block_len, blocks_per_logical=1, heads=0,
                      replicated=0, pp_rank=0, pp_size=1, first_layer=0, packed=0)
        self.p = KVWorker(argparse.Namespace(socket=args.p_socket, engine_id=args.p_engine, role="producer",
                                             blocks=args.p_blocks, seed=1, **common))
        self.d = KVWorker(argparse.Namespace(socket=args.d_socket, engine_id=args.d_engine, role="consumer",
                                             blocks=args.d_blocks, seed=2, **common))
        self.regions = 2 * args.layers
        self.p_pool = Pool(args.p_blocks)
        self.d_pool = Pool(args.d_blocks)
        self.live: dict[tuple[str, str], Req] = {}
        self.ended: dict[tuple[str, str], tuple[str, str]] = {}  # final event of each request
        self.pings = {"p": 0, "d": 0}
        self._fence_after_register: Pair | None = None
        self.pongs = {"p": 0, "d": 0}
        self.pairs: dict[int, Pair] = {}
        self.open_pairs: list[int] = []  # pairs with a side not yet started or still live
        self.recent_d: list[str] = []  # finished D ids, for late completions
        self.d_pair: dict[str, int] = {}  # D id -> pair number
        self.next_pair = 0
        self.ops: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.errors: list[str] = []
        self.notifier: Notifier | None = None
        self.verified = 0
        # Layer-wise push: the open step (0: none), its requests, its next layer.
        self.step_no = 0
        self.step_open = False
        self.step_reqs: list[Req] = []
        self.step_layer = 0
        self.layerwise_done = 0

    # ------------------------------------------------------------ setup

    def setup(self) -> dict:
        self.p.start()
        self.d.start()
        for b in range(self.args.d_blocks):
            self._poison(b)
        # One normal push first: the daemons handshake and UCX connects before the
        # baseline the test takes, so connection fds do not count as leaks.
        self._new_pair(order="d_first")
        pair = self.pairs[self.next_pair - 1]
        self._start_p(pair)
        self._settle_all(30.0)
        if self.live:
            raise RuntimeError(f"warm-up push did not finish: {list(self.live)}")
        self.notifier = Notifier(self.args.d_port, self.args.p_port)
        self.notifier.complete("storm-warmup-unknown")
        for _ in range(50):
            self.notifier.progress()
            time.sleep(0.01)
        self.ops.clear()
        self.outcomes.clear()
        self.verified = 0
        return {"seed": self.args.seed}

    # ------------------------------------------------------------ memory

    def _addr(self, worker: KVWorker, region: int, block: int) -> int:
        return worker.block_addr(region, block)

    def _poison(self, block: int) -> None:
        for r in range(self.regions):
            ctypes.memset(self._addr(self.d, r, block), POISON, self.args.block_len)

    def _check_poison(self, block: int, when: str) -> None:
        want = bytes([POISON]) * self.args.block_len
        for r in range(self.regions):
            if ctypes.string_at(self._addr(self.d, r, block), self.args.block_len) != want:
                self.errors.append(f"D block {block} region {r} was written while free ({when})")
                return

    def _fill_p(self, pair: Pair, blocks: list[int], regions: range | None = None, stale: bool = False) -> None:
        """P's final bytes of ``pair`` in ``regions`` (all by default) of its blocks; with
        ``stale``, bytes no request's final KV holds (what a layer holds before it is computed)."""
        n = pair.n + (1 << 30) if stale else pair.n
        for pos, b in enumerate(blocks):
            for r in regions if regions is not None else range(self.regions):
                data = tag_bytes(n, r, pos, self.args.block_len)
                ctypes.memmove(self._addr(self.p, r, b), data, len(data))

    def _verify_recv(self, pair: Pair, d: Req) -> None:
        p = pair.p
        if p is None or not p.owned:
            self.errors.append(f"RecvDone for {d.rid} but P never staged a valid request")
            return
        m, k = len(p.blocks), len(d.blocks)
        for i, b in enumerate(d.blocks):
            for r in range(self.regions):
                want = tag_bytes(pair.n, r, m - k + i, self.args.block_len)
                if ctypes.string_at(self._addr(self.d, r, b), self.args.block_len) != want:
                    self.errors.append(f"RecvDone for {d.rid}: D block {b} region {r} holds the wrong bytes")
                    return
        self.verified += 1

    # ------------------------------------------------------------ requests

    def _new_pair(self, order: str) -> None:
        n = self.next_pair
        self.next_pair += 1
        base = f"storm-{n}-0"
        pair = Pair(n, f"{base}-{self.rng.getrandbits(32):08x}", f"{base}-{self.rng.getrandbits(32):08x}")
        self.pairs[n] = pair
        self.open_pairs.append(n)
        if order == "d_first":
            self._start_d(pair)
        else:
            self._start_p(pair)

    def _start_p(self, pair: Pair) -> bool:
        # P holds at least as many blocks as D registered: D's are the tail of P's.
        least = len(pair.d.blocks) if pair.d is not None and pair.d.owned else 0
        m = self.rng.randint(max(1, least), MAX_BLOCKS)
        blocks = self.p_pool.take(self.rng, m, pair.p_rid)
        if blocks is None:
            return False
        layerwise = self.rng.random() < self.args.layerwise
        self._fill_p(pair, blocks, stale=layerwise)
        pair.p = Req("p", pair.p_rid, pair.n, blocks, started_at=time.monotonic(), layerwise=layerwise)
        self.live[("p", pair.p_rid)] = pair.p
        if not layerwise:
            self.p.client.send(wp.SendReady(request_id=pair.p_rid, block_ids=[blocks]))
            return True
        if not self.step_open:
            self.step_no, self.step_open, self.step_reqs, self.step_layer = self.step_no + 1, True, [], 0
        self.step_reqs.append(pair.p)
        self.p.client.send(wp.SendStart(request_id=pair.p_rid, block_ids=[blocks], step=self.step_no))
        return True

    def _op_layer_step(self, live_p, live_d, half) -> bool:
        """The open step's forward pass computes its next layer (the last one ends it)."""
        if not self.step_open:
            return False
        layer = self.step_layer
        for req in self.step_reqs:
            if not req.final:  # a request that ended gave its blocks back: never written again
                self._fill_p(self.pairs[req.pair], req.blocks, range(2 * layer, 2 * layer + 2))
        self.p.client.send(wp.LayerSaved(step=self.step_no, layer=layer))
        self.step_layer += 1
        if self.step_layer == self.args.layers:
            self._end_step()
        return True

    def _end_step(self) -> None:
        """Every layer of the step's requests is final (those that joined after its first
        layers get them now), then ``StepSaved``."""
        for req in self.step_reqs:
            if not req.final:
                self._fill_p(self.pairs[req.pair], req.blocks)
        self.p.client.send(wp.StepSaved(step=self.step_no))
        self.step_open, self.step_reqs = False, []

    def _start_d(self, pair: Pair, bad: str = "") -> bool:
        # D holds at most as many blocks as P will (prefix hits on D: fewer); 0 now
        # and then, which only releases P.
        k = 0 if self.rng.random() < 0.03 else self.rng.randint(1, MAX_BLOCKS if pair.p is None else len(pair.p.blocks))
        if pair.p is not None and pair.p.owned:
            k = min(k, len(pair.p.blocks))
        req = Req("d", pair.d_rid, pair.n, [], started_at=time.monotonic())
        if bad:
            req.owned, req.expect_reject = False, True
            req.blocks = self._bad_blocks(bad)
            if req.blocks is None:
                return False
        else:
            blocks = self.d_pool.take(self.rng, k, pair.d_rid)
            if blocks is None:
                return False
            for b in blocks:
                self._check_poison(b, "handed out")
            req.blocks = blocks
        pair.d = req
        if not req.blocks and not bad:
            # A release: D's daemon tracks nothing for it and its worker hears nothing;
            # only P's request ends (released, or by its own fate).
            req.final, req.owned = "released", False
            self.outcomes["d:released"] += 1
        else:
            self.live[("d", pair.d_rid)] = req
        self._register(pair.d_rid, req.blocks)
        if self._fence_after_register is not None:  # the holder stays live until D read this
            self._fence(self._fence_after_register, "d")
            self._fence_after_register = None
        return True

    def _bad_blocks(self, kind: str) -> list[int] | None:
        if kind == "out_of_range":
            return [self.rng.randrange(self.args.d_blocks, self.args.d_blocks + 1000)]
        if kind == "twice":
            b = self.rng.randrange(self.args.d_blocks)
            return [b, b]
        # "held": a block of a live request the daemon cannot have ended yet.
        holders = self._unmatched([r for r in self.live.values() if r.side == "d" and r.owned and r.blocks])
        if not holders:
            return None
        holder = self.rng.choice(holders)
        self._fence_after_register = self.pairs[holder.pair]
        return [self.rng.choice(holder.blocks)]

    def _register(self, rid: str, blocks: list[int]) -> None:
        self.d.client.send(wp.RegisterRecv(
            request_id=rid, local_block_ids=[blocks], remote_engine_id=self.args.p_engine,
            remote_host="127.0.0.1", remote_port=self.args.p_port))

    # ------------------------------------------------------------ operations

    def step(self) -> bool:
        """One random operation; False if none applies right now."""
        live_p = [r for r in self.live.values() if r.side == "p"]
        live_d = [r for r in self.live.values() if r.side == "d" and r.owned]
        half = [self.pairs[n] for n in self.open_pairs
                if (self.pairs[n].p is None) != (self.pairs[n].d is None) and self._fence_passed(self.pairs[n])]
        choices: list[tuple[str, float]] = [("new_pair", 30), ("bad_registration", 3), ("late_completion", 4),
                                            ("late_push_reg", 3), ("evict_finished", 2)]
        if half:
            choices.append(("start_other_side", 30))
        if self.step_open:
            choices.append(("layer_step", 20))
        if live_d:
            choices += [("evict_d", 8), ("foreign_completion", 2)]
        if live_p:
            choices.append(("evict_p", 8))
        if self._unmatched(live_d):
            choices += [("dup_d_same", 3), ("dup_d_other", 3)]
        if self._unmatched(live_p):
            choices += [("dup_p_same", 3), ("dup_p_other", 2)]
        ops, weights = zip(*choices)
        op = self.rng.choices(ops, weights)[0]
        done = getattr(self, f"_op_{op}")(live_p, live_d, half)
        if done:
            self.ops[op] += 1
        return done

    def _fence(self, pair: Pair, side: str) -> None:
        self.pings[side] += 1
        (self.p if side == "p" else self.d).client.send(wp.Ping(token=self.pings[side]))
        pair.fence = (side, self.pings[side])

    def _fence_passed(self, pair: Pair) -> bool:
        return pair.fence is None or self.pongs[pair.fence[0]] >= pair.fence[1]

    def _unmatched(self, live: list[Req]) -> list[Req]:
        """Live requests the daemon cannot have ended yet: the other side never started,
        they were not evicted, and their lease or watchdog (3 s) is far off (sent under
        0.5 s ago). A duplicate of one of these is a duplicate for the daemon too; one
        that reached the daemon after the request ended would be a new request under a
        reused id, which the daemon rightly answers on its own."""
        now = time.monotonic()
        out = []
        for r in live:
            pair = self.pairs[r.pair]
            other = pair.d if r.side == "p" else pair.p
            if other is None and not r.evicted and now - r.started_at < 0.5:
                out.append(r)
        return out

    def _op_new_pair(self, live_p, live_d, half) -> bool:
        before = self.next_pair
        order = self.rng.choice(["d_first", "p_first"])
        n = self.next_pair
        self.next_pair += 1
        base = f"storm-{n}-0"
        pair = Pair(n, f"{base}-{self.rng.getrandbits(32):08x}", f"{base}-{self.rng.getrandbits(32):08x}")
        started = self._start_d(pair) if order == "d_first" else self._start_p(pair)
        if not started:
            self.next_pair = before
            return False
        self.pairs[n] = pair
        self.open_pairs.append(n)
        req = pair.d if order == "d_first" else pair.p
        if req is None or (req.side, req.rid) not in self.live:
            return True  # a release: nothing of it is tracked to abort or repeat
        roll = self.rng.random()
        if roll < 0.1:  # abort right away: a PUSH_REG may race its cancel
            (self._evict_d if order == "d_first" else self._evict_p)(pair)
        elif roll < 0.2:  # the same request again, right behind the first
            self._duplicate(req, same=self.rng.random() < 0.5)
        return True

    def _op_start_other_side(self, live_p, live_d, half) -> bool:
        # Mostly the other half of a live request (a push, or an abort mid-way); now
        # and then that of one that already ended (a late half, left to the timers).
        fresh = [p for p in half if not (p.d or p.p).final]
        pair = self.rng.choice(fresh if fresh and self.rng.random() < 0.85 else half)
        started = self._start_d(pair) if pair.d is None else self._start_p(pair)
        self._forget_stale_halves()
        return started

    def _forget_stale_halves(self) -> None:
        """Pairs whose one started side ended over a second ago never start the other:
        the list of open pairs stays short however long the storm runs."""
        now = time.monotonic()
        for n in list(self.open_pairs):
            pair = self.pairs[n]
            side = pair.d if pair.p is None else pair.p if pair.d is None else None
            if side is not None and side.final and now - side.ended_at > 1.0:
                self.open_pairs.remove(n)

    def _op_bad_registration(self, live_p, live_d, half) -> bool:
        n = self.next_pair
        pair = Pair(n, f"storm-{n}-p", f"storm-{n}-bad")
        if not self._start_d(pair, bad=self.rng.choice(["out_of_range", "twice", "held"])):
            return False
        self.next_pair += 1
        self.pairs[n] = pair
        return True

    def _op_evict_d(self, live_p, live_d, half) -> bool:
        self._evict_d(self.pairs[self.rng.choice(live_d).pair])
        return True

    def _op_evict_p(self, live_p, live_d, half) -> bool:
        self._evict_p(self.pairs[self.rng.choice(live_p).pair])
        return True

    def _evict_d(self, pair: Pair) -> None:
        pair.d.evicted = True
        self.d.client.send(wp.Evict(request_ids=[pair.d_rid]))

    def _evict_p(self, pair: Pair) -> None:
        pair.p.evicted = True
        self.p.client.send(wp.Evict(request_ids=[pair.p_rid]))

    def _op_evict_finished(self, live_p, live_d, half) -> bool:
        done = [p for p in self.pairs.values() if p.p is not None and p.p.final and p.d is not None and p.d.final]
        if not done:
            return False
        pair = self.rng.choice(done[-64:])
        self.p.client.send(wp.Evict(request_ids=[pair.p_rid]))
        self.d.client.send(wp.Evict(request_ids=[pair.d_rid]))
        return True

    def _op_dup_d_same(self, live_p, live_d, half) -> bool:
        self._duplicate(self.rng.choice(self._unmatched(live_d)), same=True)
        return True

    def _op_dup_d_other(self, live_p, live_d, half) -> bool:
        self._duplicate(self.rng.choice(self._unmatched(live_d)), same=False)
        return True

    def _op_dup_p_same(self, live_p, live_d, half) -> bool:
        self._duplicate(self.rng.choice(self._unmatched(live_p)), same=True)
        return True

    def _op_dup_p_other(self, live_p, live_d, half) -> bool:
        self._duplicate(self.rng.choice(self._unmatched(live_p)), same=False)
        return True

    def _duplicate(self, req: Req, same: bool) -> None:
        """Send ``req`` again under its id. Other blocks are free ones (they stay
        poisoned unless the daemon wrongly writes into them), out of range ones, or
        one block twice: the daemon must ignore all of them as a duplicate."""
        size = self.args.d_blocks if req.side == "d" else self.args.p_blocks
        pool = self.d_pool if req.side == "d" else self.p_pool
        if same:
            blocks = req.blocks
        else:
            roll = self.rng.random()
            if roll < 0.5 and pool.free:
                blocks = self.rng.sample(pool.free, min(len(pool.free), self.rng.randint(1, MAX_BLOCKS)))
            elif roll < 0.75:
                blocks = [size + self.rng.randrange(100)]
            else:
                blocks = [self.rng.randrange(size)] * 2
        if req.side == "d":
            self._register(req.rid, blocks)
        else:
            self.p.client.send(wp.SendReady(request_id=req.rid, block_ids=[blocks]))
        self._fence(self.pairs[req.pair], req.side)

    def _op_late_completion(self, live_p, live_d, half) -> bool:
        rid = self.rng.choice(self.recent_d) if self.recent_d else f"storm-never-{self.rng.getrandbits(16)}"
        self.notifier.complete(rid)
        return True

    def _op_late_push_reg(self, live_p, live_d, half) -> bool:
        # D's own PUSH_REG for a request that ended (withdrawn, refused or served),
        # arriving late from an agent P does not know: P must never WRITE for it, even
        # if P's half of the pair is staged now or later (its blocks are another
        # request's by now, and the poison check would see the WRITE).
        if not self.recent_d:
            return False
        pair = self.pairs[self.d_pair[self.rng.choice(self.recent_d)]]
        self.notifier.push_reg(notif.PushReg(
            request_id=pair.d_rid, decode_engine_id=self.args.d_engine, decode_host="127.0.0.1",
            decode_port=self.args.d_port, decode_tp_size=1, local_block_ids=[pair.d.blocks],
            remote_engine_id=self.args.p_engine, remote_host="127.0.0.1", remote_port=self.args.p_port,
            remote_tp_size=1))
        return True

    def _op_foreign_completion(self, live_p, live_d, half) -> bool:
        self.notifier.complete(self.rng.choice(live_d).rid)
        return True

    # ------------------------------------------------------------ events

    def poll(self) -> int:
        got = 0
        for side, worker in (("p", self.p), ("d", self.d)):
            for event in worker.client.poll():
                got += 1
                self._on_event(side, event)
        return got

    def _on_event(self, side: str, event) -> None:
        kind = type(event).__name__
        if kind == "Pong":
            self.pongs[side] = max(self.pongs[side], event.token)
            return
        rid = getattr(event, "request_id", "")
        if kind not in FINAL:
            self.errors.append(f"unexpected {kind} on {side}: {event}")
            return
        reason = getattr(event, "reason", "")
        req = self.live.pop((side, rid), None)
        if req is None:
            before = self.ended.get((side, rid))
            self.errors.append(f"{kind} ({reason}) for {side} request {rid} that is not live: "
                               f"{'it ended before in ' + repr(before) if before else 'never started'}")
            return
        self.ended[(side, rid)] = (kind, reason)
        req.final, req.reason, req.ended_at = kind, reason, time.monotonic()
        reason_class = reason.split(":")[0].split(" ")[0] if reason else "ok"
        self.outcomes[f"{side}:{kind}:{reason_class}"] += 1
        pair = self.pairs[req.pair]
        if req.expect_reject:
            if kind != "RecvFailed" or not reason.startswith("registration:"):
                self.errors.append(f"{rid}: a registration the daemon must refuse ended in {kind} ({reason})")
            return
        if side == "p":
            self.p_pool.give_back(req.blocks, rid)
        else:
            if kind == "RecvDone":
                self._verify_recv(pair, req)
                self.layerwise_done += bool(pair.p is not None and pair.p.layerwise)
            elif sorted(event.block_ids) != sorted(req.blocks):
                self.errors.append(f"RecvFailed for {rid} names blocks {event.block_ids}, not {req.blocks}")
            for b in req.blocks:
                self._poison(b)
            self.d_pool.give_back(req.blocks, rid)
            self.recent_d.append(rid)
            self.d_pair[rid] = pair.n
            del self.recent_d[:-64]
        if (pair.p is None or pair.p.final) and (pair.d is None or pair.d.final):
            if pair.n in self.open_pairs and pair.p is not None and pair.d is not None:
                self.open_pairs.remove(pair.n)

    def _settle_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.live and time.monotonic() < deadline:
            if not self.poll():
                if self.notifier is not None:
                    self.notifier.progress()
                time.sleep(0.002)

    # ------------------------------------------------------------ run

    def run(self) -> dict:
        t0 = time.perf_counter()
        done = 0
        idle = 0
        while done < self.args.ops:
            # Paced, so that operations land while earlier ones are in every state
            # (staged, matched, writing, cancelling), not all before the daemons look.
            ahead = done / self.args.rate - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)
            if self.step():
                done += 1
            else:
                idle += 1
                time.sleep(0.001)
            self.poll()
            if done % 64 == 0:
                self.notifier.progress()
        storm_s = time.perf_counter() - t0
        if self.step_open:  # the last forward pass ends
            self._end_step()
        # Abort whatever is still open (a pair with one side never started is
        # started and aborted too, so both sides end), then wait for every final event.
        for n in list(self.open_pairs):
            pair = self.pairs[n]
            if pair.p is not None and not pair.p.final:
                self._evict_p(pair)
            if pair.d is not None and not pair.d.final:
                self._evict_d(pair)
        self._settle_all(60.0)
        for (side, rid), req in self.live.items():
            self.errors.append(f"{side} request {rid} never got a final event")
        for b in self.d_pool.free:
            self._check_poison(b, "at the end")
        # Pushes D confirmed must have been confirmed to P too.
        for pair in self.pairs.values():
            if pair.d and pair.d.final == "RecvDone" and pair.d.blocks and (pair.p is None or pair.p.final != "SendDone"):
                self.errors.append(f"D got RecvDone for {pair.d_rid} but P ended in {pair.p.final if pair.p else None}")
        total_s = time.perf_counter() - t0
        return {
            "seed": self.args.seed,
            "ops": sum(self.ops.values()),
            "storm_s": round(storm_s, 3),
            "total_s": round(total_s, 3),
            "ops_per_s": round(sum(self.ops.values()) / storm_s, 1),
            "pairs": self.next_pair,
            "idle_steps": idle,
            "verified_recv_done": self.verified,
            "layerwise_recv_done": self.layerwise_done,
            "notifier_sent": self.notifier.sent,
            "op_counts": dict(sorted(self.ops.items())),
            "outcomes": dict(sorted(self.outcomes.items())),
            "errors": self.errors[:50],
            "error_count": len(self.errors),
        }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--p-socket", required=True)
    p.add_argument("--d-socket", required=True)
    p.add_argument("--p-engine", default="prefill")
    p.add_argument("--d-engine", default="decode")
    p.add_argument("--p-port", type=int, required=True, help="P daemon's side-channel port")
    p.add_argument("--d-port", type=int, required=True, help="D daemon's side-channel port")
    p.add_argument("--ops", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, default=1000.0, help="operations per second, at most")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--layerwise", type=float, default=0.0, help="the fraction of P's requests pushed layer by layer")
    p.add_argument("--p-blocks", type=int, default=160)
    p.add_argument("--d-blocks", type=int, default=160)
    p.add_argument("--block-len", type=int, default=4096)
    args = p.parse_args()
    storm = Storm(args)
    out = sys.stdout
    out.write(json.dumps({"ready": storm.setup()}) + "\n")
    out.flush()
    if sys.stdin.readline().strip() != "go":
        return 1
    out.write(json.dumps({"summary": storm.run()}) + "\n")
    out.flush()
    sys.stdin.read()  # hold the workers' connections until the test is done looking
    storm.notifier.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
