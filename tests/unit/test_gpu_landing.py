"""The GPU path's daemon logic with the device faked (host memory): KV registered by CUDA
IPC handle, WRITEs into D's landing slots, parts, copies into the worker's blocks, final
events held behind copies, backpressure, withdrawals, verify, refusals and leaks.

The same flows run on a real GPU in ``tests/gpu/``."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from daemon_fixtures import D_ENGINE, P_ENGINE, expected_after_push, metric, running_daemon, wait_until
from gpu_fixtures import BIG_BLOCK, UUID, GpuWorker, gpu_pair
from layer_fixtures import LayerWorker

from pushsvc.devmem.fake import FakeDeviceMemory
from pushsvc.engine.fake import FakeEngine
from pushsvc.errors import DaemonRefused
from pushsvc.protocol import worker as wp
from pushsvc.server.registrar import Registrar
from pushsvc.state.consumer import RecvState


def _registrations(pair) -> dict[str, list[list[int]]]:
    rank = pair.p.service.ranks.current[0]
    table = pair.p.service.sender._of(rank).table
    return {r.request_id: r.reg.local_block_ids for r in table.registrations.values()}


def _landing(daemon) -> dict[str, int]:
    return daemon.service.receiver.landing.slot_counts()


@pytest.mark.asyncio
async def test_push_lands_in_slots_then_is_copied_into_the_workers_blocks() -> None:
    async with gpu_pair() as (pair, devmem):
        reg = pair.d.service.ranks.current[0].memory
        assert reg.mem_type == "VRAM" and reg.landing is not None and reg.landing.geometry.slots == 8
        pair.register_recv("r1", [3, 9, 4])
        await wait_until(lambda: "r1" in _registrations(pair), "the PUSH_REG at P")
        assert _registrations(pair)["r1"] == [[0, 1, 2]]  # landing slots, not D's blocks
        assert _landing(pair.d)["used"] == 3
        pair.send_ready("r1", [0, 1, 2, 5])  # a prefix hit on D: P's last three blocks
        await pair.dw.wait_for(wp.RecvDone, "r1")
        await pair.pw.wait_for(wp.SendDone, "r1")
        assert np.array_equal(pair.dw.snapshot(), expected_after_push(pair.pw, pair.dw, [0, 1, 2, 5], [3, 9, 4]))
        assert metric(pair.d, "pushsvc_landing_copies_total") == 1
        assert _landing(pair.d) == {"total": 8, "used": 0, "queued": 0}
        assert devmem.copies_in_flight == 0


@pytest.mark.asyncio
async def test_a_large_write_goes_in_parts_each_copied_as_it_lands() -> None:
    # 8 blocks x 2 regions x 256 KiB = 4 MiB at 1 MiB a part, but a part is at least a
    # region (K or V): 2 parts.
    async with gpu_pair(part_mib=1) as (pair, _devmem):
        pair.register_recv("big", list(range(8, 16)))
        pair.send_ready("big", list(range(8)))
        await pair.dw.wait_for(wp.RecvDone, "big")
        await pair.pw.wait_for(wp.SendDone, "big")
        assert np.array_equal(pair.dw.snapshot(), expected_after_push(pair.pw, pair.dw, list(range(8)),
                                                                      list(range(8, 16))))
        assert metric(pair.p, "pushsvc_write_parts_total") == 2
        assert metric(pair.d, "pushsvc_notifications_total", kind="part") == 1
        assert metric(pair.d, "pushsvc_landing_copies_total") == 2
        assert metric(pair.d, "pushsvc_landing_exposed_seconds_count") == 1
        # D's timeline says when the first part landed, before the last one's completion
        events = pair.d.service.timelines.recent(1, "big")[0]["events_ms"]
        assert list(events)[-4:] == ["first_part_landed", "completion", "copies_done", "recv_done"]


@pytest.mark.asyncio
async def test_recv_done_waits_for_the_copy_and_holds_the_slots() -> None:
    async with gpu_pair() as (pair, devmem):
        devmem.hold_copies = True
        pair.register_recv("r", [1, 2])
        pair.send_ready("r", [4, 5])
        await pair.pw.wait_for(wp.SendDone, "r")  # the WRITE is done at P ...
        await pair.dw.quiet_for(0.2)  # ... but D's worker hears nothing while the copy runs
        assert devmem.copies_in_flight == 1 and _landing(pair.d)["used"] == 2
        devmem.hold_copies = False
        await pair.dw.wait_for(wp.RecvDone, "r")
        assert _landing(pair.d)["used"] == 0


@pytest.mark.asyncio
async def test_a_withdrawn_registration_is_never_copied_into_the_workers_blocks() -> None:
    async with gpu_pair() as (pair, _devmem):
        pair.fake.hold_writes = True
        pair.register_recv("w", [6, 7])
        pair.send_ready("w", [0, 1])
        await wait_until(lambda: pair.fake.held, "the WRITE in flight")
        pair.dw.send(wp.Evict(request_ids=["w"]))  # D withdraws while P writes into its slots
        await pair.dw.quiet_for(0.2)  # held: P has not confirmed and the WRITE may land
        pair.fake.complete_held()  # the WRITE lands in the slots
        failed = await pair.dw.wait_for(wp.RecvFailed, "w")
        assert failed.block_ids == [6, 7]
        assert np.array_equal(pair.dw.snapshot(), pair.dw.initial)  # no byte of D's KV changed
        assert metric(pair.d, "pushsvc_landing_copies_total") == 0
        await wait_until(lambda: _landing(pair.d)["used"] == 0, "the slots back")


@pytest.mark.asyncio
async def test_a_write_landing_while_ds_session_to_p_is_lost_is_copied_before_recv_done() -> None:
    """D holds a registration for the grace once its session to P drops; a WRITE that
    lands within it still makes the request done, so it must be copied like any other."""
    async with gpu_pair(d_config={"peer_timeout_s": 5.0}) as (pair, _devmem):
        pair.fake.hold_writes = True
        pair.register_recv("r", [6, 7])
        pair.send_ready("r", [0, 1])
        await wait_until(lambda: pair.fake.held, "the WRITE in flight")
        table = pair.d.service.receiver._of(pair.d.service.ranks.current[0])
        for session in list(pair.d.service.peers.find_engine(P_ENGINE).sessions):
            session.close()  # the side channel drops: D loses P
        await wait_until(lambda: table.pending["r"].state is RecvState.CANCELLING, "held for the grace")
        pair.fake.complete_held()
        await pair.dw.wait_for(wp.RecvDone, "r")
        assert np.array_equal(pair.dw.snapshot(), expected_after_push(pair.pw, pair.dw, [0, 1], [6, 7]))
        assert metric(pair.d, "pushsvc_landing_copies_total") == 1


@pytest.mark.asyncio
async def test_a_part_from_an_agent_the_registration_did_not_go_to_lands_nothing(monkeypatch) -> None:
    """While D's registration is PENDING (its PUSH_REG not sent yet) a notification can only
    come from some other agent that loaded D's metadata. It must not count as a part of
    the WRITE: P's own part of that index would then be refused, never copied, and the
    request end RecvDone over blocks that never got it."""
    async with gpu_pair(part_mib=1) as (pair, _devmem):
        d_rank = pair.d.service.ranks.current[0]
        stranger = pair.fake.create_agent("stranger/r0/00000000.1")
        stranger.add_remote(d_rank.agent.metadata())
        dispatch = Registrar.dispatch
        states = []

        def dispatch_then_stranger(self, rank, entry) -> None:
            dispatch(self, rank, entry)
            if rank is d_rank and entry.request_id == "big":
                states.append(entry.state)
                stranger.send_notif(d_rank.agent.name, b"PUSH_PART:0/2:big:1")
                pair.d.service.drain_notifs(d_rank)

        monkeypatch.setattr(Registrar, "dispatch", dispatch_then_stranger)
        pair.register_recv("big", list(range(8, 16)))
        pair.send_ready("big", list(range(8)))
        await pair.dw.wait_for(wp.RecvDone, "big")
        assert states == [RecvState.PENDING]
        assert np.array_equal(pair.dw.snapshot(), expected_after_push(pair.pw, pair.dw, list(range(8)),
                                                                      list(range(8, 16))))
        assert metric(pair.d, "pushsvc_malformed_inputs_total", source="notification",
                      reason="foreign_completion") == 1
        assert metric(pair.d, "pushsvc_malformed_inputs_total", source="notification", reason="part") == 0
        assert metric(pair.d, "pushsvc_landing_copies_total") == 2


@pytest.mark.asyncio
async def test_registrations_wait_for_landing_space_in_order() -> None:
    async with gpu_pair(landing_mib=1) as (pair, _devmem):  # 2 slots
        pair.register_recv("a", [0, 1])
        pair.register_recv("b", [2])
        pair.register_recv("c", [3])
        await wait_until(lambda: "a" in _registrations(pair), "a's PUSH_REG")
        await asyncio.sleep(0.1)
        assert set(_registrations(pair)) == {"a"}  # b and c wait: no PUSH_REG, no slot taken
        assert metric(pair.d, "pushsvc_landing_waits_total") == 2 and _landing(pair.d)["queued"] == 2
        pair.send_ready("a", [0, 1])
        await pair.dw.wait_for(wp.RecvDone, "a")
        await wait_until(lambda: {"b", "c"} <= set(_registrations(pair)), "b's and c's PUSH_REGs")
        assert _registrations(pair)["b"] == [[0]] and _registrations(pair)["c"] == [[1]]
        pair.send_ready("c", [3])
        pair.send_ready("b", [2])
        await pair.dw.wait_for(wp.RecvDone, "b")
        await pair.dw.wait_for(wp.RecvDone, "c")
        assert np.array_equal(pair.dw.snapshot(), expected_after_push(pair.pw, pair.dw, [0, 1, 2, 3], [0, 1, 2, 3]))
        assert metric(pair.d, "pushsvc_landing_wait_seconds_count") == 2
        # The timelines say so: b waited for space, a did not; every one ends after its copies.
        # (one part: its notification is read before its copy is launched, then the completion;
        # write_announced, P's WriteStarted, is there only when it beat the notification)
        lines = {t["request_id"]: [e for e in t["events_ms"] if e != "write_announced"]
                 for t in pair.d.service.timelines.recent(10)}
        assert lines["a"] == ["registered", "push_reg_sent", "first_part_landed", "completion", "copies_done",
                              "recv_done"]
        assert lines["b"] == ["registered", "landing_granted", "push_reg_sent", "first_part_landed", "completion",
                              "copies_done", "recv_done"]


@pytest.mark.asyncio
async def test_a_registration_larger_than_the_landing_buffer_fails_at_once() -> None:
    async with gpu_pair(landing_mib=1) as (pair, _devmem):
        pair.register_recv("huge", [0, 1, 2])
        failed = await pair.dw.wait_for(wp.RecvFailed, "huge")
        assert "landing_too_small" in failed.reason and "raise landing_mib" in failed.reason
        assert failed.block_ids == [0, 1, 2]
        assert metric(pair.d, "pushsvc_failures_total", kind="landing_too_small") == 1


@pytest.mark.asyncio
async def test_the_watchdog_fails_a_registration_that_waited_too_long_for_space() -> None:
    async with gpu_pair(landing_mib=1, d_config={"watchdog_s": 0.3}) as (pair, _devmem):
        pair.register_recv("a", [0, 1])
        pair.register_recv("b", [2])
        failed = await pair.dw.wait_for(wp.RecvFailed, "b", timeout=3)
        assert failed.reason.startswith("watchdog")
        assert _landing(pair.d)["queued"] == 0 and "b" not in _registrations(pair)


@pytest.mark.asyncio
async def test_a_device_fault_in_the_copy_fails_the_request_and_frees_its_slots() -> None:
    async with gpu_pair() as (pair, devmem):
        devmem.hold_copies = True
        pair.register_recv("f", [1, 2])
        pair.send_ready("f", [4, 5])
        await wait_until(lambda: devmem.copies_in_flight == 1, "the copy in flight")
        devmem.fault_copies, devmem.hold_copies = True, False
        failed = await pair.dw.wait_for(wp.RecvFailed, "f")
        assert failed.reason.startswith("landing_copy: landing copy failed on the device: cuEventQuery failed")
        assert metric(pair.d, "pushsvc_failures_total", kind="landing_copy") == 1
        assert _landing(pair.d)["used"] == 0
        devmem.fault_copies = False
        pair.register_recv("g", [1, 2])  # the daemon carries on
        pair.send_ready("g", [4, 5])
        await pair.dw.wait_for(wp.RecvDone, "g")


@pytest.mark.asyncio
async def test_verify_digests_the_device_blocks_on_both_sides() -> None:
    async with gpu_pair(part_mib=1, p_config={"verify": True}, d_config={"verify": True}) as (pair, _devmem):
        pair.register_recv("v", [10, 11, 12, 13])
        pair.send_ready("v", [4, 5, 6, 7])
        await pair.dw.wait_for(wp.RecvDone, "v")
        assert metric(pair.d, "pushsvc_verify_total", result="identical") == 1
        pair.fake.corrupt_writes = 1
        pair.register_recv("bad", [0, 1])
        pair.send_ready("bad", [0, 1])
        failed = await pair.dw.wait_for(wp.RecvFailed, "bad")
        assert failed.reason.startswith("verify: 1 of 4 blocks differ")


@pytest.mark.asyncio
async def test_copies_in_flight_keep_a_retiring_rank_and_its_memory() -> None:
    async with gpu_pair() as (pair, devmem):
        devmem.hold_copies = True
        pair.register_recv("r", [1])
        pair.send_ready("r", [2])
        await pair.pw.wait_for(wp.SendDone, "r")
        await wait_until(lambda: devmem.copies_in_flight == 1, "the copy in flight")
        allocated = devmem.usage()["allocated"]
        pair.dw.client.close()  # D's worker goes away while our copy writes into its KV
        await wait_until(lambda: pair.d.service.ranks.retiring, "the rank retiring")
        await asyncio.sleep(0.1)
        assert pair.d.service.ranks.retiring and devmem.usage()["allocated"] == allocated
        devmem.hold_copies = False
        await wait_until(lambda: not pair.d.service.ranks.retiring, "the rank closed")
        assert devmem.usage()["allocated"] < allocated


@pytest.mark.asyncio
async def test_every_import_and_allocation_is_given_back() -> None:
    async with gpu_pair() as (pair, devmem):
        pair.register_recv("r", [1])
        pair.send_ready("r", [2])
        await pair.dw.wait_for(wp.RecvDone, "r")
        assert devmem.usage()["imported"] > 0 and devmem.usage()["allocated"] > 0
        assert metric(pair.d, "pushsvc_gpu_memory_bytes", kind="allocated") == devmem.usage()["allocated"]
    assert devmem.usage() == {"imported": 0, "allocated": 0}


# ---------------------------------------------------------------- refusals


async def _register_refused(worker: GpuWorker, memory: wp.CudaIpcBuffers | None = None,
                            regions: list[wp.Region] | None = None) -> str:
    from daemon_fixtures import REGIONS, kv_regions
    from pushsvc.shm import SharedBuffer

    await worker.connect()
    worker.buffer = SharedBuffer.create(REGIONS * 4 * BIG_BLOCK)
    with pytest.raises(DaemonRefused) as err:
        await asyncio.to_thread(worker.client.register_kv, [], regions or kv_regions(4, BIG_BLOCK),
                                memory=memory or worker.memory())
    return str(err.value)


@pytest.mark.asyncio
@pytest.mark.parametrize("case", ["no_gpu_path", "unknown_device", "bad_handle", "region_past_import",
                                  "landing_allocation_fails"])
async def test_cuda_registrations_that_cannot_work_are_refused_and_leave_nothing(case: str) -> None:
    from daemon_fixtures import kv_regions

    async with gpu_pair() as (pair, devmem):
        daemon = pair.d
        if case == "no_gpu_path":
            daemon.service.devmem = None
        worker = GpuWorker(daemon, "consumer", devmem, rank=0)
        pair.dw.close()  # its rank is free for the new worker
        await wait_until(lambda: daemon.service.ranks.current.get(0) is None or daemon.service.ranks.current[0].conn
                         is None, "the rank free")
        before = devmem.usage()
        try:
            if case == "no_gpu_path":
                message = await _register_refused(worker)
                assert "without the GPU path" in message
            elif case == "unknown_device":
                await worker.connect()
                from pushsvc.shm import SharedBuffer
                worker.buffer = SharedBuffer.create(2 * 4 * BIG_BLOCK)
                memory = wp.CudaIpcBuffers(device_uuid=b"\xee" * 16, buffers=worker.memory().buffers)
                with pytest.raises(DaemonRefused, match="UUID"):
                    await asyncio.to_thread(worker.client.register_kv, [], kv_regions(4, BIG_BLOCK), memory=memory)
            elif case == "bad_handle":
                message = await _register_refused(worker, memory=wp.CudaIpcBuffers(
                    device_uuid=UUID, buffers=[wp.CudaIpcBuffer(handle=b"\x01" * 64, size=1 << 20)]))
                assert "cuIpcOpenMemHandle" in message
            elif case == "region_past_import":
                message = await _register_refused(worker, regions=kv_regions(5, BIG_BLOCK))
                assert "past buffer 0" in message
            else:
                devmem.fail_allocations = True
                message = await _register_refused(worker)
                assert "OUT_OF_MEMORY" in message
            assert devmem.usage() == before  # what was imported for it was closed again
            assert daemon.service.ranks.current[0].memory is None
        finally:
            worker.close()


@pytest.mark.asyncio
async def test_parts_for_a_rank_without_landing_are_refused() -> None:
    async with gpu_pair(landing_mib=0) as (pair, _devmem):  # D WRITEs straight into the imported KV
        assert pair.d.service.ranks.current[0].memory.landing is None
        pair.register_recv("r", [3])
        pair.send_ready("r", [1])
        await pair.dw.wait_for(wp.RecvDone, "r")  # one WRITE, into the worker's blocks
        assert metric(pair.p, "pushsvc_write_parts_total") == 1
        rank = pair.d.service.ranks.current[0]
        sender = pair.p.service.ranks.current[0].agent
        sender.send_notif(rank.agent.name, b"PUSH_PART:0/2:r:1")
        pair.d.service.drain_notifs(rank)
        assert metric(pair.d, "pushsvc_malformed_inputs_total", source="notification", reason="part") == 1


def test_fake_device_memory_is_a_device_memory() -> None:
    """The fake stands behind the same interface the daemon uses for CUDA."""
    from pushsvc.devmem.base import DeviceMemory

    memory: DeviceMemory = FakeDeviceMemory()
    assert memory.usage() == {"imported": 0, "allocated": 0}


def test_a_copy_moves_what_its_slots_were_mapped_to_and_nothing_unmapped() -> None:
    """``Copier.map`` sets the slot -> block map when slots are granted; a part's launch
    then copies through it. The fake keeps the map per slot, as the device does."""
    import ctypes

    from pushsvc.errors import DeviceError
    from pushsvc.state.landing import CopyPlan, LandingGeometry
    from pushsvc.state.layout import Layout, RegionSpec

    blocks, block_len = 8, 16
    worker_mem = (ctypes.c_uint8 * (2 * blocks * block_len))()
    base = ctypes.addressof(worker_mem)
    worker = Layout(tuple(RegionSpec(base + r * blocks * block_len, block_len, blocks, block_len) for r in range(2)))
    geometry = LandingGeometry.build(worker, 4 * worker.bytes_per_logical_block)
    landing_mem = (ctypes.c_uint8 * geometry.nbytes)(*range(1, geometry.nbytes + 1))
    memory = FakeDeviceMemory(copy_polls=1)
    copier = memory.add_device(UUID).copier(CopyPlan.build(worker, geometry.layout(ctypes.addressof(landing_mem))))
    run = copier.map(0, np.array([1, 2]), np.array([6, 3]))  # slots 1, 2 -> the worker's blocks 6, 3
    copier.map(0, np.array([0]), np.array([5]))  # another grant's slot: not part of ``run``
    assert copier.launch(run, 0, 1).done()  # the first region only (a part)
    got = np.frombuffer(worker_mem, dtype=np.uint8).reshape(2, blocks, block_len)
    landing = np.frombuffer(landing_mem, dtype=np.uint8).reshape(2, geometry.slots, block_len)
    assert np.array_equal(got[0, 6], landing[0, 1]) and np.array_equal(got[0, 3], landing[0, 2])
    assert not got[0, [0, 1, 2, 4, 5, 7]].any() and not got[1].any(), "only the mapped pairs of that region"
    with pytest.raises(DeviceError, match="outside the worker's KV"):
        copier.map(0, np.array([3]), np.array([blocks]))
    with pytest.raises(DeviceError, match="copy entries"):
        copier.launch(run, 1, 2)


@pytest.mark.asyncio
async def test_a_pipeline_parallel_p_into_a_landing_buffer_fails_the_request_at_once_naming_it() -> None:
    """A landing buffer counts a request's parts, not their sources: two stages' WRITEs
    would look like one WRITE's part twice, and the first stage's completion would copy
    the whole buffer, the other stage's layers not landed yet. So D refuses such a P at
    the registration: the request fails at once, nothing is copied, the slots come back."""
    fake, devmem = FakeEngine(), FakeDeviceMemory()
    devmem.add_device(UUID)
    async with running_daemon(fake, P_ENGINE, devmem=devmem, ipc_push="off") as p, \
            running_daemon(fake, D_ENGINE, devmem=devmem, landing_mib=1, ipc_push="off") as d:
        workers = [LayerWorker(p, "producer", gpu=devmem, events=0, layers=["l0"], pp_rank=0, pp_size=2),
                   LayerWorker(p, "producer", gpu=devmem, events=0, layers=["l1"], pp_rank=1, pp_size=2),
                   LayerWorker(d, "consumer", gpu=devmem, events=0, layers=["l0", "l1"])]
        try:
            for seed, w in enumerate(workers):
                await w.start_layers(8, seed)
            stage0, stage1, dw = workers
            dw.send(wp.RegisterRecv(request_id="r", local_block_ids=[[5]], remote_engine_id=P_ENGINE,
                                    remote_host="127.0.0.1", remote_port=p.service.peers.port))
            failed = await dw.wait_for(wp.RecvFailed, "r")
            assert failed.reason == ("handshake_failed: P prefill runs 2 pipeline stages: a GPU landing buffer "
                                     "takes KV from one P rank only"), failed
            for stage, blocks in ((stage0, [2]), (stage1, [3])):  # P's blocks: never matched
                stage.send(wp.SendReady(request_id="r", block_ids=[blocks]))
            await dw.quiet_for(0.1)
            assert (dw.snapshot() == dw.initial).all(), "nothing reached D's blocks"
            assert metric(d, "pushsvc_landing_copies_total") == 0
            assert metric(d, "pushsvc_malformed_inputs_total", source="notification", reason="part") == 0
            assert _landing(d)["used"] == 0
        finally:
            for w in workers:
                w.close()
