"""What a stranger on the side channel can make a daemon hold is bounded: frames before
authentication, handshakes in progress, agents and their descriptors, remembered lost
peers, and bytes queued for a peer that stopped reading."""

from __future__ import annotations

import asyncio

import pytest
from daemon_fixtures import assert_tables_empty, push_pair
from peer_fixtures import AGENT, WAIT_S, Raw, eventually, manager, sample, started

from pushsvc.engine.fake import FakeEngine
from pushsvc.errors import LayoutError
from pushsvc.metrics import Metrics
from pushsvc.protocol import peer as pp
from pushsvc.protocol import worker as wp
from pushsvc.protocol.framing import HEADER, PREAMBLE, CountingDecoder, encode_preamble, frame
from pushsvc.server import peer_agents
from pushsvc.server import peers as peers_module
from pushsvc.server.handshake import PRE_AUTH_MAX_FRAME
from pushsvc.server.peers import Peer
from pushsvc.server.remotes import RemoteAgents
from pushsvc.server.session import Session
from pushsvc.state.layout import Layout, RegionSpec

SECRET = b"0123456789abcdef0123456789abcdef"


@pytest.mark.asyncio
async def test_a_frame_before_authentication_is_capped_at_a_kibibyte() -> None:
    p, pm, _ = manager("prefill", SECRET)
    async with started(p):
        raw = await Raw.connect(p.port)
        # Announce 60 MiB where the challenge belongs, and start sending it.
        raw.writer.write(encode_preamble(pp.MAGIC, pp.MAJOR, pp.MINOR) + HEADER.pack(60 << 20) + b"\0" * 65536)
        await raw.reader.readexactly(PREAMBLE.size)
        assert isinstance(await raw.read_msg(), pp.AuthChallenge)
        assert await raw.rest() == b""  # hung up on at the header, before the payload
        raw.close()
        assert sample(pm, "pushsvc_rejected_connections_total", listener="side_channel", reason="auth_missing") == 1
        assert sample(pm, "pushsvc_malformed_inputs_total", source="side_channel", reason="decode") == 0


@pytest.mark.asyncio
async def test_a_challenge_that_fits_the_cap_is_read() -> None:
    challenge = frame(pp.encode(pp.AuthChallenge(nonce=b"\1" * 32, daemon_id="d" * 256)))
    assert len(challenge) - HEADER.size <= PRE_AUTH_MAX_FRAME  # the largest legal one fits


@pytest.mark.asyncio
async def test_handshakes_in_progress_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peers_module, "MAX_HANDSHAKES", 4)
    p, pm, _ = manager("prefill", SECRET, handshake_timeout_s=WAIT_S)
    async with started(p):
        silent = [await Raw.connect(p.port) for _ in range(4)]  # each holds a handshake open
        for s in silent:
            await s.reader.readexactly(PREAMBLE.size)
        extra = await Raw.connect(p.port)
        assert await extra.rest() == b"", "the fifth is closed at once, without a preamble"
        assert sample(pm, "pushsvc_rejected_connections_total", listener="side_channel",
                      reason="too_many_handshakes") == 1
        for s in [*silent, extra]:
            s.close()


async def _hello_as(port: int, name: str) -> Raw:
    """A session that completes the (unauthenticated) handshake as daemon ``name``."""
    raw = await Raw.connect(port)
    await raw.reader.readexactly(PREAMBLE.size)
    assert isinstance(await raw.read_msg(), pp.PeerHello)  # the acceptor speaks first
    hello = pp.PeerHello(daemon_id=name, engine_id=name, side_channel_host="127.0.0.1", side_channel_port=1,
                         agents=[])
    raw.writer.write(encode_preamble(pp.MAGIC, pp.MAJOR, pp.MINOR) + frame(pp.encode(hello)))
    return raw


@pytest.mark.asyncio
async def test_sessions_are_capped_and_a_closed_one_makes_room(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peers_module, "MAX_SESSIONS", 2)
    p, pm, _ = manager("prefill", None)
    async with started(p):
        live = [await _hello_as(p.port, f"peer{i}") for i in range(2)]
        await eventually(lambda: all(p.find_engine(f"peer{i}") for i in range(2)), "both sessions adopted")
        extra = await Raw.connect(p.port)
        assert await extra.rest() == b"", "the third is closed at once, without a preamble"
        assert sample(pm, "pushsvc_rejected_connections_total", listener="side_channel",
                      reason="too_many_sessions") == 1
        assert p.find_engine("peer0") and p.find_engine("peer1"), "the sessions in place are kept"
        live[0].close()
        await eventually(lambda: p.find_engine("peer0") is None, "the closed session to end")
        again = await _hello_as(p.port, "peer2")
        await eventually(lambda: p.find_engine("peer2") is not None, "a new session in the freed place")
        for raw in [*live, extra, again]:
            raw.close()


@pytest.mark.asyncio
async def test_a_peer_cannot_announce_more_agents_than_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peer_agents, "MAX_AGENTS_PER_PEER", 2)
    p, pm, _ = manager("prefill", None)
    async with started(p):
        raw = await Raw.connect(p.port)
        await raw.reader.readexactly(PREAMBLE.size)
        assert isinstance(await raw.read_msg(), pp.PeerHello)  # the acceptor speaks first
        hello = pp.PeerHello(daemon_id="many", engine_id="many", side_channel_host="127.0.0.1",
                             side_channel_port=1, agents=[])
        raw.writer.write(encode_preamble(pp.MAGIC, pp.MAJOR, pp.MINOR) + frame(pp.encode(hello)))
        await eventually(lambda: p.find_engine("many") is not None, "P to take the hello")
        agents = [pp.AgentInfo(rank=r, tp_size=4, agent_name=f"many/r{r}", metadata=b"m",
                               regions=AGENT.regions) for r in range(3)]
        raw.send(pp.AgentsUpdate(agents=agents))
        await raw.rest()  # whatever came before (a heartbeat), then the close
        await eventually(lambda: p.find_engine("many") is None, "P to close the session")
        assert sample(pm, "pushsvc_malformed_inputs_total", source="side_channel", reason="unexpected") == 1
        raw.close()


def test_a_remote_agent_describing_too_many_blocks_is_refused_before_anything_is_built() -> None:
    engine = FakeEngine()
    local = engine.create_agent("local")
    remotes = RemoteAgents(local, max_descriptors=1 << 16, prepare=True)
    # 711 bytes on the wire once asked for 768 GiB of descriptors.
    huge = pp.AgentInfo(rank=0, tp_size=1, agent_name="huge", metadata=b"fake:huge",
                        regions=[pp.RegionInfo(base=0, block_len=1, num_blocks=2**31 - 1)] * 16)
    remotes.load(huge)
    assert remotes.names() == [] and local.remotes == set(), "nothing was loaded into NIXL"
    with pytest.raises(LayoutError, match="over the limit"):  # what a WRITE to it would report
        remotes.layout(huge, Layout(()))


def test_a_remote_agent_whose_metadata_names_another_agent_is_not_kept() -> None:
    engine = FakeEngine()
    local = engine.create_agent("local")
    remotes = RemoteAgents(local, max_descriptors=1 << 16, prepare=True)
    liar = pp.AgentInfo(rank=0, tp_size=1, agent_name="claimed", metadata=b"fake:someone-else",
                        regions=AGENT.regions)
    remotes.load(liar)
    assert remotes.names() == [] and local.remotes == set()


def test_a_remote_layout_is_built_once_while_the_agent_stays_loaded() -> None:
    engine = FakeEngine()
    local = engine.create_agent("local")
    remotes = RemoteAgents(local, max_descriptors=1 << 16, prepare=True)
    peer = engine.create_agent("x/r0")
    peer.register([(0x7F0000000000, 16 * 4096)], "DRAM")  # what AGENT describes
    info = pp.AgentInfo(rank=0, tp_size=1, agent_name="x/r0", metadata=peer.metadata(), regions=AGENT.regions)
    remotes.load(info)
    mine = Layout((RegionSpec(0, 4096, 16, 4096),))
    first = remotes.layout(info, mine)
    assert remotes.layout(info, mine) is first  # the planning caches on it stay warm
    remotes.unload("x/r0")
    remotes.load(info)
    assert remotes.layout(info, mine) is not first  # a reloaded agent is checked and built again


@pytest.mark.asyncio
async def test_a_hello_with_an_oversized_agent_leaves_the_daemon_serving() -> None:
    async with push_pair() as pair:
        other, _, _ = manager("decode-2", None)
        other._local_agents = lambda: [pp.AgentInfo(  # type: ignore[method-assign]
            rank=0, tp_size=1, agent_name="decode-2/r0", metadata=b"fake:decode-2/r0",
            regions=[pp.RegionInfo(base=0, block_len=1, num_blocks=2**31 - 1)] * 16)]
        async with started(other):
            await other.ensure("127.0.0.1", pair.p.service.peers.port, "prefill")
            await eventually(lambda: pair.p.service.peers.find_engine("decode-2") is not None, "P to take it")
            # P is alive and serving: a real push goes through.
            pair.register_recv("cmpl-a-0-11111111", [3, 4])
            pair.send_ready("cmpl-a-0-22222222", [0, 1])
            await pair.dw.wait_for(wp.RecvDone, "cmpl-a-0-11111111")
            await pair.pw.wait_for(wp.SendDone, "cmpl-a-0-22222222")
        # ... and the session with the oversized peer is a real one: P sees it end (it used
        # to die in the handshake on a MemoryError and look alive forever).
        await eventually(lambda: pair.p.service.peers.find_engine("decode-2") is None, "P to see decode-2 leave")
        await assert_tables_empty(pair.p, pair.d)


def test_lost_peers_are_remembered_up_to_a_bound() -> None:
    mgr, _, _ = manager("prefill", None)
    for i in range(peer_agents._LOST_KEPT + 50):
        peer = Peer(f"daemon-{i}", f"engine-{i}", "127.0.0.1", 1, agents={f"a{i}": AGENT})
        mgr.peers[peer.daemon_id] = peer
        mgr._forget(peer)
    assert mgr.agents.lost == peer_agents._LOST_KEPT
    assert len(mgr.agents._lost_agents) == peer_agents._LOST_KEPT
    # The forgotten ones are still refused as late, within the departed bound.
    assert mgr.departed("a0") and mgr.departed(f"a{peer_agents._LOST_KEPT + 49}")


@pytest.mark.asyncio
async def test_a_session_whose_peer_stops_reading_is_closed_not_buffered_without_end() -> None:
    accepted: list[asyncio.StreamWriter] = []

    async def never_reads(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        await asyncio.sleep(WAIT_S)

    server = await asyncio.start_server(never_reads, "127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        metrics = Metrics()
        frames = CountingDecoder(pp.peer_decoder, source="side_channel", max_frame=1 << 20,
                                 malformed=metrics.malformed)
        session = Session(reader, writer, dialed=True, frames=frames, max_buffered=8 << 20)
        big = pp.WriteStarted(request_id="r", rank=0, digests=b"\0" * (1 << 20))
        sent = 0
        while session.send(big):
            sent += 1
            await asyncio.sleep(0)  # let the kernel take what it takes
            assert sent < 1000, "never refused"
        assert session.overflowed and session.closing
        assert sent * (1 << 20) < (8 << 20) + (16 << 20), "queued far beyond the bound"
    finally:
        for w in accepted:
            w.close()
        server.close()
        await server.wait_closed()


@pytest.mark.asyncio
async def test_an_agent_registered_between_the_two_hellos_is_announced() -> None:
    """Regression (seen in the e2e restart test): P's hello went out with no agent, P's
    worker registered before D's hello arrived, and the AgentsUpdate broadcast at the
    registration missed D's session, which was not adopted yet: D never learnt P's agent
    and failed every request ("peer prefill has no rank 0")."""
    agents: list[pp.AgentInfo] = []
    p, _pm, _ = manager("prefill", None)
    p._local_agents = lambda: list(agents)  # type: ignore[method-assign]
    async with started(p):
        raw = await Raw.connect(p.port)
        await raw.reader.readexactly(PREAMBLE.size)
        first = await raw.read_msg()
        assert isinstance(first, pp.PeerHello) and first.agents == []
        agents.append(AGENT)  # the worker registers now
        p.announce([AGENT])  # what register_kv does: nobody to send to yet
        hello = pp.PeerHello(daemon_id="d", engine_id="decode", side_channel_host="127.0.0.1", side_channel_port=1,
                             agents=[])
        raw.writer.write(encode_preamble(pp.MAGIC, pp.MAJOR, pp.MINOR) + frame(pp.encode(hello)))
        update = await raw.read_msg()
        assert isinstance(update, pp.AgentsUpdate) and update.agents == [AGENT]
        raw.close()


def test_a_notifying_side_loads_remote_metadata_but_prepares_no_descriptors() -> None:
    """D's agents only notify P's: P's regions may not be registered with NIXL at all
    (P's staging) and preparing them would cost D's loop for nothing."""
    engine = FakeEngine()
    local = engine.create_agent("local")
    remotes = RemoteAgents(local, max_descriptors=1 << 16, prepare=False)
    peer = engine.create_agent("x/r0")
    peer.register([(0x7F0000000000, 16 * 4096)], "DRAM")  # what AGENT describes
    info = pp.AgentInfo(rank=0, tp_size=1, agent_name="x/r0", metadata=peer.metadata(), regions=AGENT.regions)
    remotes.load(info)
    assert remotes.names() == ["x/r0"] and local.remotes == {"x/r0"}, "loaded: it can be notified"
    assert local.dlists == set(), "and nothing was prepared"
    with pytest.raises(LayoutError, match="notified only"):
        remotes.layout(info, Layout((RegionSpec(0, 4096, 16, 4096),)))
    remotes.unload("x/r0")
    assert remotes.names() == [] and local.remotes == set()


def test_a_writing_side_releases_what_it_prepared_on_unload() -> None:
    engine = FakeEngine()
    local = engine.create_agent("local")
    remotes = RemoteAgents(local, max_descriptors=1 << 16, prepare=True)
    peer = engine.create_agent("x/r0")
    peer.register([(0x7F0000000000, 16 * 4096)], "DRAM")  # what AGENT describes
    remotes.load(pp.AgentInfo(rank=0, tp_size=1, agent_name="x/r0", metadata=peer.metadata(), regions=AGENT.regions))
    assert len(local.dlists) == 1 and local.remotes == {"x/r0"}
    remotes.unload("x/r0")
    assert local.dlists == set() and local.remotes == set()


async def _hello_with(port: int, engine_id: str, agents: list[pp.AgentInfo], daemon_id: str = "") -> Raw:
    raw = await Raw.connect(port)
    await raw.reader.readexactly(PREAMBLE.size)
    assert isinstance(await raw.read_msg(), pp.PeerHello)  # the acceptor speaks first
    hello = pp.PeerHello(daemon_id=daemon_id or f"{engine_id}-id", engine_id=engine_id,
                         side_channel_host="127.0.0.1", side_channel_port=1, agents=agents)
    raw.writer.write(encode_preamble(pp.MAGIC, pp.MAJOR, pp.MINOR) + frame(pp.encode(hello)))
    return raw


def _agent(name: str) -> pp.AgentInfo:
    return pp.AgentInfo(rank=0, tp_size=1, agent_name=name, metadata=b"m", regions=AGENT.regions)


@pytest.mark.asyncio
async def test_a_hello_refused_for_its_agents_leaves_no_peer_and_no_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hello naming an agent another peer owns is refused; nothing of it may stay: no
    live peer holding its engine id, no session counted against the cap."""
    monkeypatch.setattr(peers_module, "MAX_SESSIONS", 2)
    p, pm, _ = manager("prefill", None)
    async with started(p):
        owner = await _hello_with(p.port, "decode-a", [_agent("decode-a/r0")])
        await eventually(lambda: p.find_engine("decode-a") is not None, "decode-a adopted")
        for _ in range(2):
            liar = await _hello_with(p.port, "decode-b", [_agent("decode-a/r0")])
            assert await liar.rest() == b"", "refused: closed without a word"
            liar.close()
        assert sample(pm, "pushsvc_rejected_connections_total", listener="side_channel",
                      reason="ProtocolError") == 2
        assert p.find_engine("decode-b") is None, "a refused hello is no peer"
        assert p.find_engine("decode-a").agents.keys() == {"decode-a/r0"}
        # The engine id is free and the cap counts only decode-a's session.
        real = await _hello_with(p.port, "decode-b", [], daemon_id="decode-b-real")
        await eventually(lambda: p.find_engine("decode-b") is not None, "the real decode-b adopted")
        assert sample(pm, "pushsvc_handshakes_total", result="engine_claimed") == 0
        assert sample(pm, "pushsvc_rejected_connections_total", listener="side_channel",
                      reason="too_many_sessions") == 0
        for raw in (owner, real):
            raw.close()


@pytest.mark.asyncio
async def test_a_refused_hello_in_a_live_peers_name_does_not_keep_it_alive() -> None:
    """The hello names a live peer's daemon and engine (both are in the hello anyone who
    connects gets) but another peer's agent: refused, it joins none of the live peer's
    sessions, so the peer still goes down when its own session ends."""
    p, _pm, events = manager("prefill", None)
    downs: list[str] = []
    events.peer_down = lambda peer: downs.append(peer.engine_id)  # type: ignore[method-assign]
    async with started(p):
        other = await _hello_with(p.port, "decode-z", [_agent("decode-z/r0")])
        real = await _hello_with(p.port, "decode-a", [_agent("decode-a/r0")])
        await eventually(lambda: p.find_engine("decode-a") is not None, "decode-a adopted")
        ghost = await _hello_with(p.port, "decode-a", [_agent("decode-z/r0")])
        assert await ghost.rest() == b""
        ghost.close()
        assert len(p.find_engine("decode-a").sessions) == 1
        real.close()
        await eventually(lambda: "decode-a" in downs, "decode-a reported down once its session ended")
        assert p.find_engine("decode-a") is None
        other.close()
