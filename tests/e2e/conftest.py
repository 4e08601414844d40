"""Fixtures of the end-to-end tests: a tiny model, reference outputs from a colocated vLLM
(once per session: every module that compares against them shares them), and one P/D stack
(two daemons, vLLM P and D with the pushsvc connector, the proxy) per test module, which
its tests share (every vLLM server costs ~45 s of start-up on this host); a module's stack
stops before the next module's starts.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    LEASE_S,
    PD,
    WATCHDOG_S,
    E2EStack,
    Outcome,
    PDOptions,
    build_requests,
    generate_all,
)
from outputs import reference_request

from pushsvc.launch import Proc, connector_config
from pushsvc.tinymodel import ensure_tiny_model

MODEL_DIR = "/tmp/pushsvc-e2e-model"  # ensure_tiny_model is idempotent: made once per host


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: starts real vLLM servers, daemons and the proxy")


@pytest.fixture(scope="session", autouse=True)
def vllm_importable() -> None:
    """Fail, never skip, where vLLM cannot be imported: these tests are the only ones that
    run the connector inside vLLM, and a skipped e2e suite reads as a green one."""
    run = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True, timeout=300,
                         check=False)
    if run.returncode != 0:
        pytest.fail(f"`import vllm` failed (install the [vllm] extra: make venv):\n{run.stderr[-3000:]}",
                    pytrace=False)


@pytest.fixture(scope="session")
def model_path() -> str:
    return ensure_tiny_model(MODEL_DIR)


@pytest.fixture(scope="session")
def tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _daemon_supports(flag: str) -> bool:
    run = subprocess.run([sys.executable, "-m", "pushsvc", "serve", "--help"], capture_output=True, text=True,
                         timeout=60, check=True)
    return flag in run.stdout


def _start_in_parallel(**starters: Any) -> dict[str, Proc]:
    """vLLM start-up is mostly waiting (imports, engine init): overlap two of them."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(starters)) as pool:
        futures = {name: pool.submit(start) for name, start in starters.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.fixture(scope="session")
def colocated_refs(request: pytest.FixtureRequest, model_path: str, tokenizer: Any) -> dict[str, Outcome]:
    """Colocated vLLM's answers to every request of ``build_requests`` (each with its best
    tokens' logprobs: ``reference_request``), by request name. One server, started, asked
    and stopped here before any P/D stack of the modules that use them: its settings are
    the same for all of them, so are its greedy answers."""
    reqs = build_requests(tokenizer, model_path).all()
    with kept_on_failure(request) as workdir, E2EStack(workdir, progress=print) as st:
        started = time.monotonic()
        colocated = st.vllm("vllm-colocated", model_path)
        refs = generate_all(colocated.url, [reference_request(r) for r in reqs])
        bad = {r.name: str(refs[r.name]) for r in reqs
               if not refs[r.name].ok or len(refs[r.name].tokens) != r.body["max_tokens"]}
        assert not bad, f"colocated reference requests failed: {bad}\n{colocated.tail()}"
        print(f"  reference outputs in {time.monotonic() - started:.1f}s")
    return refs


def start_pd(workdir: Path, model_path: str, tokenizer: Any, refs: dict[str, Outcome],
             flags: dict[str, tuple[str, ...]] | None = None, *,
             prefill_extra: dict[str, Any] | None = None) -> Iterator[PD]:
    """Start a P/D stack and yield it; stopped on exit. ``refs``: the colocated reference
    outputs its tests compare against (``colocated_refs``, or none); ``flags`` are each
    daemon's, default lease and watchdog; ``prefill_extra``: more of P's
    ``kv_connector_extra_config``."""
    progress = print  # shown with -s, and in the report of a failed test's setup
    reqs = build_requests(tokenizer, model_path)
    verify = _daemon_supports("--verify")
    with E2EStack(workdir, progress=progress) as st:
        started = time.monotonic()
        common = ("--verify",) if verify else ()
        flags = flags or {"prefill": ("--lease-s", str(LEASE_S)), "decode": ("--watchdog-s", str(WATCHDOG_S))}
        flags = {name: (*f, *common) for name, f in flags.items()}
        pdaemon = st.daemon("prefill", *flags["prefill"])
        ddaemon = st.daemon("decode", *flags["decode"])
        servers = _start_in_parallel(
            prefill=lambda: st.vllm("vllm-p", model_path, kv_transfer_config=connector_config(
                "kv_producer", pdaemon, **(prefill_extra or {})), cpus="0"),
            decode=lambda: st.vllm("vllm-d", model_path, kv_transfer_config=connector_config("kv_consumer", ddaemon),
                                   cpus="1"),
        )
        proxy = st.proxy("proxy", prefill=[servers["prefill"]], prefill_daemons=[pdaemon],
                         decode=[servers["decode"]])
        progress(f"  P/D stack up {time.monotonic() - started:.1f}s after the start (workdir {workdir})")
        yield PD(st, model_path, reqs, refs, flags, verify, pdaemon, ddaemon, servers["prefill"],
                 servers["decode"], proxy)


@contextlib.contextmanager
def kept_on_failure(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A short work dir (Unix socket paths live under it), removed unless a test failed."""
    workdir = Path(tempfile.mkdtemp(prefix="pse2e-"))
    failed_before = request.session.testsfailed
    yield workdir
    if request.session.testsfailed == failed_before:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"e2e logs kept in {workdir}")


@pytest.fixture(scope="module")
def pd_options() -> PDOptions:
    return PDOptions()


# Module scope: each module starts its own stack and stops it before the next module's
# starts, so one vLLM pair at a time shares the host.
@pytest.fixture(scope="module")
def pd(request: pytest.FixtureRequest, model_path: str, tokenizer: Any, pd_options: PDOptions) -> Iterator[PD]:
    refs = request.getfixturevalue("colocated_refs") if pd_options.with_refs else {}
    with kept_on_failure(request) as workdir:
        yield from start_pd(workdir, model_path, tokenizer, refs, pd_options.flags,
                            prefill_extra=pd_options.prefill_extra)
