"""``make bench-latency`` (benchmarks/latency.py): the runs of one deployment are told apart
by the request-id prefix vLLM's client sends, and the table sets pushsvc's phases beside
colocated's TTFT; the wrapper starts vLLM's own serving client."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import latency  # noqa: E402
import serving  # noqa: E402
import vllm_serve  # noqa: E402

START = "2026-12-01T12:00:00+00:00"


def _proxy(rid: str, **ms: float) -> dict:
    return {"event": "request_timeline", "side": "proxy", "request_id": rid, "start": START, "events_ms": ms}


def _daemon(rid: str, side: str, **ms: float) -> dict:
    return {"request_id": rid, "side": side, "start": START, "events_ms": ms}


def test_phases_count_only_the_requests_of_the_run_they_belong_to(monkeypatch) -> None:
    monkeypatch.setattr(serving.time, "sleep", lambda _s: None)
    proxy, p, d = [], [], []
    for run, ttft in (("pushsvc-in64-c1-", 20.0), ("pushsvc-in256-c1-", 90.0)):
        for i in range(3):
            rid = f"{run}{i}"
            proxy.append(_proxy(rid, prefill_answered=ttft / 2, decode_first_chunk=ttft - 1, first_chunk_sent=ttft))
            p.append(_daemon(f"cmpl-{rid}-0-ab12cd34", "send", send_ready=ttft / 4, write_settled=ttft / 4 + 2))
            d.append(_daemon(f"cmpl-{rid}-0-ef56ab78", "recv", recv_done=ttft / 4 + 3))
    dep = serving.Deployment("http://x", {}, timelines=lambda n: (proxy[-n:], p[-n:], d[-n:]))
    got = serving.phase_medians(dep, 3, "pushsvc-in64-c1-")
    assert got is not None and got["requests"] == 3 and got["ttft"] == 20.0 and got["transfer"] == 2.0
    stats = serving.phase_stats(dep, 3, "pushsvc-in64-c1-")
    assert stats is not None and stats["p50"] == got and stats["tail"]["ttft"] == 0.0  # three equal requests
    # Each request of the run, by the proxy's request id, kept for the JSON.
    assert sorted(stats["per_request"]) == [f"pushsvc-in64-c1-{i}" for i in range(3)]
    assert all(r["ttft"] == 20.0 and r["transfer"] == 2.0 for r in stats["per_request"].values())
    assert serving.phase_medians(serving.Deployment("http://y", {}), 3, "colocated-") is None


def test_event_medians_keep_the_runs_requests_and_the_orders_a_quarter_took() -> None:
    proxy, p, d = [], [], []
    for run, posted in (("pushsvc-in64-c1-", 1.0), ("pushsvc-in256-c1-", 9.0)):
        for i in range(4):
            rid = f"{run}{i}"
            proxy.append(_proxy(rid, decode_first_chunk=30.0))
            # The first request of each run: D hears of the WRITE before P posted it.
            heard = posted - 0.5 if i == 0 else posted + 0.5
            p.append(_daemon(f"cmpl-{rid}-0", "send", send_ready=0.0, write_posted=posted, write_settled=posted + 2))
            d.append(_daemon(f"cmpl-{rid}-0", "recv", registered=0.0, write_announced=heard, recv_done=posted + 3))
    dep = serving.Deployment("http://x", {}, timelines=lambda n: (proxy[-n:], p[-n:], d[-n:]))
    gaps = latency.run_gaps(dep, 4, "pushsvc-in64-c1-")
    assert gaps["p.write_posted -> d.write_announced"] == [0.5, 0.5, 0.5]  # every request's, for the JSON
    got = latency.event_medians(gaps, 4)
    # Only the in64 run's four requests; each step's median and how many requests took it.
    assert got["p.write_posted -> d.write_announced"] == (0.5, 3)
    assert got["d.write_announced -> p.write_posted"] == (0.5, 1)  # one of four: a quarter, kept
    assert got["p.write_settled -> d.recv_done"] == (1.0, 4)
    assert all(n <= 4 for _, n in got.values())


def test_the_table_sets_pushsvc_phases_beside_colocated() -> None:
    run = {"input_len": 256, "concurrency": 1, "completed": 16, "failed": 0}
    res = {"points": [{"input_len": 256, "concurrency": 1}, {"input_len": 1024, "concurrency": 1}],
           "deployments": [
               {"deployment": "colocated", "runs": [{**run, "ttft_p50_ms": 50.0, "ttft_p90_ms": 55.0}]},
               {"deployment": "pushsvc", "runs": [{**run, "ttft_p50_ms": 75.0, "ttft_p90_ms": 90.0,
                                                    "phases_p50_ms": {"p_queue_prefill": 60.0, "transfer": 4.0}}]}]}
    lines = latency.table(res).splitlines()
    assert len(lines) == 3  # the 1024-token point has no runs: no row
    assert lines[2].startswith("| 256 | 1 | pushsvc | 50.0 | 75.0 | 1.50x | 1.20 | 60.0 | 4.0 | - |")
    assert lines[2].endswith("| - | - |")  # no tail measured: no owner


def test_the_layer_wise_goal_is_one_layers_transfer_and_one_d_step() -> None:
    run = {"input_len": 1024, "concurrency": 1, "completed": 16, "failed": 0, "ttft_p50_ms": 1.0, "ttft_p90_ms": 1.0}
    res = {"points": [{"input_len": 1024, "concurrency": 1}],
           "deployments": [
               {"deployment": "pushsvc", "runs": [{**run, "phases_p50_ms": {"transfer": 16.0, "after_prefill": 40.0}}]},
               {"deployment": "pushsvc-layerwise", "runs": [{**run, "tpot_p50_ms": 10.0,
                                                              "phases_p50_ms": {"after_prefill": 11.5}}]}]}
    assert latency.layerwise_goal(res, layers=8) == [
        "in1024 c=1: layer-wise TTFT - prefill 11.5 ms vs one layer's transfer 2.00 + one D step 10.0 = 12.0 ms: "
        "met (whole-request push: 40.0 ms)"]
    res["deployments"][1]["runs"][0]["phases_p50_ms"]["after_prefill"] = 12.5
    assert "not met" in latency.layerwise_goal(res, layers=8)[0]


def test_the_wrapper_runs_vllms_own_serving_client(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        vllm_serve.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--dataset-name" in out and "--random-input-len" in out and "--request-id-prefix" in out


def test_the_table_names_the_phase_that_holds_the_slowest_requests_time() -> None:
    run = {"input_len": 64, "concurrency": 1, "completed": 16, "failed": 0}
    res = {"points": [{"input_len": 64, "concurrency": 1}],
           "deployments": [
               {"deployment": "colocated", "runs": [{**run, "ttft_p50_ms": 10.0, "ttft_p90_ms": 11.0}]},
               {"deployment": "pushsvc", "runs": [{**run, "ttft_p50_ms": 30.0, "ttft_p90_ms": 90.0,
                                                    "phases_p50_ms": {"transfer": 3.0},
                                                    "phases_tail_ms": {"transfer": 2.5, "d_first_step": 51.25,
                                                                       "ttft": 60.0}}]}]}
    assert latency.table(res).splitlines()[2].endswith("| d_first_step +51.2 |")


def test_the_transfer_overhead_is_ttft_after_the_prefill_less_one_d_step() -> None:
    run = {"completed": 16, "failed": 0, "ttft_p50_ms": 1.0, "ttft_p90_ms": 1.0}
    res = {"points": [{"input_len": 256, "concurrency": c} for c in (1, 4, 8)],
           "deployments": [{"deployment": "pushsvc", "runs": [
               {**run, "input_len": 256, "concurrency": 1, "tpot_p50_ms": 8.0,
                "phases_p50_ms": {"after_prefill": 9.5}},
               {**run, "input_len": 256, "concurrency": 4, "tpot_p50_ms": 9.0,
                "phases_p50_ms": {"after_prefill": 30.0}},
               {**run, "input_len": 256, "concurrency": 8, "tpot_p50_ms": 10.0,
                "phases_p50_ms": {"after_prefill": 16.0}}]}]}
    assert latency.overhead_goal(res) == [
        "in256 c=1 pushsvc: transfer overhead 1.5 ms (TTFT - prefill 9.5 - one D step 8.0): goal <= 2 ms met",
        "in256 c=4 pushsvc: transfer overhead 21.0 ms (TTFT - prefill 30.0 - one D step 9.0): "
        "no goal at this concurrency",
        "in256 c=8 pushsvc: transfer overhead 6.0 ms (TTFT - prefill 16.0 - one D step 10.0): goal <= 5 ms not met"]


def test_the_spin_diagnostic_sets_vllms_worker_spin_in_the_processes_it_starts(tmp_path) -> None:
    """``--vllm-spin-ms``: a process started with the environment it builds gets vLLM's
    real ``SpinCondition`` with that spin; without the variable, vLLM's own second."""
    import os
    import subprocess

    probe = ("import zmq\n"
             "from vllm.distributed.device_communicators.shm_broadcast import SpinCondition\n"
             f"c = SpinCondition(True, zmq.Context(), 'ipc://{tmp_path}/notify')\n"
             "print(c.busy_loop_s)\n")
    env = {k: v for k, v in os.environ.items() if k != "BENCH_VLLM_SPIN_S"}
    latency.spin_env(2.5, env)
    assert env["PYTHONPATH"].split(os.pathsep)[0].endswith("benchmarks/vllm_spin")
    got = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    assert float(got.stdout.split()[-1]) == 0.0025
    del env["BENCH_VLLM_SPIN_S"]
    got = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0 and float(got.stdout.split()[-1]) == 1.0, got.stderr[-2000:]


def _serve_metrics(texts: list[str]):
    """A local /metrics endpoint that answers each scrape with the next of ``texts``."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = texts.pop(0).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _vllm_exposition(queue: tuple[float, int], first: tuple[float, int], ttft: tuple[float, int]) -> str:
    lines = ["# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request."]
    for name, (total, count) in (("request_queue_time_seconds", queue), ("request_prefill_time_seconds", first),
                                 ("time_to_first_token_seconds", ttft)):
        labels = '{engine="0",model_name="/tmp/m"}'
        lines += [f'vllm:{name}_bucket{{engine="0",le="0.01",model_name="/tmp/m"}} {count}',
                  f"vllm:{name}_sum{labels} {total}", f"vllm:{name}_count{labels} {count}"]
    lines.append('vllm:time_to_first_token_seconds_created{engine="0",model_name="/tmp/m"} 1.7e9')
    return "\n".join(lines) + "\n"


def test_vllms_own_means_per_server_over_one_run() -> None:
    """``--vllm-stats``: the histograms of D's vLLM, scraped before and after a run, give
    the run's means; the frontend's share is what TTFT leaves after queue and first token."""
    before = _vllm_exposition((1.0, 10), (0.5, 10), (2.0, 10))
    after = _vllm_exposition((1.0 + 4 * 0.0115, 14), (0.5 + 4 * 0.004, 14), (2.0 + 4 * 0.0212, 14))
    server = _serve_metrics([before, after])
    try:
        urls = {"D": f"http://127.0.0.1:{server.server_port}/metrics"}
        got = latency.vllm_means(serving._scrape(urls, latency.VLLM_TIMERS), serving._scrape(urls, latency.VLLM_TIMERS))
    finally:
        server.shutdown()
        server.server_close()
    assert got == {"D": {"queue": 11.5, "first_token": 4.0, "ttft": 21.2, "frontend": 5.7}}
    # A server that did not answer gives nothing, not a zero.
    assert latency.vllm_means({}, serving._scrape({"P": "http://127.0.0.1:9/metrics"}, latency.VLLM_TIMERS)) == {}


def test_the_bench_stack_keeps_vllms_statistics_only_when_asked(monkeypatch, tmp_path) -> None:
    seen = []
    monkeypatch.setattr(serving.Stack, "_spawn", lambda self, name, argv, env=None, on=None: seen.append(argv))
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--enforce-eager", "--disable-log-stats"]
    serving.BenchStack(tmp_path / "a")._spawn("v", argv)
    serving.BenchStack(tmp_path / "b", vllm_stats=True)._spawn("v", argv)
    serving.BenchStack(tmp_path / "c", vllm_stats=True)._spawn("daemon", ["pushsvc", "--disable-log-stats"])
    assert "--disable-log-stats" in seen[0] and "--disable-log-stats" not in seen[1]
    assert seen[2] == ["pushsvc", "--disable-log-stats"]  # only vLLM servers change
