"""``Stack`` start-up and stopping: a server that was stopped while it started (by the stack,
or by SIGINT/SIGTERM) is not a start-up crash and is not started again; one that crashed on
its own is, once. Real processes stand in for vLLM; none becomes ready."""

from __future__ import annotations

import signal
import socket
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from pushsvc.demo.serving import _start_together
from pushsvc.launch import Proc, Stack, Stopped, free_port, vllm_dtype

WAIT_S = 10.0  # bound on anything that should happen soon; the tests pass far below it

# The stand-in vLLM server. It records each start; a second start exits 1 at once (so a
# stack that restarts it fails fast); "crash" exits 1 every time. Otherwise it tells the
# test it is up (its signal handling in place) and waits for a signal, with Python's own
# SIGINT handling (KeyboardInterrupt: it dies of SIGINT), or with "clean-sigterm" exiting
# 0 on SIGTERM as uvicorn does.
STANDIN = r"""
import os, signal, socket, sys
starts, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with open(starts, "a") as f:
    f.write(f"{os.getpid()}\n")
with open(starts) as f:
    again = len(f.readlines()) > 1
if again or mode == "crash":
    sys.exit(1)
# Python's own SIGINT handling even where it starts with SIGINT ignored (a background job
# of a non-interactive shell, as CI may run the suite): vLLM installs its handlers too.
signal.signal(signal.SIGINT, signal.default_int_handler)
if mode == "clean-sigterm":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
socket.create_connection(("127.0.0.1", port)).sendall(b"up")
signal.pause()
"""


def _closed_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@contextmanager
def _listening() -> Iterator[socket.socket]:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        srv.settimeout(WAIT_S)
        yield srv


def _wait_up(srv: socket.socket) -> None:
    conn, _ = srv.accept()
    with conn:
        assert conn.recv(2) == b"up"


def _start(stack: Stack, name: str, srv: socket.socket, mode: str) -> Proc:
    argv = [sys.executable, "-c", STANDIN, str(_starts(stack, name)), str(srv.getsockname()[1]), mode]
    return stack.server(name, argv, _closed_url(), timeout=WAIT_S)


def _starts(stack: Stack, name: str) -> Path:
    return stack.workdir / f"{name}.starts"


def _count(stack: Stack, name: str) -> int:
    path = _starts(stack, name)
    return len(path.read_text().splitlines()) if path.exists() else 0


@contextmanager
def _in_thread() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(1) as pool:
        yield pool


def _failure(future: Future[Proc]) -> BaseException | None:
    return future.exception(WAIT_S)


def test_a_server_killed_by_sigint_while_starting_is_not_started_again(tmp_path: Path) -> None:
    lines: list[str] = []
    with _listening() as srv, Stack(tmp_path, progress=lines.append) as stack, _in_thread() as pool:
        future = pool.submit(_start, stack, "vllm-p", srv, "sigint")
        _wait_up(srv)
        (proc,) = stack.procs
        proc.popen.send_signal(signal.SIGINT)  # what a Ctrl-C reaching the server does
        error = _failure(future)
        assert isinstance(error, Stopped) and "vllm-p was stopped during start-up" in str(error)
        assert proc.popen.returncode == -signal.SIGINT and not proc.stopping  # the signal, not the stack
    assert _count(stack, "vllm-p") == 1
    assert not [line for line in lines if "once more" in line]


def test_a_server_the_stack_stops_while_starting_is_not_started_again_even_if_it_exits_0(tmp_path: Path) -> None:
    lines: list[str] = []
    with _listening() as srv, Stack(tmp_path, progress=lines.append) as stack, _in_thread() as pool:
        future = pool.submit(_start, stack, "vllm-p", srv, "clean-sigterm")
        _wait_up(srv)
        (proc,) = stack.procs
        assert stack.stop(proc) == 0  # its exit status says nothing: the stack knows it stopped it
        assert isinstance(_failure(future), Stopped)
    assert _count(stack, "vllm-p") == 1 and stack.procs == []
    assert not [line for line in lines if "once more" in line]


def test_a_server_that_crashes_while_starting_is_started_once_more(tmp_path: Path) -> None:
    lines: list[str] = []
    with _listening() as srv, Stack(tmp_path, progress=lines.append) as stack:
        with pytest.raises(RuntimeError, match="vllm-p exited with 1") as info:
            _start(stack, "vllm-p", srv, "crash")
        assert not isinstance(info.value, Stopped)
    assert _count(stack, "vllm-p") == 2
    assert [line for line in lines if "vllm-p exited during start-up" in line and "once more" in line]
    assert (tmp_path / "vllm-p.failed.log").exists()


def test_a_stack_that_refuses_starts_spawns_nothing(tmp_path: Path) -> None:
    with _listening() as srv, Stack(tmp_path) as stack:
        stack.refuse_starts()
        with pytest.raises(Stopped, match="not starting vllm-p"):
            _start(stack, "vllm-p", srv, "sigint")
        assert stack.procs == []
    assert _count(stack, "vllm-p") == 0
    closed = Stack(tmp_path / "closed")
    closed.close()
    with pytest.raises(Stopped):
        closed.daemon("prefill")


def test_starting_p_and_d_together_stops_the_other_without_restarting_it_when_one_fails(tmp_path: Path) -> None:
    """The demo's path on Ctrl-C, SIGTERM or a failed start: what is still starting is
    stopped, and its wait ends without a second start."""
    lines: list[str] = []
    with _listening() as srv, Stack(tmp_path, progress=lines.append) as stack:
        def start_p() -> Proc:
            return _start(stack, "vllm-p", srv, "clean-sigterm")  # never ready: it waits until stopped

        def d_once_p_is_up() -> Proc:
            _wait_up(srv)  # P is up and waiting when D fails
            return _start(stack, "vllm-d", srv, "crash")

        with pytest.raises(RuntimeError, match="vllm-d exited with 1") as info:
            _start_together(stack, {"vllm-p": start_p, "vllm-d": d_once_p_is_up})
        assert not isinstance(info.value, Stopped)
        assert stack.procs == [] and stack.stopping
    assert _count(stack, "vllm-p") == 1 and _count(stack, "vllm-d") == 2
    assert not [line for line in lines if "vllm-p exited during start-up" in line]


def test_free_port_never_hands_out_a_port_twice() -> None:
    """The kernel offers a closed probe's port again (tens of times in a thousand draws on
    Linux); vLLM's API server binds with SO_REUSEPORT, so two servers given one port would
    both start and share its connections. Every port handed out is a new one, and free."""
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # nobody holds it


def test_vllm_runs_in_float32_only_on_a_cpu_with_amx_tiles(tmp_path: Path) -> None:
    """vLLM's bfloat16 kernels take AMX there: a token computed alone then differs from
    it computed in a batch (D against colocated), and a TP 2 worker died of SIGILL."""
    amx, plain = tmp_path / "amx", tmp_path / "plain"
    amx.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile amx_int8\n\n")
    plain.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\n")
    assert vllm_dtype(str(amx)) == "float32"
    assert vllm_dtype(str(plain)) == "bfloat16"
    assert vllm_dtype(str(tmp_path / "absent")) == "bfloat16"
