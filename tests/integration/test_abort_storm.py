"""Abort storm against two real daemons with real NIXL (driver: ``storm.py``).

At least 10,000 random operations (``PUSHSVC_STORM_OPS`` for more; ``PUSHSVC_STORM_SEED``
replays a run), three in ten of P's requests pushed layer by layer. Afterwards every table and gauge is 0 on both daemons, no WRITE handle
is left, and the daemons hold the file descriptors they held before the storm.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

HERE = Path(__file__).parent
MIN_OPS = 10_000


def _read_line(proc: subprocess.Popen, key: str, timeout: float) -> dict:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no {key!r} from the storm driver within {timeout}s"
        if sel.select(left):
            line = proc.stdout.readline()
            assert line, f"storm driver exited with {proc.wait()}: {proc.stderr.read()[-3000:]}"
            msg = json.loads(line)
            if key in msg:
                return msg[key]


def _wait_zero(daemons, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(not any(d.live_info()["tables"].values()) and d.metric("pushsvc_inflight_writes") == 0
               for d in daemons):
            return
        time.sleep(0.1)


def test_abort_storm_leaves_nothing_behind(spawn, base_dir):
    ops = max(MIN_OPS, int(os.environ.get("PUSHSVC_STORM_OPS", MIN_OPS)))
    seed = int(os.environ.get("PUSHSVC_STORM_SEED", random.SystemRandom().randrange(2**32)))
    print(f"abort storm: seed {seed}, {ops} operations (PUSHSVC_STORM_SEED={seed} replays it)")
    # Short lease and watchdog: stashed halves that are never matched end during the
    # storm too, through the timers, not only through aborts.
    # Late PUSH_REGs P cannot place are stashed until the registration TTL: short, so
    # that they are gone again soon after the storm.
    p_config = base_dir / "prefill.toml"
    p_config.write_text("registration_ttl_s = 2.0\n")
    P = spawn.daemon("prefill", "--lease-s", "3", "--config", str(p_config))
    D = spawn.daemon("decode", "--watchdog-s", "3")
    cmd = [sys.executable, str(HERE / "storm.py"), "--p-socket", P.socket, "--d-socket", D.socket,
           "--p-port", str(P.side_port), "--d-port", str(D.side_port), "--ops", str(ops), "--seed", str(seed), "--layerwise", "0.3"]
    driver = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, bufsize=1)
    try:
        _read_line(driver, "ready", 120)
        _wait_zero([P, D])
        before = {d.engine_id: d.live_info() for d in (P, D)}
        driver.stdin.write("go\n")
        driver.stdin.flush()
        summary = _read_line(driver, "summary", 900)
        print("abort storm summary:", json.dumps(summary, indent=1))
        report = os.environ.get("PUSHSVC_STORM_REPORT")
        if report:
            Path(report).write_text(json.dumps(summary, indent=1))
        assert summary["errors"] == [] and summary["error_count"] == 0, summary["errors"]
        assert summary["ops"] >= ops
        outcomes = summary["outcomes"]
        # The storm reached every ending, not just one.
        for key in ("p:SendDone:ok", "p:SendFailed:cancelled", "d:RecvDone:ok", "d:RecvFailed:cancelled",
                    "d:RecvFailed:registration"):
            assert outcomes.get(key, 0) > 0, (key, outcomes)
        assert summary["verified_recv_done"] == outcomes["d:RecvDone:ok"]
        # Layer-wise pushes ran, landed exactly (verified above) and were aborted mid-step too.
        assert summary["op_counts"].get("layer_step", 0) > 0 and summary["layerwise_recv_done"] > 0, summary

        _wait_zero([P, D])
        for d in (P, D):
            info = d.live_info()
            leaks = {
                "tables": {k: v for k, v in info["tables"].items() if v},
                "table_gauges": sum(d.metric("pushsvc_table_entries", table=t) for t in info["tables"] if t != "inflight"),
                "inflight_writes": d.metric("pushsvc_inflight_writes"),
                "xfers": info["nixl_handles"]["xfers"],
                "other_handles": {k: v - before[d.engine_id]["nixl_handles"][k]
                                  for k, v in info["nixl_handles"].items() if k != "xfers"},
                "fds": info["open_fds"] - before[d.engine_id]["open_fds"],
            }
            print(f"{d.engine_id} after the storm:", leaks)
            assert leaks == {"tables": {}, "table_gauges": 0, "inflight_writes": 0, "xfers": 0,
                             "other_handles": {k: 0 for k in leaks["other_handles"]}, "fds": 0}, leaks
        counters = {
            "p_push_reg_after_cancel": P.metric("pushsvc_notifications_total", kind="push_reg_cancelled"),
            "p_duplicate_finished_blocks": P.metric("pushsvc_duplicates_total", kind="finished_blocks"),
            "p_transfers_done": P.metric("pushsvc_transfers_total", result="done"),
            "p_leases_expired": P.metric("pushsvc_leases_expired_total"),
            "p_registrations_expired": P.metric("pushsvc_failures_total", kind="registration_expired"),
            "p_refused_unknown_sender": P.metric("pushsvc_malformed_inputs_total", reason="push_reg_sender_unknown"),
            "d_duplicate_registrations": D.metric("pushsvc_duplicates_total", kind="registration"),
            "d_refused_registrations": D.metric("pushsvc_malformed_inputs_total", source="worker",
                                                reason="registration"),
            "d_late_completions": D.metric("pushsvc_notifications_total", kind="late_completion"),
            "d_foreign_completions": D.metric("pushsvc_malformed_inputs_total", reason="foreign_completion"),
            "d_watchdog_expired": D.metric("pushsvc_watchdog_expired_total"),
        }
        print("daemon counters:", counters)
        # Refused registrations, duplicates and foreign completions were counted.
        assert D.metric("pushsvc_malformed_inputs_total", source="worker", reason="registration") > 0
        assert D.metric("pushsvc_duplicates_total", kind="registration") > 0
        assert D.metric("pushsvc_notifications_total", kind="late_completion") > 0
        assert D.metric("pushsvc_malformed_inputs_total", reason="foreign_completion") > 0
        assert P.metric("pushsvc_duplicates_total", kind="finished_blocks") > 0
        assert counters["p_push_reg_after_cancel"] > 0  # late PUSH_REGs met D's withdrawal
        assert P.get("/healthz")[0] == 200 and D.get("/healthz")[0] == 200
    finally:
        if driver.poll() is None:
            driver.stdin.close()
            try:
                driver.wait(20)
            except subprocess.TimeoutExpired:
                driver.kill()
                driver.wait()
        driver.stdout.close()
        driver.stderr.close()
