"""The demo's lifecycle: work directory, the ``Stack`` of processes, exit codes, clean-up.

Every process the demo starts belongs to one ``Stack``, closed on every way out: success,
failure, Ctrl-C (exit 130), SIGTERM (exit 143). A second Ctrl-C while closing kills what is
left at once. On failure the work directory (one log per process) is kept and named.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from pushsvc.demo.console import Console
from pushsvc.launch import Stack

EXIT_FAILED = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C'd program
EXIT_TERMINATED = 143  # 128 + SIGTERM


@dataclass(frozen=True)
class DemoOptions:
    model_dir: str
    prompts: int = 12
    max_tokens: int = 32
    concurrency: int = 4
    workdir: str | None = None
    keep_logs: bool = False
    transfer_only: bool = False
    requests: int = 16  # --transfer-only
    blocks: int = 64  # --transfer-only


def default_model_dir(home: Path) -> str:
    """Under ``home``'s cache when that is writable, else in /tmp."""
    cache = home / ".cache" / "pushsvc"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:
        return "/tmp/pushsvc-demo-model"
    return str(cache / "tiny-llama")


class _Terminated(Exception):
    """SIGTERM arrived: unwind like Ctrl-C so that the Stack is closed."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminated()


def run_demo(options: DemoOptions) -> int:
    console = Console()
    started = time.monotonic()
    workdir = Path(options.workdir) if options.workdir else Path(tempfile.mkdtemp(prefix="pushsvc-demo-"))
    stack = Stack(workdir, progress=console.stack_progress)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    code = EXIT_FAILED
    try:
        try:
            code = 0 if _run(stack, console, options) else EXIT_FAILED
        finally:
            console.freeze()  # a counter left live must not sit under what follows
    except KeyboardInterrupt:
        console.line()
        console.line("interrupted (Ctrl-C)")
        code = EXIT_INTERRUPTED
    except _Terminated:
        console.line("terminated (SIGTERM)")
        code = EXIT_TERMINATED
    except (RuntimeError, ValueError, OSError) as exc:
        # Stack's start-up errors carry the tail of the failing process's log.
        console.line()
        console.line(f"demo failed: {exc}")
    except Exception:  # noqa: BLE001 - a bug: show it, and still stop every process
        console.line()
        console.line("demo failed with an unexpected error:")
        console.line(traceback.format_exc().rstrip())
    finally:
        if code not in (0, EXIT_INTERRUPTED, EXIT_TERMINATED):
            _show_dead(stack, console)
        _close(stack, console)
        signal.signal(signal.SIGTERM, previous)
        console.close()
    if code == 0 and not options.keep_logs and not options.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        console.line(f"logs: {workdir}/*.log")
    console.line(f"demo took {_duration(time.monotonic() - started)}, exit code {code}")
    return code


def _run(stack: Stack, console: Console, options: DemoOptions) -> bool:
    if options.transfer_only:
        from pushsvc.demo.transfer import run_transfer_demo

        return run_transfer_demo(stack, console, requests=options.requests, blocks=options.blocks)
    from pushsvc.demo.serving import ServingOptions, run_serving_demo

    return run_serving_demo(stack, console, ServingOptions(options.model_dir, options.prompts, options.max_tokens,
                                                           options.concurrency))


def _close(stack: Stack, console: Console) -> None:
    if not stack.procs:
        return
    names = ", ".join(p.name for p in reversed(stack.procs))
    console.status("stop", f"stopping {names} ...")
    try:
        codes = stack.close()
    except (KeyboardInterrupt, _Terminated):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # killing takes a moment; do not leave half of it
        try:
            console.line("killing what is left")
            for proc in list(stack.procs):
                proc.stop(timeout=5, sig=signal.SIGKILL)
            stack.procs.clear()
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        return
    console.finish("stop", "stopped " + ", ".join(f"{name} ({code})" for name, code in codes.items()))


def _show_dead(stack: Stack, console: Console) -> None:
    """The log tails of the processes that exited on their own."""
    for proc in stack.procs:
        if not proc.alive():
            console.line(f"{proc.name} exited with {proc.popen.returncode}; last lines of {proc.log}:")
            for line in proc.tail(20).splitlines():
                console.line(f"    {line}")


def _duration(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes}m{s:02d}s" if minutes else f"{seconds:.1f}s"
