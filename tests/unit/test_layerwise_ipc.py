"""Layer-wise push into a same-host D, with the device faked: D offers its worker's KV, P
maps it, and a request that P's worker starts layer by layer (``SendStart``) is copied by
P into D's blocks layer by layer, each layer once its event is done, never before (the
fake copy moves the bytes at its launch, so an early launch would carry the layer's old
bytes). Also every way such a push can end mid-pass: nothing more is copied, and nothing
outside the request's blocks ever changes.

The same flow runs on a real GPU in ``tests/gpu/``."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
from daemon_fixtures import assert_tables_empty, metric, wait_until
from gpu_fixtures import UUID
from layer_fixtures import (LAYERS, landed, layer_pair, others_untouched, recv_into, same_host_met, stop_mid_step,
                            untouched)

from pushsvc.protocol import worker as wp


def _registration(p, rid: str):
    rank = p.service.ranks.current[0]
    regs = {r.request_id: r.reg for r in p.service.sender._of(rank).table.registrations.values()}
    return regs.get(rid)


async def _copy_asked(p, dw, rid: str, blocks: list[int]) -> None:
    recv_into(p, dw, rid, blocks)
    await wait_until(lambda: _registration(p, rid) is not None, "the PUSH_REG at P")
    assert _registration(p, rid).ipc, "D asks for a same-host copy"


def _copy_of(p, rid: str):
    """P's same-host layer-wise push of ``rid`` (its ``Write``), if there is one."""
    rank = p.service.ranks.current[0]
    return p.service.sender._of(rank).writes.get(rid)


async def _started(p, dw, pw, plan: dict[str, tuple[list[int], list[int]]], step: int) -> None:
    """Each request of ``plan`` (P's blocks, D's blocks) asks for a same-host copy and
    starts in ``step``, and P has its layer-wise copy."""
    for rid, (_, d_blocks) in plan.items():
        await _copy_asked(p, dw, rid, d_blocks)
    for rid, (p_blocks, _) in plan.items():
        pw.send(wp.SendStart(request_id=rid, block_ids=[p_blocks], step=step))
    await wait_until(lambda: all(_copy_of(p, rid) is not None for rid in plan), "every copy at P")


async def _final(pw, step: int, layer: int) -> None:
    """Layer ``layer`` of ``step`` is saved and its kernels ran."""
    pw.events[layer].record()
    pw.send(wp.LayerSaved(step=step, layer=layer))
    await pw.ping(100 + layer)
    pw.events[layer].finish()


@pytest.mark.asyncio
async def test_each_layer_is_copied_into_ds_kv_once_its_event_is_done() -> None:
    async with layer_pair(gpu=True, same_host=True) as (p, d, pw, dw):
        await same_host_met(p, d, pw, dw)
        device = p.service.devmem.device(UUID)
        parts, copies = metric(p, "pushsvc_write_parts_total"), device.pair_copies
        p_blocks, d_blocks = [2, 5], [9, 1]
        await _copy_asked(p, dw, "r", d_blocks)
        pw.send(wp.SendStart(request_id="r", block_ids=[p_blocks], step=3))
        for layer in range(LAYERS):
            pw.events[layer].record()  # the layer's kernels are queued ...
            pw.send(wp.LayerSaved(step=3, layer=layer))
            await pw.ping(layer)
            pw.compute(layer, p_blocks, salt=60 + layer)  # ... and write its final KV
            await dw.quiet_for(0.02)  # no completion before the last layer
            assert device.pair_copies == copies + layer, f"layer {layer} copied before its event was done"
            assert all(untouched(dw, d_blocks, n) for n in range(layer, LAYERS))
            pw.events[layer].finish()
            await wait_until(lambda: landed(pw, dw, p_blocks, d_blocks, layer), f"layer {layer} in D's blocks")
            assert device.pair_copies == copies + layer + 1, "one copy per layer"
        assert await dw.wait_for(wp.RecvDone, "r")
        assert await pw.wait_for(wp.SendDone, "r")
        assert all(landed(pw, dw, p_blocks, d_blocks, n) for n in range(LAYERS))
        assert others_untouched(dw, d_blocks)
        assert metric(p, "pushsvc_write_parts_total") == parts, "no NIXL WRITE"
        assert metric(p, "pushsvc_ipc_copies_total") == 1
        events = p.service.timelines.recent(1, "r")[0]["events_ms"]
        assert sorted(events, key=events.get)[:5] == ["send_start", "matched", "write_posted", "prefill_done",
                                                      "write_all_posted"]
        pw.events[-1].record()
        pw.send(wp.StepSaved(step=3))
        pw.events[-1].finish()
        await assert_tables_empty(p, d)


@pytest.mark.asyncio
async def test_the_step_end_copies_what_no_layer_did_and_verify_checks_the_bytes() -> None:
    async with layer_pair(gpu=True, same_host=True, verify=True) as (p, d, pw, dw):
        await same_host_met(p, d, pw, dw)
        device = p.service.devmem.device(UUID)
        copies = device.pair_copies
        pw.send(wp.SendStart(request_id="v", block_ids=[[4, 6, 7]], step=8))
        await pw.ping(1)
        recv_into(p, dw, "v", [3, 10, 11])  # matched mid-step, a copy asked for, nothing final
        await wait_until(lambda: _copy_of(p, "v") is not None, "the layer-wise copy at P")
        assert _copy_of(p, "v").match.registration.reg.ipc
        pw.events[-1].record()
        pw.send(wp.StepSaved(step=8))  # layers without a LayerSaved are final at the step's end ...
        await pw.ping(2)
        await dw.quiet_for(0.05)
        assert device.pair_copies == copies
        assert all(untouched(dw, [3, 10, 11], n) for n in range(LAYERS))
        for layer in range(LAYERS):
            pw.compute(layer, [4, 6, 7], salt=100 + layer)
        pw.events[-1].finish()  # ... once its event says the pass ran: every region, in one launch
        assert await dw.wait_for(wp.RecvDone, "v")
        assert all(landed(pw, dw, [4, 6, 7], [3, 10, 11], n) for n in range(LAYERS))
        assert device.pair_copies == copies + 1
        assert metric(d, "pushsvc_verify_total", result="identical") == 2  # "first" and "v"
        assert metric(p, "pushsvc_ipc_copies_total") == 1
        await assert_tables_empty(p, d)


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["p_evicts", "p_worker_leaves", "d_withdraws", "event_fails", "d_daemon_gone",
                                 "d_silent", "d_kv_withdrawn", "launch_fails"])
async def test_a_push_ended_mid_pass_copies_nothing_more_and_nothing_elsewhere(how: str) -> None:
    async with layer_pair(gpu=True, same_host=True) as (p, d, pw, dw):
        await same_host_met(p, d, pw, dw)
        device = p.service.devmem.device(UUID)
        copies = device.pair_copies
        p_blocks, d_blocks = [1, 3], [6, 8]
        await _copy_asked(p, dw, "x", d_blocks)
        pw.send(wp.SendStart(request_id="x", block_ids=[p_blocks], step=5))
        pw.compute(0, p_blocks, salt=20)
        await _final(pw, 5, 0)
        await wait_until(lambda: landed(pw, dw, p_blocks, d_blocks, 0), "layer 0 in D's blocks")
        rank = p.service.ranks.current[0]
        if how in ("p_evicts", "p_worker_leaves", "d_withdraws"):
            await stop_mid_step(how, pw, dw, "x", d_blocks)
        elif how == "event_fails":
            pw.events[1].record()
            pw.send(wp.LayerSaved(step=5, layer=1))
            await pw.ping(1)
            pw.events[1].fault()  # the worker's context failed: its layers are never known final
            failed = await pw.wait_for(wp.SendFailed, "x")
            assert failed.reason.startswith("layer_event: the worker's layer event failed"), failed
            event = await dw.wait_for(wp.RecvFailed, "x")
            assert "layer_event" in event.reason, event
        elif how == "d_daemon_gone":  # while the layers compute: P copies nothing more into its KV
            peer = p.service.peers.find_engine(d.config.engine_id)
            d.request_exit(force=True)
            await d.shutdown()
            await wait_until(lambda: not peer.alive, "D's daemon seen gone at P")
        elif how == "d_silent":  # P's fence is checked at every launch, not only at the match
            p.service.peers.find_engine(d.config.engine_id).heard_at = time.monotonic() - 10
        elif how == "d_kv_withdrawn":  # D took its KV offer back (its worker's KV went)
            rank.remotes.ipc.withdraw(d.service.ranks.current[0].agent.name)
        else:
            p.service.devmem.fail_launches = True
        if how not in ("p_worker_leaves", "event_fails"):
            for layer in range(1, LAYERS):
                pw.compute(layer, p_blocks, salt=40)
            await _final(pw, 5, 1)
            pw.events[-1].record()
            pw.send(wp.StepSaved(step=5))
            pw.events[-1].finish()
            await pw.ping(2)
        expected = {"d_daemon_gone": "peer_lost: D's daemon went away before the last layer was final",
                    "d_silent": "ipc_fence: nothing heard from D's daemon",
                    "d_kv_withdrawn": "ipc_unavailable: D withdrew its KV before the last layer was final",
                    "launch_fails": "write_submit_failed: cuLaunchKernel failed"}.get(how)
        if expected is not None:
            failed = await pw.wait_for(wp.SendFailed, "x")
            assert failed.reason.startswith(expected), failed
            if how != "d_daemon_gone":
                assert expected.split(":")[0] in (await dw.wait_for(wp.RecvFailed, "x")).reason
        assert device.pair_copies == copies + 1, "layer 0 only"
        assert all(untouched(dw, d_blocks, n) for n in range(1, LAYERS))
        assert others_untouched(dw, d_blocks)
        assert metric(p, "pushsvc_transfers_total", result="failed") == 1
        assert p.service.sender.writes_in_flight() == 0
        await assert_tables_empty(p, *([d] if how != "d_daemon_gone" else []))


@pytest.mark.asyncio
async def test_requests_finishing_in_one_step_are_each_copied_into_their_own_blocks() -> None:
    """Two requests finish their prefill in one step, into one D: each layer's event
    launches one copy for both (their pairs in one launch), each request's KV lands in its
    own blocks only (never in the other's), and both complete once their last layer is
    copied."""
    async with layer_pair(gpu=True, same_host=True, verify=True) as (p, d, pw, dw):
        await same_host_met(p, d, pw, dw)
        device = p.service.devmem.device(UUID)
        copies = device.pair_copies
        plan = {"a": ([0, 4], [2, 7]), "b": ([6, 1, 5], [11, 3, 10])}
        await _started(p, dw, pw, plan, step=9)
        for layer in range(LAYERS):
            for i, (p_blocks, _) in enumerate(plan.values()):
                pw.compute(layer, p_blocks, salt=30 * i + layer)
            await _final(pw, 9, layer)
            await wait_until(lambda: all(landed(pw, dw, pb, db, layer) for pb, db in plan.values()),
                             f"layer {layer} of both in D's blocks")
            assert device.pair_copies == copies + layer + 1, "one launch per layer for both requests"
        for rid in plan:
            assert await dw.wait_for(wp.RecvDone, rid)
            assert await pw.wait_for(wp.SendDone, rid)
        for p_blocks, d_blocks in plan.values():
            assert all(landed(pw, dw, p_blocks, d_blocks, n) for n in range(LAYERS))
        assert others_untouched(dw, [b for _, d_blocks in plan.values() for b in d_blocks])
        assert metric(d, "pushsvc_verify_total", result="identical") == 3  # "first", "a" and "b"
        assert metric(p, "pushsvc_ipc_copies_total") == 2
        pw.events[-1].record()
        pw.send(wp.StepSaved(step=9))
        pw.events[-1].finish()
        await assert_tables_empty(p, d)


@pytest.mark.asyncio
async def test_layers_found_final_together_are_copied_in_one_launch() -> None:
    """P fell behind the pass: when it next looks, several layers' events are done. It
    applies them as one (``Layerwise.poll``): one launch for the layers and requests it
    found final, not one per layer, and every byte still lands in its own request's
    blocks (verify on)."""
    async with layer_pair(gpu=True, same_host=True, verify=True) as (p, d, pw, dw):
        await same_host_met(p, d, pw, dw)
        device = p.service.devmem.device(UUID)
        copies = device.pair_copies
        plan = {"a": ([3, 0], [5, 8]), "b": ([7, 2], [1, 11])}
        await _started(p, dw, pw, plan, step=6)
        for layer in range(LAYERS):  # the pass is queued: every layer saved, no kernel ran yet
            pw.events[layer].record()
            pw.send(wp.LayerSaved(step=6, layer=layer))
            for i, (p_blocks, _) in enumerate(plan.values()):
                pw.compute(layer, p_blocks, salt=70 * i + layer)
        await pw.ping(1)
        pw.events[0].finish()
        await wait_until(lambda: all(landed(pw, dw, pb, db, 0) for pb, db in plan.values()), "layer 0 of both")
        assert device.pair_copies == copies + 1
        assert all(untouched(dw, db, n) for _, db in plan.values() for n in range(1, LAYERS))
        for event in pw.events[1:LAYERS]:  # the rest ran before P looked again
            event.finish()
        for rid in plan:
            assert await dw.wait_for(wp.RecvDone, rid)
            assert await pw.wait_for(wp.SendDone, rid)
        assert device.pair_copies == copies + 2, "the layers found final together: one launch"
        for p_blocks, d_blocks in plan.values():
            assert all(landed(pw, dw, p_blocks, d_blocks, n) for n in range(LAYERS))
        assert others_untouched(dw, [b for _, d_blocks in plan.values() for b in d_blocks])
        assert metric(d, "pushsvc_verify_total", result="identical") == 3  # "first", "a" and "b"
        pw.events[-1].record()
        pw.send(wp.StepSaved(step=6))
        pw.events[-1].finish()
        await assert_tables_empty(p, d)


@pytest.mark.asyncio
async def test_a_request_whose_pairs_are_refused_fails_alone_in_its_step() -> None:
    """Two requests of one step, one of whose pairs the copier refuses (a destination
    block out of D's range, as a corrupt plan would hold): the merged launch is refused,
    each is launched on its own, the bad one fails with the copier's reason and nothing of
    it lands anywhere, and the other is copied layer by layer and completes."""
    async with layer_pair(gpu=True, same_host=True) as (p, d, pw, dw):
        await same_host_met(p, d, pw, dw)
        device = p.service.devmem.device(UUID)
        copies = device.pair_copies
        plan = {"good": ([0, 4], [2, 7]), "bad": ([6, 1], [11, 3])}
        await _started(p, dw, pw, plan, step=4)
        bad = _copy_of(p, "bad").layered
        pairs = bad.plan.pairs
        wrong = tuple((g, src, np.full_like(dst, 10_000)) for g, src, dst in pairs.groups)
        bad.plan = dataclasses.replace(bad.plan, pairs=dataclasses.replace(pairs, groups=wrong))
        for layer in range(LAYERS):
            for i, (p_blocks, _) in enumerate(plan.values()):
                pw.compute(layer, p_blocks, salt=50 * i + layer)
            await _final(pw, 4, layer)
            if layer == 0:
                failed = await pw.wait_for(wp.SendFailed, "bad")
                assert failed.reason.startswith("write_submit_failed: copy refused"), failed
                assert "write_submit_failed" in (await dw.wait_for(wp.RecvFailed, "bad")).reason
            await wait_until(lambda: landed(pw, dw, *plan["good"], layer), f"layer {layer} of 'good' in D's blocks")
        assert await dw.wait_for(wp.RecvDone, "good")
        assert await pw.wait_for(wp.SendDone, "good")
        assert all(landed(pw, dw, *plan["good"], n) for n in range(LAYERS))
        assert all(untouched(dw, plan["bad"][1], n) for n in range(LAYERS))
        assert others_untouched(dw, plan["good"][1])
        # Layer 0: the merged launch refused, then 'good' alone; each later layer: 'good' alone.
        assert device.pair_copies == copies + LAYERS
        assert metric(p, "pushsvc_transfers_total", result="failed") == 1
        pw.events[-1].record()
        pw.send(wp.StepSaved(step=4))
        pw.events[-1].finish()
        await assert_tables_empty(p, d)
