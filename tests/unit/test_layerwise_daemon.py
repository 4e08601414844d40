"""Layer-wise push through two real daemons (fake engine, real sockets and memfds).

P's worker holds four layers (K and V regions of each, named by layer). For a request
whose prefill ends in a step, it says ``SendStart``, then "computes" each layer (writes
its final bytes into the layer's regions) and says ``LayerSaved``, then ``StepSaved``.
The fake engine copies at the moment a WRITE is posted, so a layer posted before it was
final would reach D with its old bytes: the tests compare D's memory with P's final bytes
and with what each layer held before it was computed.
"""

from __future__ import annotations

import asyncio

import pytest
from daemon_fixtures import (
    LONG_S,
    P_ENGINE,
    WAIT_S,
    assert_tables_empty,
    http_get,
    metric,
    running_daemon,
    wait_until,
)
from gpu_fixtures import UUID, gpu_pair
from layer_fixtures import (
    BLOCK,
    LAYERS,
    P_BLOCKS,
    LayerWorker,
    landed,
    layer_pair,
    others_untouched,
    pushregs_at,
    recv_into,
    stop_mid_step,
    untouched,
)

from pushsvc.devmem.fake import FakeDeviceMemory
from pushsvc.engine.fake import FakeEngine
from pushsvc.errors import DaemonRefused
from pushsvc.protocol import worker as wp
from pushsvc.server.layerwise import MAX_OPEN_STEPS
from pushsvc.shm import SharedBuffer


@pytest.mark.asyncio
async def test_each_layer_goes_once_final_and_d_hears_once_the_last_one_landed() -> None:
    async with layer_pair() as (p, d, pw, dw):
        p_blocks, d_blocks = [1, 4, 6], [10, 0, 7]
        recv_into(p, dw, "d-1", d_blocks)
        await pushregs_at(p)
        pw.send(wp.SendStart(request_id="d-1", block_ids=[p_blocks], step=7))
        for layer in range(LAYERS):
            await wait_until(lambda: all(untouched(dw, d_blocks, later) for later in range(layer, LAYERS)),
                             "nothing of a layer before it is final")
            pw.compute(layer, p_blocks, salt=layer * 31)
            pw.send(wp.LayerSaved(step=7, layer=layer))
            await wait_until(lambda: landed(pw, dw, p_blocks, d_blocks, layer), f"layer {layer} at D")
            if layer < LAYERS - 1:
                await dw.quiet_for(0.05)  # no RecvDone while layers are missing
        # Every region is final with the last layer: the completion needs no StepSaved.
        assert await dw.wait_for(wp.RecvDone, "d-1")
        assert all(landed(pw, dw, p_blocks, d_blocks, layer) for layer in range(LAYERS))
        assert await pw.wait_for(wp.SendDone, "d-1")
        pw.send(wp.StepSaved(step=7))  # after the push ended: nothing left to do
        await pw.quiet_for(0.05)
        assert metric(p, "pushsvc_write_parts_total") == LAYERS, "one WRITE per layer, no more"
        assert metric(p, "pushsvc_transfers_total", result="done") == 1
        status, body = await http_get(p, "/v1/requests?request_id=d-1")
        assert status == 200
        events = body["timelines"][0]["events_ms"]
        assert sorted(events, key=events.get) == ["send_start", "matched", "write_posted", "prefill_done",
                                                  "write_all_posted", "write_settled", "send_done"]
        await assert_tables_empty(p, d)


@pytest.mark.asyncio
async def test_a_registration_that_comes_mid_step_takes_what_is_final_then_the_rest() -> None:
    async with layer_pair() as (p, d, pw, dw):
        p_blocks, d_blocks = [2, 3], [5, 6]
        pw.send(wp.SendStart(request_id="mid", block_ids=[p_blocks], step=1))
        for layer in (0, 1):
            pw.compute(layer, p_blocks, salt=90 + layer)
            pw.send(wp.LayerSaved(step=1, layer=layer))
        await wait_until(lambda: p.service.sender.layerwise.progress(p.service.ranks.current[0], "mid") is not None
                         and p.service.sender.layerwise.progress(p.service.ranks.current[0], "mid").final.sum() == 4,
                         "layers 0 and 1 saved at P")
        recv_into(p, dw, "mid", d_blocks)
        await wait_until(lambda: landed(pw, dw, p_blocks, d_blocks, 0) and landed(pw, dw, p_blocks, d_blocks, 1),
                         "the final layers at once")
        assert untouched(dw, d_blocks, 2) and untouched(dw, d_blocks, 3)
        for layer in (2, 3):
            pw.compute(layer, p_blocks, salt=90 + layer)
        pw.send(wp.StepSaved(step=1))  # the rest, without a LayerSaved of their own
        assert await dw.wait_for(wp.RecvDone, "mid")
        assert all(landed(pw, dw, p_blocks, d_blocks, layer) for layer in range(LAYERS))
        assert await pw.wait_for(wp.SendDone, "mid")
        await assert_tables_empty(p, d)


@pytest.mark.asyncio
async def test_a_registration_after_the_step_is_pushed_whole() -> None:
    async with layer_pair() as (p, d, pw, dw):
        pw.send(wp.SendStart(request_id="late", block_ids=[[0, 1]], step=3))
        for layer in range(LAYERS):
            pw.compute(layer, [0, 1], salt=5)
        pw.send(wp.StepSaved(step=3))
        await wait_until(lambda: p.service.sender.layerwise.open_steps(p.service.ranks.current[0]) == 0, "step ended")
        recv_into(p, dw, "late", [8, 9])
        assert await dw.wait_for(wp.RecvDone, "late")
        assert all(landed(pw, dw, [0, 1], [8, 9], layer) for layer in range(LAYERS))
        assert metric(p, "pushsvc_write_parts_total") == 1, "one WRITE: the step had ended"
        assert await pw.wait_for(wp.SendDone, "late")


@pytest.mark.asyncio
async def test_verify_mode_digests_the_final_bytes() -> None:
    async with layer_pair(verify=True) as (p, d, pw, dw):
        recv_into(p, dw, "v", [1, 2, 3])
        await pushregs_at(p)
        pw.send(wp.SendStart(request_id="v", block_ids=[[4, 5, 6]], step=2))
        for layer in range(LAYERS):
            pw.compute(layer, [4, 5, 6], salt=200 + layer)
            pw.send(wp.LayerSaved(step=2, layer=layer))
        pw.send(wp.StepSaved(step=2))
        assert await dw.wait_for(wp.RecvDone, "v")
        assert metric(d, "pushsvc_verify_total", result="identical") == 1
        assert metric(d, "pushsvc_verify_blocks_total", result="identical") == 3 * 2 * LAYERS


@pytest.mark.asyncio
@pytest.mark.parametrize("who", ["p_evicts", "p_worker_leaves", "d_withdraws"])
async def test_a_push_stopped_mid_step_writes_nothing_more_and_both_sides_hear(who: str) -> None:
    async with layer_pair() as (p, d, pw, dw):
        p_blocks, d_blocks = [0, 7], [3, 11]
        recv_into(p, dw, "x", d_blocks)
        await pushregs_at(p)
        pw.send(wp.SendStart(request_id="x", block_ids=[p_blocks], step=4))
        pw.compute(0, p_blocks, salt=17)
        pw.send(wp.LayerSaved(step=4, layer=0))
        await wait_until(lambda: landed(pw, dw, p_blocks, d_blocks, 0), "layer 0 at D")
        await stop_mid_step(who, pw, dw, "x", d_blocks)
        if who != "p_worker_leaves":
            for layer in (1, 2, 3):  # later layers become final: none of them may reach D now
                pw.compute(layer, p_blocks, salt=40)
                pw.send(wp.LayerSaved(step=4, layer=layer))
            pw.send(wp.StepSaved(step=4))
            await pw.ping(1)  # the daemon has read all of it
        assert all(untouched(dw, d_blocks, layer) for layer in (1, 2, 3))
        assert others_untouched(dw, d_blocks)
        assert metric(p, "pushsvc_transfers_total", result="failed") == 1
        await assert_tables_empty(p, d)


@pytest.mark.asyncio
async def test_bad_layer_messages_are_refused_and_the_connection_stays() -> None:
    async with layer_pair(lease_s=LONG_S) as (p, d, pw, dw):
        pw.send(wp.LayerSaved(step=1, layer=LAYERS))  # the worker registered 4 layers
        error = await pw.wait_for(wp.Error)
        assert "layer 4: this worker registered 4 layers" in error.message
        dw.send(wp.SendStart(request_id="c", block_ids=[[0]], step=1))
        error = await dw.wait_for(wp.Error)
        assert "a consumer worker cannot send KV" in error.message
        dw.send(wp.StepSaved(step=1))
        assert "a consumer worker cannot send KV" in (await dw.wait_for(wp.Error)).message
        pw.send(wp.SendStart(request_id="oob", block_ids=[[P_BLOCKS]], step=1))
        failed = await pw.wait_for(wp.SendFailed, "oob")
        assert "finished blocks" in failed.reason
        for step in range(16):  # steps that never end: bounded
            pw.send(wp.SendStart(request_id=f"s{step}", block_ids=[[0]], step=100 + step))
        pw.send(wp.SendStart(request_id="one-too-many", block_ids=[[0]], step=200))
        failed = await pw.wait_for(wp.SendFailed, "one-too-many", timeout=WAIT_S)
        assert "16 steps of this worker never said StepSaved" in failed.reason
        await pw.ping(2)
        await dw.ping(3)


@pytest.mark.asyncio
async def test_a_cuda_rank_without_layer_events_refuses_layer_wise_push() -> None:
    """KV on a GPU (the device faked in host memory) registered without layer events: a
    layer is final only when its kernels ran, which only the events tell."""
    async with gpu_pair() as (pair, _devmem):
        pair.pw.send(wp.SendStart(request_id="g", block_ids=[[0]], step=1))
        failed = await pair.pw.wait_for(wp.SendFailed, "g")
        assert "layer-wise push from a GPU needs the worker's layer events" in failed.reason
        assert pair.p.service.sender.layerwise.open_steps(pair.p.service.ranks.current[0]) == 0


@pytest.mark.asyncio
async def test_a_gpu_layer_goes_only_once_its_event_says_its_kernels_ran() -> None:
    """The worker records a layer's event (its kernels queued), says LayerSaved, and the
    kernels write the layer's KV only later: P's daemon posts it once the event is done,
    so D gets the final bytes, never what the layer held before."""
    async with layer_pair(gpu=True) as (p, d, pw, dw):
        p_blocks, d_blocks = [2, 5], [9, 1]
        recv_into(p, dw, "gpu", d_blocks)
        await pushregs_at(p)
        pw.send(wp.SendStart(request_id="gpu", block_ids=[[2, 5]], step=3))
        for layer in range(LAYERS):
            pw.events[layer].record()
            pw.send(wp.LayerSaved(step=3, layer=layer))
            await pw.ping(layer)  # the daemon read it, and holds it
            await dw.quiet_for(0.02)
            assert untouched(dw, d_blocks, layer), f"layer {layer} posted before its event was done"
            pw.compute(layer, p_blocks, salt=60 + layer)  # the kernels run ...
            pw.events[layer].finish()  # ... and finish
            await wait_until(lambda: landed(pw, dw, p_blocks, d_blocks, layer), f"layer {layer} at D")
        assert await dw.wait_for(wp.RecvDone, "gpu")
        assert await pw.wait_for(wp.SendDone, "gpu")
        pw.events[-1].record()
        pw.send(wp.StepSaved(step=3))
        pw.events[-1].finish()
        assert metric(p, "pushsvc_write_parts_total") == LAYERS
        await assert_tables_empty(p, d)


@pytest.mark.asyncio
async def test_a_staged_request_of_a_step_whose_layer_event_failed_fails_and_is_never_written() -> None:
    """D has not registered yet when the step's layer event fails: the step is forgotten,
    and the request with it, so D's registration, coming later, does not get the whole
    request WRITten as if its layers were final."""
    async with layer_pair(gpu=True) as (p, d, pw, dw):
        d_blocks = [9, 1]
        pw.send(wp.SendStart(request_id="s", block_ids=[[2, 5]], match_key="k-s", step=5))
        pw.events[0].record()
        pw.send(wp.LayerSaved(step=5, layer=0))
        await pw.ping(1)
        pw.events[0].fault()  # the worker's context failed: step 5's KV is never known final
        failed = await pw.wait_for(wp.SendFailed, "s")
        assert failed.reason.startswith("layer_event: the worker's layer event failed"), failed
        assert metric(p, "pushsvc_failures_total", kind="layer_event") == 1
        dw.send(wp.RegisterRecv(request_id="s", local_block_ids=[d_blocks], remote_engine_id=P_ENGINE,
                                remote_host="127.0.0.1", remote_port=p.service.peers.port, match_key="k-s"))
        event = await dw.wait_for((wp.RecvDone, wp.RecvFailed), "s")
        assert isinstance(event, wp.RecvFailed) and "already ended" in event.reason, event
        assert all(untouched(dw, d_blocks, layer) for layer in range(LAYERS))
        assert metric(p, "pushsvc_write_parts_total") == 0
        await assert_tables_empty(p, d)


@pytest.mark.asyncio
@pytest.mark.parametrize("verify", [False, True])
async def test_into_a_landing_d_each_layer_goes_as_a_part_that_d_copies_out_as_it_lands(verify: bool) -> None:
    """D's KV is on the (fake) GPU with a landing buffer and P does not copy into it
    (``ipc_push`` off): each layer is WRITten into D's landing slots as a part of its own,
    with its part notification, so D copies it into its worker's blocks while later
    layers are not final yet; the last part completes the push (verify: with P's digests,
    sent after it)."""
    async with layer_pair(gpu=True, same_host=True, ipc_push="off", verify=verify) as (p, d, pw, dw):
        p_blocks, d_blocks = [2, 5, 0], [9, 1, 4]
        recv_into(p, dw, "lp", d_blocks)
        await pushregs_at(p)
        pw.send(wp.SendStart(request_id="lp", block_ids=[p_blocks], step=3))
        for layer in range(LAYERS):
            pw.compute(layer, p_blocks, salt=80 + layer)
            pw.events[layer].record()
            pw.send(wp.LayerSaved(step=3, layer=layer))
            await pw.ping(layer)
            pw.events[layer].finish()
            await wait_until(lambda: landed(pw, dw, p_blocks, d_blocks, layer), f"layer {layer} in D's blocks")
            assert all(untouched(dw, d_blocks, n) for n in range(layer + 1, LAYERS))
            assert metric(d, "pushsvc_notifications_total", kind="part") == min(layer + 1, LAYERS - 1)
        assert await dw.wait_for(wp.RecvDone, "lp")
        assert await pw.wait_for(wp.SendDone, "lp")
        assert others_untouched(dw, d_blocks)
        assert metric(p, "pushsvc_write_parts_total") == LAYERS
        assert metric(d, "pushsvc_landing_copies_total") == LAYERS
        assert metric(d, "pushsvc_verify_total", result="identical") == (1 if verify else 0)
        pw.events[-1].record()
        pw.send(wp.StepSaved(step=3))
        pw.events[-1].finish()
        await assert_tables_empty(p, d)
        await dw.quiet_for(0.05)  # the parts were all D heard: no completion after them
        assert metric(d, "pushsvc_notifications_total", kind="late_completion") == 0
        assert metric(d, "pushsvc_malformed_inputs_total", source="notification", reason="part") == 0


@pytest.mark.asyncio
async def test_saves_waiting_for_events_are_bounded_and_the_connection_stays() -> None:
    """A GPU worker whose events never say done (a hung pass, or a buggy worker) cannot
    make P's daemon hold its saves without bound: past one save per layer and pass for
    each step that may be open, a save is refused with an error, the connection stays,
    and what was held still applies once the events are done."""
    async with layer_pair(gpu=True, lease_s=LONG_S) as (p, d, pw, dw):
        limit = MAX_OPEN_STEPS * (LAYERS + 1)
        events = pw.events[:LAYERS + 1]  # the layers' and the pass's
        for event in events:
            event.record()  # and never finished, for now
        for i in range(limit):
            pw.send(wp.StepSaved(step=i // (LAYERS + 1)) if i % (LAYERS + 1) == LAYERS
                    else wp.LayerSaved(step=i // (LAYERS + 1), layer=i % (LAYERS + 1)))
        await pw.ping(1)
        pw.poll()
        assert not [m for m in pw.events if isinstance(m, wp.Error)], "every save up to the bound is taken"
        pw.send(wp.LayerSaved(step=99, layer=0))
        error = await pw.wait_for(wp.Error)
        assert f"{limit} saves of this worker wait for their events already" in error.message
        assert metric(p, "pushsvc_malformed_inputs_total", source="worker", reason="ProtocolError") == 1
        await pw.ping(2)  # the connection stays
        rank = p.service.ranks.current[0]
        assert p.service.sender.layerwise.busy(rank)
        for event in events:
            event.finish()
        await wait_until(lambda: not p.service.sender.layerwise.busy(rank), "the held saves applied")


@pytest.mark.asyncio
async def test_into_a_landing_d_the_layers_found_final_together_go_as_their_own_parts() -> None:
    """P fell behind the pass: when it next looks, the events of layers 1 to the last are
    done. It applies them as one poll and posts their parts together, each still a part
    of its own with its notification: D copies each into its worker's blocks, the last
    completes the push, and the bytes are P's (verify on)."""
    async with layer_pair(gpu=True, same_host=True, ipc_push="off", verify=True) as (p, d, pw, dw):
        p_blocks, d_blocks = [7, 3], [0, 10]
        recv_into(p, dw, "behind", d_blocks)
        await pushregs_at(p)
        pw.send(wp.SendStart(request_id="behind", block_ids=[p_blocks], step=5))
        for layer in range(LAYERS):  # the pass is queued: every layer saved, no kernel ran yet
            pw.compute(layer, p_blocks, salt=40 + layer)
            pw.events[layer].record()
            pw.send(wp.LayerSaved(step=5, layer=layer))
        await pw.ping(1)
        pw.events[0].finish()
        await wait_until(lambda: landed(pw, dw, p_blocks, d_blocks, 0), "layer 0 in D's blocks")
        assert metric(p, "pushsvc_write_parts_total") == 1
        assert all(untouched(dw, d_blocks, n) for n in range(1, LAYERS))
        for event in pw.events[1:LAYERS]:  # the rest ran before P looked again
            event.finish()
        assert await dw.wait_for(wp.RecvDone, "behind")
        assert await pw.wait_for(wp.SendDone, "behind")
        assert all(landed(pw, dw, p_blocks, d_blocks, n) for n in range(LAYERS))
        assert others_untouched(dw, d_blocks)
        assert metric(p, "pushsvc_write_parts_total") == LAYERS
        assert metric(d, "pushsvc_landing_copies_total") == LAYERS
        assert metric(d, "pushsvc_notifications_total", kind="part") == LAYERS - 1
        assert metric(d, "pushsvc_verify_total", result="identical") == 1
        pw.events[-1].record()
        pw.send(wp.StepSaved(step=5))
        pw.events[-1].finish()
        await assert_tables_empty(p, d)


@pytest.mark.asyncio
@pytest.mark.parametrize("who", ["p_evicts", "p_worker_leaves", "d_withdraws"])
async def test_a_push_in_layer_parts_stopped_mid_step_copies_nothing_more_and_frees_the_slots(who: str) -> None:
    async with layer_pair(gpu=True, same_host=True, ipc_push="off") as (p, d, pw, dw):
        p_blocks, d_blocks = [1, 6], [3, 11]
        recv_into(p, dw, "x", d_blocks)
        await pushregs_at(p)
        pw.send(wp.SendStart(request_id="x", block_ids=[p_blocks], step=4))
        pw.compute(0, p_blocks, salt=17)
        pw.events[0].record()
        pw.send(wp.LayerSaved(step=4, layer=0))
        await pw.ping(0)
        pw.events[0].finish()
        await wait_until(lambda: landed(pw, dw, p_blocks, d_blocks, 0), "layer 0 copied out of D's landing slots")
        await stop_mid_step(who, pw, dw, "x", d_blocks)
        if who != "p_worker_leaves":
            for layer in (1, 2, 3):  # later layers become final: none of them may reach D now
                pw.compute(layer, p_blocks, salt=40)
                pw.events[layer].record()
                pw.send(wp.LayerSaved(step=4, layer=layer))
                pw.events[layer].finish()
            pw.events[-1].record()
            pw.send(wp.StepSaved(step=4))
            pw.events[-1].finish()
            await pw.ping(1)
            await dw.quiet_for(0.05)
        assert all(untouched(dw, d_blocks, layer) for layer in (1, 2, 3))
        assert others_untouched(dw, d_blocks)
        assert metric(p, "pushsvc_write_parts_total") == 1
        await assert_tables_empty(p, d)
        await wait_until(lambda: d.service.receiver.landing.slot_counts()["used"] == 0, "D's landing slots back")


@pytest.mark.asyncio
async def test_the_step_end_on_a_gpu_waits_for_its_own_event() -> None:
    """Layers without a LayerSaved are final at the step's end, which on a GPU is when the
    event recorded after the forward pass is done, not when StepSaved arrives."""
    async with layer_pair(gpu=True) as (p, d, pw, dw):
        recv_into(p, dw, "end", [4])
        await pushregs_at(p)
        pw.send(wp.SendStart(request_id="end", block_ids=[[6]], step=8))
        pw.events[-1].record()
        pw.send(wp.StepSaved(step=8))
        await pw.ping(1)
        await dw.quiet_for(0.05)
        assert all(untouched(dw, [4], layer) for layer in range(LAYERS))
        for layer in range(LAYERS):
            pw.compute(layer, [6], salt=7)
        pw.events[-1].finish()
        assert await dw.wait_for(wp.RecvDone, "end")
        assert all(landed(pw, dw, [6], [4], layer) for layer in range(LAYERS))


@pytest.mark.asyncio
@pytest.mark.parametrize(("where", "words"), [
    ("host", "layer events come with CUDA KV memory"),
    ("count", "3 layer events for 4 layers"),
    ("staging", "this daemon copies P's blocks into its staging buffer first"),
])
async def test_layer_events_that_cannot_serve_are_refused_at_registration(where: str, words: str) -> None:
    fake, devmem = FakeEngine(), FakeDeviceMemory()
    devmem.add_device(UUID)
    config = {"staging_mib": 1} if where == "staging" else {}
    async with running_daemon(fake, P_ENGINE, devmem=devmem, **config) as p:
        worker = LayerWorker(p, "producer", gpu=None if where == "host" else devmem, events=3 if where == "count"
                             else LAYERS + 1)
        try:
            if where == "host":  # host memory with event handles: the client would not send them; a raw one might
                await worker.connect()
                worker.buffer = SharedBuffer.create(2 * LAYERS * P_BLOCKS * BLOCK)
                regions = [wp.Region(buffer=0, offset=r * P_BLOCKS * BLOCK, block_len=BLOCK, num_blocks=P_BLOCKS,
                                     layer_names=[f"l{r // 2}"]) for r in range(2 * LAYERS)]
                with pytest.raises(DaemonRefused, match=words):
                    await asyncio.to_thread(worker.client.register_kv, [worker.buffer.fd], regions,
                                            layer_events=[devmem.export_event()[1]])
            else:
                with pytest.raises(DaemonRefused, match=words):
                    await worker.start_layers(P_BLOCKS, seed=1)
            assert all(e.opened == 0 for e in devmem.events.values()), "an event left open"
            assert devmem.usage()["imported"] == 0
        finally:
            worker.close()
