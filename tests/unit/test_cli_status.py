"""``pushsvc status`` against a real in-process daemon: tables for a person, ``--json`` for
scripts, and the exit status the systemd unit and the docs rely on (0 ready, 3 reachable
but not ready, 1 unreachable). The command blocks, so it runs in a thread while the
daemon's loop answers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from daemon_fixtures import Worker, free_tcp_port, push_pair, running_daemon, wait_until
from gpu_fixtures import gpu_pair

from pushsvc import cli
from pushsvc.engine.fake import FakeEngine
from pushsvc.protocol import worker as wp
from pushsvc.server.daemon import Daemon

TOKEN = "0123456789abcdef0123456789abcdef"


def _url(daemon: Daemon) -> str:
    return f"http://127.0.0.1:{daemon.health.port}"


async def _status(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()  # the daemons' own log lines so far
    code = await asyncio.to_thread(cli.main, ["status", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _rows(out: str, header: str) -> list[list[str]]:
    """The rows under the table whose header starts with ``header``, split on 2+ spaces."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        rows.append([cell for cell in line.split("  ") if cell.strip()])
    return rows


@pytest.mark.asyncio
async def test_a_ready_pair_shows_ranks_peers_and_tables(capsys: pytest.CaptureFixture[str]) -> None:
    async with push_pair() as pair:
        pair.register_recv("req-1", [0, 1])  # D dials P: both have a peer
        await wait_until(lambda: bool(pair.d.service.peers.peers and pair.p.service.peers.peers), "the handshake")
        code, out, _ = await _status(capsys, "--url", _url(pair.d))
        assert code == 0, out
        assert out.startswith(f"engine     {pair.d.config.engine_id}  (daemon {pair.d.daemon_id[:8]}")
        assert "ready      yes" in out
        (rank,) = _rows(out, "rank ")
        assert [c.strip() for c in rank[:5]] == ["0/1", "consumer", pair.d_agent, "yes", "yes"]
        (peer,) = _rows(out, "peer ")
        assert peer[0].strip() == pair.p.config.engine_id
        assert peer[2].strip() == f"127.0.0.1:{pair.p.service.peers.port}"
        tables = {row[0].strip(): int(row[1]) for row in _rows(out, "tables ")}
        assert tables == pair.d.info()["tables"]

        code, out, _ = await _status(capsys, "--url", _url(pair.d), "--json")
        data = json.loads(out)
        assert code == 0
        assert data["info"]["engine_id"] == pair.d.config.engine_id and data["ready"]["ready"] is True
        assert data["info"]["peers"][0]["engine_id"] == pair.p.config.engine_id


@pytest.mark.asyncio
async def test_a_d_shows_which_peers_map_its_kv_for_the_same_host_push(capsys: pytest.CaptureFixture[str]) -> None:
    async with gpu_pair(ipc=True) as (pair, _devmem):
        pair.register_recv("first", [0])
        pair.send_ready("first", [0])
        await pair.dw.wait_for(wp.RecvDone, "first")
        await wait_until(lambda: any(p.ipc_ready for p in pair.d.service.peers.peers.values()), "P's IpcReady")
        code, out, _ = await _status(capsys, "--url", _url(pair.d))
        assert code == 0, out
        (peer,) = _rows(out, "peer ")
        assert peer[0].strip() == pair.p.config.engine_id and peer[-1].strip() == "1"  # our one rank's KV
        code, out, _ = await _status(capsys, "--url", _url(pair.p))
        (peer,) = _rows(out, "peer ")
        assert peer[-1].strip() == "0"  # D maps nothing of P's


@pytest.mark.asyncio
async def test_not_ready_exits_3_in_both_formats(capsys: pytest.CaptureFixture[str]) -> None:
    async with running_daemon(FakeEngine(), "half") as daemon:
        worker = Worker(daemon, "producer")
        try:
            await worker.connect()  # said hello, no KV registered: /readyz 503
            code, out, _ = await _status(capsys, "--url", _url(daemon))
            assert code == 3 == cli.EXIT_NOT_READY
            assert "ready      NO" in out and "agents_registered=0" in out
            (rank,) = _rows(out, "rank ")
            assert [c.strip() for c in rank[3:5]] == ["no", "yes"]
            code, out, _ = await _status(capsys, "--url", _url(daemon), "--json")
            assert code == 3 and json.loads(out)["ready"]["ready"] is False
        finally:
            worker.close()


@pytest.mark.asyncio
async def test_a_pipeline_stage_s_ranks_are_shown_with_their_stage(capsys: pytest.CaptureFixture[str]) -> None:
    async with running_daemon(FakeEngine(), "staged") as daemon:
        workers = [Worker(daemon, "producer", pp_rank=stage, pp_size=2) for stage in (1, 0)]
        try:
            for w in workers:
                await w.start(4)
            code, out, _ = await _status(capsys, "--url", _url(daemon))
            assert code == 0, out
            rows = sorted(c[0].strip() for c in _rows(out, "rank "))
            assert rows == ["0/1 stage 0/2", "0/1 stage 1/2"]
            agents = {a["stage"]: a["agent"] for a in daemon.info()["agents"]}
            assert agents[1].startswith("staged/p1r0/") and agents[0].startswith("staged/p0r0/")
        finally:
            for w in workers:
                w.close()


@pytest.mark.asyncio
async def test_unreachable_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = await _status(capsys, "--url", f"http://127.0.0.1:{free_tcp_port()}")
    assert code == 1 and out == "" and "cannot reach daemon" in err


@pytest.mark.asyncio
async def test_token_file_for_a_daemon_that_wants_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    token = tmp_path / "health.token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    async with running_daemon(FakeEngine(), "guarded", health_token_file=str(token)) as daemon:
        code, _, err = await _status(capsys, "--url", _url(daemon))
        assert code == 1 and "401" in err
        code, out, _ = await _status(capsys, "--url", _url(daemon), "--token-file", str(token))
        assert code == 0 and "guarded" in out
        token.chmod(0o644)
        code, _, err = await _status(capsys, "--url", _url(daemon), "--token-file", str(token))
        assert code == 2 and "chmod 600" in err
