"""``pushsvc demo``: the same prompts through colocated vLLM and through P/D with pushsvc.

1. Make the tiny local model (no model hub needed).
2. One colocated vLLM server (no connector): stream every prompt, keep the outputs as the
   reference and the TTFTs as the baseline, stop it.
3. P/D: a prefill and a decode daemon, a P vLLM (``kv_producer``, worker on cpu 0) and a
   D vLLM (``kv_consumer``, cpu 1) with ``PushsvcConnector``, and the proxy in front.
4. Stream the same prompts through the proxy; per request: TTFT, latency, and whether the
   output equals the colocated one. Then percentiles and the daemons' push counters.
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pushsvc.demo import report
from pushsvc.demo.console import Console
from pushsvc.launch import Proc, Stack, connector_config
from pushsvc.loadgen.client import Result, run_batch
from pushsvc.loadgen.prompts import Prompt, mixed_prompts
from pushsvc.tinymodel import ensure_tiny_model

# Longer than the benchmarks' minute: the demo is one try on whatever machine it is run,
# where a slow request is worth showing rather than cutting off.
REQUEST_TIMEOUT_S = 180.0
# Best candidates asked for with each token, from both deployments alike: colocated's tell
# whether a first token P/D answered differently was a bf16 near-tie (report.compare).
TOP_LOGPROBS = 5


@dataclass(frozen=True)
class ServingOptions:
    model_dir: str
    prompts: int = 12
    max_tokens: int = 32
    concurrency: int = 4


def run_serving_demo(stack: Stack, console: Console, options: ServingOptions) -> bool:
    """True if every P/D output equals its colocated output (one late bf16 near-tie aside)."""
    model = _ensure_model(console, options.model_dir)
    prompts = mixed_prompts(options.prompts, prefix="demo")
    warmup = mixed_prompts(1, prefix="warmup")
    words = [p.words for p in prompts]
    console.line(f"  {len(prompts)} prompts of {min(words)} to {max(words)} words, {options.max_tokens} tokens each "
                 f"(greedy), {options.concurrency} at a time; logs under {stack.workdir}")

    console.step("[2/4] colocated vLLM, no connector: reference outputs and baseline TTFT")
    colocated = stack.vllm("vllm-colocated", model)
    colocated_warmup = _batch(console, "warm-up", colocated.url, model, warmup, options,
                              describe=lambda rs: ", not measured")
    reference = _batch(console, "colocated", colocated.url, model, prompts, options,
                       describe=lambda rs: f"; TTFT {report.spread(rs, 'ttft_s')}")
    stack.stop(colocated)
    console.line("  colocated vLLM stopped")

    console.step("[3/4] P/D: two daemons, P vLLM (kv_producer, cpu 0), D vLLM (kv_consumer, cpu 1), the proxy")
    p_daemon = stack.daemon("prefill")
    d_daemon = stack.daemon("decode")
    p_vllm, d_vllm = _start_together(stack, {
        "vllm-p": lambda: stack.vllm("vllm-p", model, cpus="0",
                                     kv_transfer_config=connector_config("kv_producer", p_daemon)),
        "vllm-d": lambda: stack.vllm("vllm-d", model, cpus="1",
                                     kv_transfer_config=connector_config("kv_consumer", d_daemon)),
    })
    proxy = stack.proxy("proxy", [p_vllm], [p_daemon], [d_vllm])

    console.step(f"[4/4] {len(prompts)} prompts through the proxy, streamed, {options.concurrency} at a time")
    pd_warmup = _batch(console, "warm-up", proxy.url, model, warmup, options, describe=lambda rs: (
        f", TTFT {report.ms(rs[0].ttft_s)} ms (with the daemons' first handshake), "
        f"{report.compare(colocated_warmup[0], rs[0]).verdict}, not measured"))
    warm = report.compare(colocated_warmup[0], pd_warmup[0])
    console.line()
    console.line(report.TABLE_HEADER)
    by_id = {r.request_id: r for r in reference}
    comparisons: dict[str, report.Comparison] = {}

    def row(result: Result) -> None:
        comparisons[result.request_id] = c = report.compare(by_id[result.request_id], result)
        console.line(report.table_row(result, by_id[result.request_id], c))

    results = _batch(console, "P/D", proxy.url, model, prompts, options, on_result=row)
    passed, why = report.verdict([comparisons[r.request_id] for r in results])
    if warm.error:
        passed, why = False, f"the warm-up request failed: {warm.verdict}"

    console.step("summary")
    console.line(f"  outputs      {why}")
    console.line(f"  TTFT         P/D        {report.spread(results, 'ttft_s')}")
    console.line(f"               colocated  {report.spread(reference, 'ttft_s')}   "
                 f"(P/D p50 = {_ratio(results, reference, 'ttft_s')} colocated)")
    console.line(f"  latency      P/D        {report.spread(results, 'latency_s')}")
    console.line(f"               colocated  {report.spread(reference, 'latency_s')}")
    console.line("  daemons      (counters include the warm-up request)")
    for daemon in (p_daemon, d_daemon):
        samples = report.metric_samples(_get(f"{daemon.url}/metrics"))
        tables = json.loads(_get(f"{daemon.url}/v1/info"))["tables"]
        console.line(f"    {daemon.name:<11}{report.transfer_line(samples)}")
        console.line(f"    {'':<11}tables: " + " ".join(f"{k}={v}" for k, v in tables.items()))
    if any(not r.ok for r in [*results, *pd_warmup]):
        _show_tail(console, proxy)
    console.line()
    console.line(f"{'PASS' if passed else 'FAIL'}: {why}")
    return passed


def _ensure_model(console: Console, model_dir: str) -> str:
    console.step("[1/4] tiny model (random 8-layer Llama, bf16, tokenizer trained here)")
    if (Path(model_dir) / "model.safetensors").exists():
        path = ensure_tiny_model(model_dir)  # checks that it is the same model
        console.line(f"  found {path}")
        return path
    console.status("model", f"  generating {model_dir} ...", ticking=True)
    started = time.monotonic()
    path = ensure_tiny_model(model_dir)
    console.finish("model", f"  generated {path} in {time.monotonic() - started:.1f}s")
    return path


def _batch(console: Console, label: str, url: str, model: str, prompts: Sequence[Prompt], options: ServingOptions,
           on_result: Callable[[Result], None] = lambda r: None,
           describe: Callable[[list[Result]], str] | None = None) -> list[Result]:
    """Send ``prompts`` to ``url`` with a live counter; ``describe`` words the last line."""
    done = 0

    def finished(result: Result) -> None:
        nonlocal done
        done += 1
        on_result(result)
        console.status(label, f"  {label}: {done}/{len(prompts)} requests done")

    console.status(label, f"  {label}: 0/{len(prompts)} requests done")
    results, wall_s = run_batch(url, model, prompts, max_tokens=options.max_tokens, concurrency=options.concurrency,
                                on_result=finished, timeout_s=REQUEST_TIMEOUT_S, top_logprobs=TOP_LOGPROBS)
    failed = sum(not r.ok for r in results)
    summary = f"  {label}: {len(results)} request{'s' if len(results) > 1 else ''} in {wall_s:.1f}s"
    if failed:
        summary += f", {failed} FAILED"
    elif describe:
        summary += describe(results)
    console.finish(label, summary)
    return results


def _start_together(stack: Stack, starts: dict[str, Callable[[], Proc]]) -> list[Proc]:
    """Run the ``starts`` in parallel (vLLM start-up is mostly single-threaded Python)."""
    results: dict[str, Proc | BaseException] = {}

    def start(name: str, fn: Callable[[], Proc]) -> None:
        try:
            results[name] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            results[name] = exc

    threads = [threading.Thread(target=start, args=item, name=f"start-{item[0]}", daemon=True)
               for item in starts.items()]
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            _raise_first_failure(results)
            for t in threads:
                t.join(0.2)  # short joins: Ctrl-C reaches the main thread between them
        _raise_first_failure(results)
    except BaseException:
        # Ctrl-C, SIGTERM or a failed start: no thread may start (or restart) a process from
        # here on, and what they started is stopped; a thread's wait then ends with Stopped,
        # not with a retry (a server we stopped did not crash).
        stack.refuse_starts()
        _stop_named(stack, starts)
        for t in threads:
            t.join(10)
        raise
    return [results[name] for name in starts]  # type: ignore[misc]


def _stop_named(stack: Stack, names: Iterable[str]) -> None:
    for proc in [p for p in stack.procs if p.name in names]:
        stack.stop(proc)


def _raise_first_failure(results: dict[str, Proc | BaseException]) -> None:
    for outcome in list(results.values()):
        if isinstance(outcome, BaseException):
            raise outcome


def _ratio(results: Sequence[Result], reference: Sequence[Result], attr: str) -> str:
    got, base = report.p50(results, attr), report.p50(reference, attr)
    return "n/a" if math.isnan(got) or not base > 0 else f"{got / base:.2f}x"


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def _show_tail(console: Console, proc: Proc, lines: int = 15) -> None:
    console.line(f"  last lines of {proc.log}:")
    for line in proc.tail(lines).splitlines():
        console.line(f"    {report.log_line(line)}")
