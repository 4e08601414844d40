"""What a worker may hand the daemon: only sealed memfds (a truncation would make the
daemon's mapping fault), ranks inside the TP size it claims, one worker per rank and one
TP size per daemon; and a rank whose worker left is released once nothing of it is in
flight."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import AsyncIterator

import pytest
from daemon_fixtures import WAIT_S, Worker, kv_regions, running_daemon, wait_until

from pushsvc.client import DaemonClient
from pushsvc.engine.fake import FakeEngine
from pushsvc.errors import DaemonUnavailable, ProtocolError
from pushsvc.server.daemon import Daemon
from pushsvc.shm import SharedBuffer

ENGINE = "unit"
BLOCKS = 8


@contextlib.asynccontextmanager
async def daemon() -> AsyncIterator[tuple[Daemon, FakeEngine]]:
    fake = FakeEngine()
    async with running_daemon(fake, ENGINE) as d:
        yield d, fake


async def register(worker: Worker, fd: int):
    return await asyncio.to_thread(worker.client.register_kv, [fd], kv_regions(BLOCKS))


@pytest.mark.asyncio
async def test_an_unsealed_memfd_is_refused_and_the_connection_lives() -> None:
    async with daemon() as (d, _):
        w = Worker(d, "both")
        fd = os.memfd_create("unsealed")  # what the daemon cannot trust not to shrink
        os.ftruncate(fd, 2 * BLOCKS * 64)
        try:
            await w.connect()
            with pytest.raises(ProtocolError, match="not sealed against shrinking"):
                await register(w, fd)
            await w.ping(1)  # still connected
            buf = SharedBuffer.create(2 * BLOCKS * 64)  # sealed, as the connector's memory is
            try:
                assert (await register(w, buf.fd)).regions == 2
                with pytest.raises(PermissionError):
                    os.ftruncate(buf.fd, 0)  # the worker itself can no longer shrink it
            finally:
                w.close()
                buf.close()
        finally:
            os.close(fd)


@pytest.mark.asyncio
async def test_a_plain_file_is_refused_as_kv_memory() -> None:
    async with daemon() as (d, _):
        w = Worker(d, "both")
        with tempfile.TemporaryFile() as f:
            f.truncate(2 * BLOCKS * 64)
            try:
                await w.connect()
                with pytest.raises(ProtocolError, match="must be a memfd"):
                    await register(w, f.fileno())
            finally:
                w.close()


@pytest.mark.asyncio
async def test_a_rank_outside_its_tp_size_is_refused_at_hello() -> None:
    async with daemon() as (d, _):
        client = DaemonClient(d.config.socket_path, engine_id="", rank=3, tp_size=2, role="both", timeout_s=WAIT_S)
        with pytest.raises((DaemonUnavailable, ProtocolError), match="rank 3 is not below the TP size 2"):
            await asyncio.to_thread(client.connect)
        client.close()
        assert not d.service.ranks.all()


@pytest.mark.asyncio
async def test_ranks_of_one_daemon_share_one_tp_size() -> None:
    async with daemon() as (d, _):
        first = Worker(d, "both", rank=0, tp_size=2)
        other = DaemonClient(d.config.socket_path, engine_id="", rank=1, tp_size=4, role="both", timeout_s=WAIT_S)
        try:
            await first.connect()
            with pytest.raises((DaemonUnavailable, ProtocolError), match="differs from rank 0"):
                await asyncio.to_thread(other.connect)
        finally:
            first.close()
            other.close()


@pytest.mark.asyncio
async def test_a_second_worker_for_a_connected_rank_names_the_likely_cause() -> None:
    async with daemon() as (d, _):
        first = Worker(d, "both")
        second = DaemonClient(d.config.socket_path, engine_id="", rank=0, tp_size=1, role="both", timeout_s=WAIT_S)
        try:
            await first.connect()
            with pytest.raises((DaemonUnavailable, ProtocolError), match="one daemon per engine"):
                await asyncio.to_thread(second.connect)
        finally:
            first.close()
            second.close()


@pytest.mark.asyncio
async def test_a_rank_whose_worker_left_is_released_once_idle() -> None:
    async with daemon() as (d, fake):
        w = Worker(d, "both")
        await w.start(BLOCKS)
        name = d.service.ranks.current[0].agent.name
        assert name in fake.agents
        w.close()
        await wait_until(lambda: name not in fake.agents, "the idle rank's agent to be released")
        assert not d.service.ranks.all()
        assert d.info()["nixl_handles"] == {"registrations": 0, "dlists": 0, "xfers": 0, "remote_agents": 0}
