"""Helpers for tests that run real daemons in-process against the in-package fake engine.

Everything is real except NIXL: Unix sockets, the TCP side channel on 127.0.0.1 port 0,
memfd shared memory and the HTTP health server. Daemons share one ``FakeEngine`` so
their agents can reach each other by name. Workers are ``DaemonClient``s whose blocking
setup calls run in a thread; afterwards the test polls them from the event loop.

Plain helpers and async context managers (not fixtures), imported by the test modules
that need them; ``conftest.py`` belongs to the pure-state tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np

from pushsvc.client import DaemonClient
from pushsvc.config import Config, load_config
from pushsvc.engine.fake import FakeEngine
from pushsvc.protocol import worker as wp
from pushsvc.server.daemon import Daemon
from pushsvc.shm import SharedBuffer

BLOCK_LEN = 64
REGIONS = 2  # K and V of one layer: two regions per buffer
WAIT_S = 5.0  # upper bound for anything that should happen "promptly"; never a speed claim
LONG_S = 60.0  # leases and watchdogs that must not fire during a test

ZERO_TABLES = {"p_registrations": 0, "p_staged": 0, "p_writing": 0, "d_pending": 0, "inflight": 0}

P_ENGINE = "prefill"
D_ENGINE = "decode"


# ---------------------------------------------------------------- daemons


def daemon_config(runtime_dir: str, engine_id: str, **overrides: Any) -> Config:
    values: dict[str, Any] = {
        "engine_id": engine_id,
        "runtime_dir": runtime_dir,
        "health_port": 0,
        "side_channel_port": 0,
        "lease_s": LONG_S,
        "watchdog_s": LONG_S,
        "registration_ttl_s": LONG_S,
        "drain_timeout_s": WAIT_S,
        **overrides,
    }
    return load_config(None, env={}, overrides=values)


@contextlib.asynccontextmanager
async def running_daemon(engine: Any, engine_id: str, *, devmem: Any = None, notifier: Any = None,
                         **overrides: Any) -> AsyncIterator[Daemon]:
    """A started daemon with its runtime dir under a short /tmp path; shut down on exit.
    ``devmem``: the device memory it gets (``devmem.fake``), none by default; ``notifier``:
    its service-manager notifier (``sdnotify``), the daemon's inert default if None."""
    base = tempfile.mkdtemp(prefix="ps")
    extra = {"notifier": notifier} if notifier is not None else {}
    daemon = Daemon(daemon_config(f"{base}/rt", engine_id, **overrides), engine=engine, devmem=devmem, **extra)
    try:
        await daemon.startup()
        yield daemon
    finally:
        await daemon.shutdown()
        shutil.rmtree(base, ignore_errors=True)


def metric(daemon: Daemon, name: str, **labels: str) -> float:
    """One Prometheus sample of ``daemon`` (0 when the labelled child was never touched)."""
    value = daemon.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def http_get(daemon: Daemon, path: str) -> tuple[int, Any]:
    """GET ``path`` from the daemon's health server: (status, JSON body or text)."""
    url = f"http://{daemon.config.health_host}:{daemon.health.port}{path}"
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        if resp.content_type == "application/json":
            return resp.status, await resp.json()
        return resp.status, await resp.text()


async def wait_until(predicate: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.005)


async def assert_tables_empty(*daemons: Daemon) -> None:
    """Every matching table and in-flight set of every daemon drains to zero, as seen by
    ``Daemon.info()`` and, for running daemons, by ``/v1/info``."""
    for daemon in daemons:
        def empty(daemon: Daemon = daemon) -> bool:
            return daemon.info()["tables"] == ZERO_TABLES

        with contextlib.suppress(AssertionError):
            await wait_until(empty, "the tables to empty")
        assert daemon.info()["tables"] == ZERO_TABLES, daemon.config.engine_id
        if daemon.started and not daemon.stopped:
            status, body = await http_get(daemon, "/v1/info")
            assert status == 200
            assert body["tables"] == ZERO_TABLES


def free_tcp_port() -> int:
    """A loopback port where nothing listens (bound once, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- workers


def kv_regions(num_blocks: int, block_len: int = BLOCK_LEN, heads: int = 0) -> list[wp.Region]:
    """``REGIONS`` dense regions back to back in buffer 0 (``heads``: head-major blocks)."""
    return [
        wp.Region(buffer=0, offset=r * num_blocks * block_len, block_len=block_len, num_blocks=num_blocks,
                  heads=heads)
        for r in range(REGIONS)
    ]


class Worker:
    """A vLLM worker stand-in: a ``DaemonClient`` plus one memfd KV buffer."""

    def __init__(self, daemon: Daemon, role: wp.Role, *, rank: int = 0, tp_size: int = 1,
                 engine_id: str | None = None, pp_rank: int = 0, pp_size: int = 1) -> None:
        self.daemon = daemon
        self.client = DaemonClient(daemon.config.socket_path, engine_id=engine_id or daemon.config.engine_id,
                                   rank=rank, tp_size=tp_size, role=role, timeout_s=WAIT_S, pp_rank=pp_rank,
                                   pp_size=pp_size)
        self.buffer: SharedBuffer | None = None
        self.num_blocks = 0
        self.block_len = BLOCK_LEN
        self.initial: np.ndarray | None = None
        self.events: list[Any] = []

    async def connect(self) -> wp.Welcome:
        return await asyncio.to_thread(self.client.connect)

    async def register(self, num_blocks: int, block_len: int = BLOCK_LEN, seed: int = 0,
                       heads: int = 0) -> wp.KVRegistered:
        """Create the KV buffer, fill it with seeded random bytes, register it."""
        self.num_blocks, self.block_len = num_blocks, block_len
        self.buffer = SharedBuffer.create(REGIONS * num_blocks * block_len)
        pattern = np.random.default_rng(seed).integers(0, 256, self.buffer.size, dtype=np.uint8).tobytes()
        ctypes.memmove(self.buffer.address, pattern, len(pattern))
        self.initial = self.snapshot()
        return await asyncio.to_thread(self.client.register_kv, [self.buffer.fd],
                                       kv_regions(num_blocks, block_len, heads))

    async def start(self, num_blocks: int, block_len: int = BLOCK_LEN, seed: int = 0, heads: int = 0) -> None:
        await self.connect()
        await self.register(num_blocks, block_len, seed, heads)

    def send(self, msg: Any) -> None:
        self.client.send(msg)

    def snapshot(self) -> np.ndarray:
        assert self.buffer is not None
        return np.frombuffer(bytes(self.buffer.view()), dtype=np.uint8)

    def block(self, image: np.ndarray, region: int, block: int) -> np.ndarray:
        start = (region * self.num_blocks + block) * self.block_len
        return image[start : start + self.block_len]

    def poll(self) -> None:
        self.events += self.client.poll()

    async def wait_for(self, kind: type | tuple[type, ...], request_id: str | None = None,
                       timeout: float = WAIT_S) -> Any:
        """The first not yet consumed event of ``kind`` (and ``request_id``); consumed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            for i, ev in enumerate(self.events):  # those already read first: the daemon may have closed since
                if isinstance(ev, kind) and (request_id is None or getattr(ev, "request_id", None) == request_id):
                    return self.events.pop(i)
            self.poll()
            for i, ev in enumerate(self.events):
                if isinstance(ev, kind) and (request_id is None or getattr(ev, "request_id", None) == request_id):
                    return self.events.pop(i)
            if loop.time() > deadline:
                raise AssertionError(f"no {kind} {request_id or ''} within {timeout}s; events: {self.events}")
            await asyncio.sleep(0.005)

    async def quiet_for(self, duration: float) -> None:
        """Poll for ``duration`` and assert that no event arrived."""
        loop = asyncio.get_running_loop()
        end = loop.time() + duration
        while loop.time() < end:
            self.poll()
            assert self.events == [], f"unexpected events: {self.events}"
            await asyncio.sleep(0.005)

    async def ping(self, token: int) -> None:
        self.send(wp.Ping(token=token))
        pong = await self.wait_for(wp.Pong)
        assert pong.token == token

    def close(self) -> None:
        self.client.close()
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None


def expected_after_push(p: Worker, d: Worker, p_ids: list[int], d_ids: list[int]) -> np.ndarray:
    """D's buffer after P's blocks ``p_ids`` were pushed into D's ``d_ids``: P's last
    ``len(d_ids)`` blocks land in D's blocks in order, region by region; nothing else moves."""
    assert p.initial is not None and d.initial is not None and p.block_len == d.block_len
    out = d.initial.copy()
    tail = p_ids[len(p_ids) - len(d_ids) :]
    for r in range(REGIONS):
        for s, t in zip(tail, d_ids):
            d.block(out, r, t)[:] = p.block(p.initial, r, s)
    return out


# ---------------------------------------------------------------- a P/D pair


@dataclass
class PushPair:
    fake: FakeEngine
    p: Daemon
    d: Daemon
    pw: Worker
    dw: Worker

    def register_recv(self, request_id: str, block_ids: list[int], **overrides: Any) -> None:
        """D's worker asks for a push of ``request_id`` into ``block_ids`` from P."""
        fields: dict[str, Any] = {
            "request_id": request_id,
            "local_block_ids": [block_ids],
            "remote_engine_id": self.p.config.engine_id,
            "remote_host": "127.0.0.1",
            "remote_port": self.p.service.peers.port,
            **overrides,
        }
        self.dw.send(wp.RegisterRecv(**fields))

    def send_ready(self, request_id: str, block_ids: list[int]) -> None:
        self.pw.send(wp.SendReady(request_id=request_id, block_ids=[block_ids]))

    @property
    def p_agent(self) -> str:
        return self.p.service.ranks.current[0].agent.name

    @property
    def d_agent(self) -> str:
        return self.d.service.ranks.current[0].agent.name


@contextlib.contextmanager
def secret_file() -> Iterator[str]:
    """A side-channel secret file, as an operator would create it (mode 0600)."""
    base = tempfile.mkdtemp(prefix="pss")
    path = f"{base}/secret"
    with open(path, "wb") as f:
        f.write(os.urandom(32).hex().encode())
    os.chmod(path, 0o600)
    try:
        yield path
    finally:
        shutil.rmtree(base, ignore_errors=True)


@contextlib.asynccontextmanager
async def push_pair(*, p_blocks: int = 8, d_blocks: int = 16, p_block_len: int = BLOCK_LEN,
                    d_block_len: int = BLOCK_LEN, p_config: dict[str, Any] | None = None,
                    d_config: dict[str, Any] | None = None, authenticated: bool = False,
                    engines: tuple[Any, Any] | None = None) -> AsyncIterator[PushPair]:
    """Two daemons (P and D) sharing one fake engine, each with one registered worker;
    with ``authenticated``, their side channel shares a secret; with ``engines``, P and D
    run on these instead (real NIXL: ``pushsvc.engine.nixl.NixlEngine``; ``fake`` is then
    a fake nobody uses)."""
    fake = FakeEngine()
    with contextlib.ExitStack() as stack:
        if authenticated:
            secret = stack.enter_context(secret_file())
            p_config = {"side_channel_secret_file": secret, **(p_config or {})}
            d_config = {"side_channel_secret_file": secret, **(d_config or {})}
        async with _pair(fake, p_blocks, d_blocks, p_block_len, d_block_len, p_config, d_config,
                         engines or (fake, fake)) as pair:
            yield pair


@contextlib.asynccontextmanager
async def _pair(fake: FakeEngine, p_blocks: int, d_blocks: int, p_block_len: int, d_block_len: int,
                p_config: dict[str, Any] | None, d_config: dict[str, Any] | None,
                engines: tuple[Any, Any]) -> AsyncIterator[PushPair]:
    async with running_daemon(engines[0], P_ENGINE, **(p_config or {})) as p, \
            running_daemon(engines[1], D_ENGINE, **(d_config or {})) as d:
        pw, dw = Worker(p, "producer"), Worker(d, "consumer")
        try:
            await pw.start(p_blocks, p_block_len, seed=1)
            await dw.start(d_blocks, d_block_len, seed=2)
            yield PushPair(fake, p, d, pw, dw)
        finally:
            pw.close()
            dw.close()
