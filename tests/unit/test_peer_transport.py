"""Daemons whose UCX error handling differs refuse each other at the handshake (their
WRITEs would never complete), each saying why; daemons of one mode talk as before."""

from __future__ import annotations

import msgspec
import pytest
from peer_fixtures import eventually, manager, sample, started

from pushsvc.config import load_config
from pushsvc.errors import ConfigError, HandshakeError
from pushsvc.protocol import peer as pp


@pytest.mark.asyncio
async def test_daemons_of_different_ucx_error_handling_refuse_each_other_naming_both_modes() -> None:
    p, pm, pe = manager("prefill", None)  # "peer", the default
    d, _, de = manager("decode", None, ucx_error_handling_mode="none")
    async with started(p, d):
        with pytest.raises(HandshakeError, match="ucx_error_handling_mode=peer, this daemon none"):
            await d.ensure("127.0.0.1", p.port, "prefill")
        await eventually(lambda: sample(pm, "pushsvc_rejected_connections_total", listener="side_channel",
                                        reason="HandshakeError") == 1, "P to refuse D's hello")
        assert p.find_engine("decode") is None and d.find_engine("prefill") is None
        assert pe.up == [] and de.up == []  # no peer came up on either side


@pytest.mark.asyncio
async def test_daemons_of_one_mode_talk_whichever_it_is() -> None:
    for mode in ("peer", "none"):
        p, _, _ = manager("prefill", None, ucx_error_handling_mode=mode)
        d, _, _ = manager("decode", None, ucx_error_handling_mode=mode)
        async with started(p, d):
            peer = await d.ensure("127.0.0.1", p.port, "prefill")
            assert peer.alive
            await eventually(lambda: p.find_engine("decode") is not None, f"P to know D ({mode})")


def test_the_default_mode_is_not_encoded_so_a_1_3_peer_decodes_the_hello() -> None:
    hello = pp.PeerHello(daemon_id="x", engine_id="e", side_channel_host="h", side_channel_port=1, agents=[])
    assert "ucx_error_handling_mode" not in msgspec.msgpack.decode(pp.encode(hello))
    other = msgspec.structs.replace(hello, ucx_error_handling_mode="none")
    assert msgspec.msgpack.decode(pp.encode(other))["ucx_error_handling_mode"] == "none"
    assert pp.peer_decoder.decode(pp.encode(other)).ucx_error_handling_mode == "none"
    with pytest.raises(msgspec.ValidationError):
        pp.peer_decoder.decode(msgspec.msgpack.encode({**msgspec.to_builtins(hello), "ucx_error_handling_mode": "x"}))


def test_config_takes_peer_or_none_only() -> None:
    env = {"XDG_RUNTIME_DIR": "/run/user/1000", "PUSHSVC_UCX_ERROR_HANDLING_MODE": "none"}
    assert load_config(env=env).ucx_error_handling_mode == "none"
    assert load_config(env={"XDG_RUNTIME_DIR": "/run/user/1000"}).ucx_error_handling_mode == "peer"
    with pytest.raises(ConfigError, match="ucx_error_handling_mode"):
        load_config(env={**env, "PUSHSVC_UCX_ERROR_HANDLING_MODE": "off"})
    # Off one host a vanished peer must fail its WRITEs: "none" is refused there.
    exposed = {"side_channel_host": "10.0.0.5", "insecure_side_channel": True, "allowed_peer_hosts": ["10.0.0.0/8"]}
    with pytest.raises(ConfigError, match="share one host"):
        load_config(env=env, overrides=exposed)
    assert load_config(env=env, overrides={**exposed, "ucx_error_handling_mode": "peer"}).side_channel_host == "10.0.0.5"
