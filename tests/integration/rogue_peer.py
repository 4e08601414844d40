"""A hostile peer for PUSH_REG validation tests, driven over stdin/stdout (JSON lines).

It owns a real NIXL agent with registered memory laid out like the test workers' KV
(``layers`` layers, K and V regions of ``blocks`` blocks each), so a PUSH_REG P accepted
from it would really be written. With ``--known`` it introduces that agent in its
side-channel hello, as a peer daemon of engine ``--engine-id`` would; without it the
hello lists no agent, and P never hears of the agent that sends the notifications.

Commands: ``push_reg`` (the PushReg fields; ``raw`` sends a msgpack map as is),
``digest`` (sha1 of the agent's memory), ``pump`` (drive NIXL progress for ``s``).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import sys
import time

import msgspec
from plain_peer import open_session, stranger_hello

from pushsvc.engine.nixl import NixlEngine
from pushsvc.protocol import notif
from pushsvc.protocol import peer as pp
from pushsvc.shm import SharedBuffer


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True, help="P daemon's side-channel port")
    p.add_argument("--engine-id", default="rogue")
    p.add_argument("--known", action="store_true", help="introduce the agent in the hello")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--blocks", type=int, default=40)
    p.add_argument("--block-len", type=int, default=2048)
    args = p.parse_args()

    n_regions = 2 * args.layers
    region_bytes = args.blocks * args.block_len
    memory = SharedBuffer.create(n_regions * region_bytes)
    ctypes.memset(memory.address, 0x5A, memory.size)
    agent = NixlEngine(["UCX"]).create_agent(f"{args.engine_id}/r0/rogue")
    agent.register([(memory.address, memory.size)], "DRAM")
    info = pp.AgentInfo(
        rank=0, tp_size=1, agent_name=agent.name, metadata=agent.metadata(),
        regions=[pp.RegionInfo(base=memory.address + i * region_bytes, block_len=args.block_len,
                               num_blocks=args.blocks) for i in range(n_regions)])
    # A long heartbeat interval: P expects nothing from us for hours.
    sock, theirs = open_session(args.host, args.port, stranger_hello(
        args.engine_id, [info] if args.known else [], heartbeat_interval_s=3600))
    target = agent.add_remote(theirs.agents[0].metadata)
    out = sys.stdout
    out.write(json.dumps({"ok": True, "agent": agent.name}) + "\n")
    out.flush()

    def pump(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            agent.notifs()  # drives UCX progress so our sends leave
            time.sleep(0.005)

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "push_reg":
            raw = cmd.pop("raw", False)
            if raw:
                payload = notif.PUSH_REG_PREFIX + msgspec.msgpack.encode(cmd)
            else:
                payload = notif.encode_push_reg(notif.PushReg(**cmd))
            agent.send_notif(target, payload)
            pump(0.2)
            reply = {}
        elif op == "digest":
            reply = {"digest": hashlib.sha1(ctypes.string_at(memory.address, memory.size)).hexdigest()}
        elif op == "pump":
            pump(cmd.get("s", 0.5))
            reply = {}
        else:
            reply = {"error": f"unknown op {op}"}
        out.write(json.dumps({"ok": "error" not in reply, **reply}) + "\n")
        out.flush()
    sock.close()
    agent.close()
    memory.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
