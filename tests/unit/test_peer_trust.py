"""What an unauthenticated side channel lets a stranger do, and what it no longer does:
claim a live peer's engine, declare a lost one dead, receive D's hello before the
acceptor said who it is, make a daemon dial where it should not, cancel another
engine's registration."""

from __future__ import annotations

import asyncio

import pytest
from daemon_fixtures import assert_tables_empty, push_pair, wait_until
from peer_fixtures import WAIT_S, eventually, manager, sample, started

from pushsvc.errors import HandshakeError
from pushsvc.protocol import peer as pp
from pushsvc.protocol import worker as wp
from pushsvc.protocol.framing import PREAMBLE, encode_preamble, frame
from pushsvc.server.peers import LOOPBACK_ONLY


def impostor(engine_id: str):
    """A manager that claims ``engine_id`` under a daemon id of its own."""
    mgr, metrics, events = manager(engine_id, None)
    mgr.daemon_id = f"impostor-of-{engine_id}"
    return mgr, metrics, events


@pytest.mark.asyncio
async def test_an_unauthenticated_hello_cannot_displace_a_live_peer_of_its_engine() -> None:
    p, pm, pe = manager("prefill", None)
    d, _, _ = manager("decode", None)
    fake, _, _ = impostor("decode")
    async with started(p, d, fake):
        real = await d.ensure("127.0.0.1", p.port, "prefill")
        await eventually(lambda: p.find_engine("decode") is not None, "P to know D")
        held = p.find_engine("decode")
        # The impostor's own side may finish its half of the exchange; P refuses the
        # claim and closes the session at once.
        await fake.ensure("127.0.0.1", p.port, "prefill")
        await eventually(lambda: fake.find_engine("prefill") is None, "P to close the impostor's session")
        assert p.find_engine("decode") is held and held.alive and not held.gone
        assert sample(pm, "pushsvc_handshakes_total", result="engine_claimed") == 1
        assert pe.other == []  # no peer_gone
        assert real.alive


@pytest.mark.asyncio
async def test_an_unauthenticated_newcomer_does_not_make_a_lost_peer_count_as_dead() -> None:
    p, _, pe = manager("prefill", None)
    d, _, _ = manager("decode", None)
    fake, _, _ = impostor("decode")
    async with started(p, fake):
        await d.start("127.0.0.1", 0)
        await d.ensure("127.0.0.1", p.port, "prefill")
        await eventually(lambda: p.find_engine("decode") is not None, "P to know D")
        await d.close()  # D's daemon goes away: lost, not known dead
        await eventually(lambda: p.find_engine("decode") is None, "P to lose D")
        await fake.ensure("127.0.0.1", p.port, "prefill")
        await eventually(lambda: p.find_engine("decode") is not None, "P to take the newcomer")
        await asyncio.sleep(0.05)
        assert "peer_gone" not in pe.other, "only an authenticated hello may declare the lost D dead"


@pytest.mark.asyncio
async def test_the_dialer_says_hello_only_after_the_acceptor_identified_itself() -> None:
    got = bytearray()

    async def stranger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = pp.PeerHello(daemon_id="stranger", engine_id="someone-else", side_channel_host="127.0.0.1",
                             side_channel_port=1, agents=[])
        writer.write(encode_preamble(pp.MAGIC, pp.MAJOR, pp.MINOR) + frame(pp.encode(hello)))
        got.extend(await reader.read())  # everything the dialer sends until it leaves
        writer.close()

    server = await asyncio.start_server(stranger, "127.0.0.1", 0)
    d, _, _ = manager("decode", None)
    try:
        with pytest.raises(HandshakeError, match="expected prefill"):
            await d.ensure("127.0.0.1", server.sockets[0].getsockname()[1], "prefill")
        await eventually(lambda: len(got) >= PREAMBLE.size, "the dialer to leave")
        assert bytes(got) == encode_preamble(pp.MAGIC, pp.MAJOR, pp.MINOR), "D sent more than its preamble"
    finally:
        server.close()
        await d.close()


@pytest.mark.asyncio
async def test_a_daemon_dials_no_host_its_policy_refuses() -> None:
    p, pm, _ = manager("prefill", None)
    d, dm, _ = manager("decode", None)
    d._allowed_host = lambda name, addresses: False  # as allowed_peer_hosts naming nothing that matches
    async with started(p, d):
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(HandshakeError, match="not allowed"):
            await d.ensure("127.0.0.1", p.port, "prefill")
        assert loop.time() - start < WAIT_S / 2
        assert sample(dm, "pushsvc_handshakes_total", result="host_refused") == 1
        await asyncio.sleep(0.05)
        assert sample(pm, "pushsvc_handshakes_total", result="accepted") == 0, "no connection was made"


def test_loopback_only_is_the_default_policy() -> None:
    assert LOOPBACK_ONLY("localhost", ["127.0.0.1", "::1"])
    assert not LOOPBACK_ONLY("p.example", ["10.0.0.5"])
    assert not LOOPBACK_ONLY("mixed", ["127.0.0.1", "10.0.0.5"])
    assert not LOOPBACK_ONLY("nothing", [])


@pytest.mark.asyncio
async def test_the_daemon_dials_by_its_allowed_peer_hosts() -> None:
    """The configured policy is the one the peer manager applies: a host outside it is
    refused before any connection, one inside it is dialed."""
    async with push_pair(d_config={"allowed_peer_hosts": ["127.0.0.2"]}) as pair:
        policy = pair.d.service.peers._allowed_host
        assert policy("127.0.0.1", ["127.0.0.1"])  # loopback is always allowed
        assert policy("p.internal", ["127.0.0.2"])
        assert not policy("p.internal", ["10.1.2.3"])


@pytest.mark.asyncio
async def test_a_registration_naming_a_refused_host_fails_at_once_without_dialing() -> None:
    async with push_pair() as pair:
        pair.d.service.peers._allowed_host = lambda name, addresses: False
        pair.register_recv("cmpl-a-0-11111111", [3, 4])
        failed = await pair.dw.wait_for(wp.RecvFailed, "cmpl-a-0-11111111")
        assert failed.reason.startswith("handshake_failed:") and "not allowed" in failed.reason
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_a_cancel_from_another_engine_touches_no_registration_of_d() -> None:
    async with push_pair() as pair:
        pair.register_recv("cmpl-a-0-11111111", [3, 4])
        await wait_until(lambda: pair.p.info()["tables"]["p_registrations"] == 1, "the PUSH_REG to reach P")
        other, _, _ = manager("decode-2", None)
        async with started(other):
            peer = await other.ensure("127.0.0.1", pair.p.service.peers.port, "prefill")
            other.send(peer, pp.CancelPush(request_id="cmpl-a-0-11111111", rank=0))
            await asyncio.sleep(0.1)
        assert pair.p.info()["tables"]["p_registrations"] == 1, "another engine's cancel dropped D's registration"
        pair.send_ready("cmpl-a-0-22222222", [0, 1])
        await pair.dw.wait_for(wp.RecvDone, "cmpl-a-0-11111111")
        await pair.pw.wait_for(wp.SendDone, "cmpl-a-0-22222222")
        await assert_tables_empty(pair.p, pair.d)
