"""``ucx_sgl``: whether NIXL hands UCX a WRITE as one scatter-gather list. The setting,
that it reaches NIXL's UCX backend for each agent, that a WRITE posted either way moves
exactly its blocks (that the daemon posts as its config says: tests/integration/test_cli.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pushsvc.config import load_config
from pushsvc.engine.base import XferState
from pushsvc.engine.nixl import SGL_ENV, NixlEngine
from pushsvc.errors import ConfigError


_ENV = {"XDG_RUNTIME_DIR": "/run/user/1000"}


def test_config_is_off_unless_turned_on_and_refuses_other_words() -> None:
    assert load_config(env=_ENV).ucx_sgl == "off"
    for setting in ("on", "off"):
        assert load_config(env={**_ENV, "PUSHSVC_UCX_SGL": setting}).ucx_sgl == setting
    for word in ("yes", "auto", ""):
        with pytest.raises(ConfigError) as info:
            load_config(overrides={"ucx_sgl": word}, env=_ENV)
        assert info.value.field == "ucx_sgl"


_PROBE = textwrap.dedent("""
    from pushsvc.engine.nixl import NixlEngine
    on, off = NixlEngine(["UCX"], sgl=True), NixlEngine(["UCX"], sgl=False)
    agents = [on.create_agent("a"), off.create_agent("b"), on.create_agent("c")]
    for agent in agents:
        agent.close()
""")


def test_each_agent_is_made_with_its_engines_setting() -> None:
    # NIXL says at debug level how its UCX backend posts; engines of both settings in one
    # process, agents made alternately: each backend follows its own engine.
    env = {**os.environ, "NIXL_LOG_LEVEL": "DEBUG", SGL_ENV: "1"}  # an outside setting does not win
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    said = [line.rsplit("UCX SGL offload ", 1)[1].strip() for line in (out.stdout + out.stderr).splitlines()
            if "UCX SGL offload " in line]
    assert said == ["enabled", "disabled", "enabled"]


@pytest.mark.parametrize("sgl", [True, False])
def test_a_write_posted_as_a_list_moves_exactly_its_blocks(sgl: bool) -> None:
    block, blocks = 1024, 64
    src = np.random.default_rng(7).integers(0, 256, block * blocks, dtype=np.uint8)
    dst = np.full(block * blocks, 0xAB, dtype=np.uint8)
    engine = NixlEngine(["UCX"], sgl=sgl)
    sender, receiver = engine.create_agent(f"sgl-src-{sgl}"), engine.create_agent(f"sgl-dst-{sgl}")
    try:
        sender.register([(src.ctypes.data, src.nbytes)], "DRAM")
        receiver.register([(dst.ctypes.data, dst.nbytes)], "DRAM")
        name = sender.add_remote(receiver.metadata())

        def table(buf: np.ndarray) -> np.ndarray:
            return np.array([(buf.ctypes.data + i * block, block, 0) for i in range(blocks)], dtype=np.uint64)

        local = sender.prep_local(table(src), "DRAM")
        remote = sender.prep_remote(name, table(dst), "DRAM")
        # Scattered both ways, so no two pairs merge into one piece of memory.
        src_idx = np.arange(0, blocks, 2, dtype=np.int32)[::-1].copy()
        dst_idx = np.arange(1, blocks, 2, dtype=np.int32)
        handle, state = sender.write(local, src_idx, remote, dst_idx, b"done")
        seen: list[bytes] = []
        for _ in range(20_000):
            if state is XferState.PROC:
                state = sender.state(handle)
            seen += [m for msgs in receiver.notifs().values() for m in msgs]
            if state is not XferState.PROC and seen:
                break
        assert state is XferState.DONE and seen == [b"done"]
        sender.release(handle)
        want = np.full_like(dst, 0xAB).reshape(blocks, block)
        want[dst_idx] = src.reshape(blocks, block)[src_idx]
        assert np.array_equal(dst.reshape(blocks, block), want)
    finally:
        sender.close()
        receiver.close()
