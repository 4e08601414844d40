"""A worker's duplicate or conflicting requests never end a live request early.

Two in-process daemons over the fake engine (see ``daemon_fixtures``). A duplicate
RegisterRecv or SendReady is ignored whatever blocks it names: answering it with a
failure would read, to the worker, as the live request's final event, and the worker
would reuse blocks P may still be writing. A registration naming a block that another
live registration of the rank holds is refused before any PUSH_REG leaves.
"""

from __future__ import annotations

import numpy as np
import pytest
from daemon_fixtures import assert_tables_empty, expected_after_push, metric, push_pair, wait_until

from pushsvc.protocol import worker as wp

P_ID = "cmpl-v-0-22222222"
D_ID = "cmpl-v-0-11111111"


def _registrations_at_p(pair) -> int:
    return pair.p.info()["tables"]["p_registrations"]


@pytest.mark.asyncio
@pytest.mark.parametrize("other", [[3, 99], [5, 5], [6, 7]], ids=["out_of_range", "twice", "other_free_blocks"])
async def test_duplicate_registration_with_other_blocks_is_ignored(other: list[int]) -> None:
    async with push_pair(d_blocks=16) as pair:
        pair.register_recv(D_ID, [3, 4])
        await wait_until(lambda: _registrations_at_p(pair) == 1, "the PUSH_REG to reach P")
        pair.register_recv(D_ID, other)
        await wait_until(lambda: metric(pair.d, "pushsvc_duplicates_total", kind="registration") == 1,
                         "the duplicate to be counted")
        await pair.dw.quiet_for(0.1)  # no RecvFailed for the live request
        assert metric(pair.d, "pushsvc_malformed_inputs_total", source="worker", reason="registration") == 0
        pair.send_ready(P_ID, [0, 1])
        await pair.pw.wait_for(wp.SendDone, P_ID)
        await pair.dw.wait_for(wp.RecvDone, D_ID)
        assert np.array_equal(pair.dw.snapshot(), expected_after_push(pair.pw, pair.dw, [0, 1], [3, 4]))
        await pair.dw.quiet_for(0.1)
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
@pytest.mark.parametrize("other", [[0, 99], [1, 1]], ids=["out_of_range", "twice"])
async def test_duplicate_send_ready_with_bad_blocks_is_ignored(other: list[int]) -> None:
    async with push_pair(p_blocks=8) as pair:
        pair.send_ready(P_ID, [0, 1])
        await wait_until(lambda: pair.p.info()["tables"]["p_staged"] == 1, "P to stage the blocks")
        pair.send_ready(P_ID, other)
        await wait_until(lambda: metric(pair.p, "pushsvc_duplicates_total", kind="finished_blocks") == 1,
                         "the duplicate to be counted")
        await pair.pw.quiet_for(0.1)  # no SendFailed for the live request
        pair.register_recv(D_ID, [3, 4])
        await pair.pw.wait_for(wp.SendDone, P_ID)
        await pair.dw.wait_for(wp.RecvDone, D_ID)
        assert np.array_equal(pair.dw.snapshot(), expected_after_push(pair.pw, pair.dw, [0, 1], [3, 4]))
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_registration_naming_a_held_block_is_refused_before_p_hears_of_it() -> None:
    async with push_pair(d_blocks=16) as pair:
        pair.register_recv(D_ID, [3, 4])
        await wait_until(lambda: _registrations_at_p(pair) == 1, "the PUSH_REG to reach P")
        pair.register_recv("cmpl-w-0-33333333", [9, 4])
        failed = await pair.dw.wait_for(wp.RecvFailed, "cmpl-w-0-33333333")
        assert "block 4 is held by live request" in failed.reason and failed.block_ids == [9, 4]
        assert metric(pair.d, "pushsvc_malformed_inputs_total", source="worker", reason="registration") == 1
        await pair.dw.quiet_for(0.1)
        assert _registrations_at_p(pair) == 1, "the refused registration never reached P"
        # The holder is served as before; once it is final its blocks can be registered again.
        pair.send_ready(P_ID, [0, 1])
        await pair.dw.wait_for(wp.RecvDone, D_ID)
        await pair.pw.wait_for(wp.SendDone, P_ID)
        pair.register_recv("cmpl-w-0-33333333", [9, 4])
        await wait_until(lambda: _registrations_at_p(pair) == 1, "the new PUSH_REG to reach P")
        pair.dw.send(wp.Evict(request_ids=["cmpl-w-0-33333333"]))
        assert "cancelled" in (await pair.dw.wait_for(wp.RecvFailed, "cmpl-w-0-33333333")).reason
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_an_evicted_registration_holds_its_blocks_until_p_confirms() -> None:
    async with push_pair(d_blocks=16) as pair:
        pair.register_recv(D_ID, [3, 4])
        await wait_until(lambda: _registrations_at_p(pair) == 1, "the PUSH_REG to reach P")
        pair.dw.send(wp.Evict(request_ids=[D_ID]))
        pair.register_recv("cmpl-x-0-44444444", [4])  # sent before the eviction is final
        events = [await pair.dw.wait_for(wp.RecvFailed) for _ in range(2)]
        by_id = {e.request_id: e.reason for e in events}
        assert by_id[D_ID] == "cancelled"
        assert "held by live request" in by_id["cmpl-x-0-44444444"]
        await assert_tables_empty(pair.p, pair.d)
