"""Same-host push with the device faked: D offers its worker's KV (``AgentInfo.ipc``), P
maps it and says so (``IpcReady``), D's registrations then ask P to copy (``PushReg.ipc``)
and P's pair copy moves the bytes into D's blocks; no NIXL WRITE, no landing slot. Also
what a hostile or stale peer gets: refusals, clean failures, nothing written.

The same flows run on a real GPU in ``tests/gpu/``."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
from daemon_fixtures import expected_after_push, metric, wait_until
from gpu_fixtures import gpu_pair

from pushsvc.protocol import peer as pp
from pushsvc.protocol import worker as wp


def _registrations(pair) -> dict[str, object]:
    rank = pair.p.service.ranks.current[0]
    return {r.request_id: r.reg for r in pair.p.service.sender._of(rank).table.registrations.values()}


def _p_peer_at_d(pair):
    return pair.d.service.peers.find_engine(pair.p.config.engine_id)


async def _warm(pair) -> None:
    """A first push (over NIXL into landing slots: D does not know P yet), then P's IpcReady."""
    pair.register_recv("first", [0])
    pair.send_ready("first", [0])
    await pair.dw.wait_for(wp.RecvDone, "first")
    await wait_until(lambda: (peer := _p_peer_at_d(pair)) is not None
                     and pair.d.service.ranks.current[0].agent.name in peer.ipc_ready, "P's IpcReady at D")


@pytest.mark.asyncio
async def test_a_same_host_push_is_copied_by_p_into_ds_blocks_without_landing_or_write() -> None:
    async with gpu_pair(ipc=True) as (pair, devmem):
        await _warm(pair)
        pair.dw.initial = pair.dw.snapshot()  # after the first push
        device = devmem.device(bytes(range(16)))
        parts, landing_copies = metric(pair.p, "pushsvc_write_parts_total"), metric(pair.d, "pushsvc_landing_copies_total")
        pair.register_recv("r", [9, 3, 4])
        await wait_until(lambda: "r" in _registrations(pair), "the PUSH_REG at P")
        reg = _registrations(pair)["r"]
        assert reg.ipc and reg.local_block_ids == [[9, 3, 4]]  # the worker's blocks, no landing slot
        assert pair.d.service.receiver.landing.slot_counts()["used"] == 0
        pair.send_ready("r", [0, 1, 2, 5])  # a prefix hit on D: P's last three blocks
        await pair.dw.wait_for(wp.RecvDone, "r")
        await pair.pw.wait_for(wp.SendDone, "r")
        assert np.array_equal(pair.dw.snapshot(), expected_after_push(pair.pw, pair.dw, [0, 1, 2, 5], [9, 3, 4]))
        assert metric(pair.p, "pushsvc_write_parts_total") == parts  # no NIXL WRITE
        assert metric(pair.d, "pushsvc_landing_copies_total") == landing_copies
        assert device.pair_copies == 1 and devmem.copies_in_flight == 0
        events = pair.d.service.timelines.recent(1, "r")[0]["events_ms"]
        assert "completion" in events and "copies_done" not in events


@pytest.mark.asyncio
async def test_recv_done_waits_for_ps_copy_and_verify_checks_the_bytes() -> None:
    async with gpu_pair(ipc=True, p_config={"verify": True}, d_config={"verify": True}) as (pair, devmem):
        await _warm(pair)
        devmem.hold_copies = True
        pair.register_recv("v", [7, 8])
        pair.send_ready("v", [3, 4])
        await pair.dw.quiet_for(0.2)  # the copy "runs": D hears of nothing, P settles nothing
        assert pair.p.service.sender.writes_in_flight() == 1
        devmem.hold_copies = False
        await pair.dw.wait_for(wp.RecvDone, "v")
        await pair.pw.wait_for(wp.SendDone, "v")
        assert metric(pair.d, "pushsvc_verify_total", result="identical") == 2  # "first" and "v"


@pytest.mark.asyncio
async def test_off_keeps_every_push_on_nixl_and_the_landing_buffer() -> None:
    async with gpu_pair(ipc=False) as (pair, devmem):
        pair.register_recv("a", [0])
        pair.send_ready("a", [0])
        await pair.dw.wait_for(wp.RecvDone, "a")
        pair.register_recv("b", [5])
        await wait_until(lambda: "b" in _registrations(pair), "the PUSH_REG at P")
        assert not _registrations(pair)["b"].ipc
        assert all(a.ipc is None for peer in pair.p.service.peers.peers.values() for a in peer.agents.values())
        pair.send_ready("b", [1])
        await pair.dw.wait_for(wp.RecvDone, "b")
        assert devmem.device(bytes(range(16))).pair_copies == 0


@pytest.mark.asyncio
async def test_p_copies_only_while_it_hears_from_ds_daemon() -> None:
    async with gpu_pair(ipc=True) as (pair, devmem):
        await _warm(pair)
        d_at_p = pair.p.service.peers.find_engine(pair.d.config.engine_id)
        pair.register_recv("f", [2])
        await wait_until(lambda: "f" in _registrations(pair), "the PUSH_REG at P")
        d_at_p.heard_at = time.monotonic() - 10  # as if P's loop had not read D's heartbeats for 10 s
        before = pair.dw.snapshot()
        pair.send_ready("f", [6])
        failed = await pair.dw.wait_for(wp.RecvFailed, "f")
        assert "ipc_fence" in failed.reason
        await pair.pw.wait_for(wp.SendFailed, "f")
        assert np.array_equal(pair.dw.snapshot(), before)  # nothing copied
        assert devmem.device(bytes(range(16))).pair_copies == 0
        assert metric(pair.p, "pushsvc_failures_total", kind="ipc_fence") == 1


@pytest.mark.asyncio
async def test_an_ipc_ready_for_an_agent_that_offered_nothing_is_refused() -> None:
    async with gpu_pair(ipc=True) as (pair, _devmem):
        await _warm(pair)
        peer = _p_peer_at_d(pair)
        pair.d.service.ipc_ready(peer, pp.IpcReady(agent_name="someone-else/r0"))
        assert "someone-else/r0" not in peer.ipc_ready
        assert metric(pair.d, "pushsvc_malformed_inputs_total", source="side_channel", reason="ipc_ready") == 1


@pytest.mark.asyncio
async def test_an_ipc_ready_that_crossed_the_ranks_retirement_gets_it_withdrawn() -> None:
    """D's rank retires while P's IpcReady for it is on its way: D answers IpcWithdrawn, so
    P does not keep the leaving worker's memory mapped."""
    async with gpu_pair(ipc=True) as (pair, devmem):
        await _warm(pair)
        targets = pair.p.service.ranks.current[0].remotes.ipc
        d_rank = pair.d.service.ranks.current[0]
        peer = _p_peer_at_d(pair)
        devmem.hold_copies = True  # P's copy stays in flight: the retiring rank stays around
        pair.register_recv("held", [3])
        pair.send_ready("held", [3])
        await wait_until(lambda: pair.p.service.sender.writes_in_flight() == 1, "P's copy in flight")
        peer.ipc_ready.discard(d_rank.agent.name)  # as if P's IpcReady had not arrived yet
        pair.dw.close()  # the rank retires: no IpcWithdrawn, D thinks P never mapped it
        await wait_until(lambda: d_rank in pair.d.service.ranks.retiring, "the rank retiring")
        assert targets.get(d_rank.agent.name) is not None
        pair.d.service.ipc_ready(peer, pp.IpcReady(agent_name=d_rank.agent.name))  # P's word arrives late
        await wait_until(lambda: targets.get(d_rank.agent.name) is None, "P to withdraw the mapping")
        assert metric(pair.d, "pushsvc_malformed_inputs_total", source="side_channel", reason="ipc_ready") == 0
        assert len(targets) == 1  # still mapped while the copy into it runs
        devmem.hold_copies = False
        await wait_until(lambda: len(targets) == 0, "P to unmap D's worker KV")


@pytest.mark.asyncio
async def test_p_maps_nothing_of_an_offer_whose_region_lies_outside_its_buffer() -> None:
    async with gpu_pair(ipc=True) as (pair, _devmem):
        await _warm(pair)
        rank = pair.p.service.ranks.current[0]
        d_at_p = pair.p.service.peers.find_engine(pair.d.config.engine_id)
        info = next(a for a in d_at_p.agents.values() if a.ipc is not None)
        bad_region = msgspec.structs.replace(info.ipc.regions[0], offset=info.ipc.buffers[0].size)
        bad = msgspec.structs.replace(info, agent_name=info.agent_name + "x", ipc=msgspec.structs.replace(
            info.ipc, regions=[bad_region, *info.ipc.regions[1:]]))
        imported = pair.p.devmem.usage()["imported"]
        assert rank.remotes.ipc.load(bad) is False
        assert "past buffer" in rank.remotes.ipc.refused[bad.agent_name]
        assert pair.p.devmem.usage()["imported"] == imported  # what it mapped was given back
        assert metric(pair.p, "pushsvc_failures_total", kind="ipc_map") == 1


@pytest.mark.asyncio
async def test_p_maps_nothing_of_an_offer_whose_blocks_overlap() -> None:
    """Blocks closer together than their length: P's copy into one would write into its
    neighbour, which another of D's requests may hold."""
    async with gpu_pair(ipc=True) as (pair, _devmem):
        await _warm(pair)
        rank = pair.p.service.ranks.current[0]
        d_at_p = pair.p.service.peers.find_engine(pair.d.config.engine_id)
        info = next(a for a in d_at_p.agents.values() if a.ipc is not None)
        overlapping = msgspec.structs.replace(info.ipc.regions[0], block_stride=info.regions[0].block_len // 2)
        bad = msgspec.structs.replace(info, agent_name=info.agent_name + "x", ipc=msgspec.structs.replace(
            info.ipc, regions=[overlapping, *info.ipc.regions[1:]]))
        imported = pair.p.devmem.usage()["imported"]
        assert rank.remotes.ipc.load(bad) is False
        assert "overlap" in rank.remotes.ipc.refused[bad.agent_name]
        assert pair.p.devmem.usage()["imported"] == imported


@pytest.mark.asyncio
async def test_a_registration_asking_for_a_copy_p_cannot_make_fails_cleanly() -> None:
    async with gpu_pair(ipc=True) as (pair, _devmem):
        await _warm(pair)
        rank = pair.p.service.ranks.current[0]
        for name in list(rank.remotes.names()):
            rank.remotes.ipc.unload(name)  # as if P had never mapped D's KV
        pair.register_recv("u", [4])
        pair.send_ready("u", [4])
        failed = await pair.dw.wait_for(wp.RecvFailed, "u")
        assert "ipc_unavailable" in failed.reason
        await pair.pw.wait_for(wp.SendFailed, "u")


@pytest.mark.asyncio
async def test_a_copy_whose_launch_fails_fails_the_request_and_the_next_one_copies() -> None:
    async with gpu_pair(ipc=True) as (pair, devmem):
        await _warm(pair)
        devmem.fail_launches = True
        pair.dw.initial = before = pair.dw.snapshot()
        pair.register_recv("x", [5])
        pair.send_ready("x", [5])
        failed = await pair.dw.wait_for(wp.RecvFailed, "x")
        assert "write_submit_failed" in failed.reason and "cuLaunchKernel" in failed.reason
        await pair.pw.wait_for(wp.SendFailed, "x")
        assert np.array_equal(pair.dw.snapshot(), before)  # nothing copied
        assert metric(pair.p, "pushsvc_failures_total", kind="write_submit_failed") == 1
        assert pair.p.service.sender.writes_in_flight() == 0
        devmem.fail_launches = False
        pair.register_recv("y", [6])
        pair.send_ready("y", [2])
        await pair.dw.wait_for(wp.RecvDone, "y")
        assert np.array_equal(pair.dw.snapshot(), expected_after_push(pair.pw, pair.dw, [2], [6]))


@pytest.mark.asyncio
async def test_when_ds_worker_leaves_p_lets_go_of_its_kv() -> None:
    """A mapping P kept would hold the D worker's GPU memory after that worker exited."""
    async with gpu_pair(ipc=True) as (pair, _devmem):
        await _warm(pair)
        targets = pair.p.service.ranks.current[0].remotes.ipc
        agent = pair.d.service.ranks.current[0].agent.name
        assert targets.get(agent) is not None
        pair.dw.close()  # D's worker goes: its rank retires, D tells P
        await wait_until(lambda: len(targets) == 0, "P to unmap D's worker KV")
        assert metric(pair.p, "pushsvc_malformed_inputs_total", source="side_channel", reason="ipc_withdrawn") == 0


@pytest.mark.asyncio
async def test_an_old_p_never_hears_of_ds_kv() -> None:
    """Side channel 1.7 and before: the offer is left out of D's announcements."""
    async with gpu_pair(ipc=True) as (pair, _devmem):
        info = pair.d.service.ranks.current[0].agent_info()
        assert info.ipc is not None
        assert pp.announceable([info], pp.IPC_MINOR - 1)[0].ipc is None
        assert pp.announceable([info], pp.IPC_MINOR)[0].ipc == info.ipc


@pytest.mark.asyncio
async def test_a_d_whose_heartbeats_are_too_sparse_for_ps_fence_is_not_mapped() -> None:
    """P copies only while it heard from D's daemon within 2.5 s: a D beating every 3 s
    would fail most pushes at the fence, so P never maps its KV and it gets NIXL WRITEs."""
    async with gpu_pair(ipc=True, d_config={"heartbeat_interval_s": 3.0}) as (pair, devmem):
        pair.register_recv("first", [0])
        pair.send_ready("first", [0])
        await pair.dw.wait_for(wp.RecvDone, "first")
        pair.register_recv("second", [1])
        pair.send_ready("second", [1])
        await pair.dw.wait_for(wp.RecvDone, "second")
        assert not _p_peer_at_d(pair).ipc_ready and len(pair.p.service.ranks.current[0].remotes.ipc) == 0
        assert devmem.device(bytes(range(16))).pair_copies == 0
        assert metric(pair.d, "pushsvc_landing_copies_total") == 2
