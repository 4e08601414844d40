"""The table gauges follow the tables on every path, not only where they were set.

A push that completes in the progress loop (WRITE settled on P, completion on D) used
to leave ``pushsvc_table_entries`` and ``pushsvc_inflight_writes`` at their last
eagerly-set values: a leak to every dashboard, though the tables were empty.
"""

from __future__ import annotations

import pytest
from daemon_fixtures import assert_tables_empty, metric, push_pair, wait_until

from pushsvc.protocol import worker as wp

TABLES = ("p_registrations", "p_staged", "p_writing", "d_pending")


def gauges(daemon) -> dict[str, float]:
    out = {t: metric(daemon, "pushsvc_table_entries", table=t) for t in TABLES}
    out["inflight"] = metric(daemon, "pushsvc_inflight_writes")
    return out


@pytest.mark.asyncio
async def test_gauges_return_to_zero_after_pushes_and_cancellations() -> None:
    async with push_pair(d_blocks=16) as pair:
        pair.register_recv("cmpl-g-0-11111111", [3, 4])
        await wait_until(lambda: gauges(pair.d)["d_pending"] == 1, "D's gauge to count the registration")
        await wait_until(lambda: gauges(pair.p)["p_registrations"] == 1, "P's gauge to count the registration")
        pair.send_ready("cmpl-g-0-22222222", [0, 1])
        await pair.pw.wait_for(wp.SendDone, "cmpl-g-0-22222222")
        await pair.dw.wait_for(wp.RecvDone, "cmpl-g-0-11111111")
        # A registration P already holds, then withdrawn: PushCancelled ends it on D.
        pair.register_recv("cmpl-h-0-11111111", [5])
        await wait_until(lambda: gauges(pair.p)["p_registrations"] == 1, "the second PUSH_REG to reach P")
        pair.dw.send(wp.Evict(request_ids=["cmpl-h-0-11111111"]))
        await pair.dw.wait_for(wp.RecvFailed, "cmpl-h-0-11111111")
        await assert_tables_empty(pair.p, pair.d)
        for daemon in (pair.p, pair.d):
            assert gauges(daemon) == {t: 0.0 for t in (*TABLES, "inflight")}
