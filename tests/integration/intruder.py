"""A foreign NIXL agent: learns P's agent through the side channel like any peer,
then sends P notifications no real D would send. Prints one JSON line when done."""

from __future__ import annotations

import json
import sys
import time

import msgspec
from plain_peer import open_session, stranger_hello

from pushsvc.engine.nixl import NixlEngine
from pushsvc.protocol import notif


def main() -> int:
    host, port, victim_engine = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    agent = NixlEngine(["UCX"]).create_agent("intruder/r0/00000000")
    sock, theirs = open_session(host, port, stranger_hello("intruder"))
    target = agent.add_remote(theirs.agents[0].metadata)
    valid = notif.PushReg(request_id="victim-req", decode_engine_id="decode", decode_host="127.0.0.1",
                          decode_port=1, decode_tp_size=1, local_block_ids=[[0, 1]],
                          remote_engine_id=victim_engine, remote_host=host, remote_port=port, remote_tp_size=1)
    enc = msgspec.msgpack.Encoder()
    payloads = [
        b"PUSH_REG:\xff\xff\xff",  # not msgpack
        b"PUSH_REG:" + enc.encode({"request_id": "x"}),  # missing fields
        b"PUSH_REG:" + enc.encode({**msgspec.to_builtins(valid), "evil": 1}),  # unknown field
        b"PUSH_REG:" + enc.encode({**msgspec.to_builtins(valid), "local_block_ids": [[-1]]}),  # negative id
        b"PUSH_REG:" + enc.encode([1, 2, 3]),  # wrong type
        b"no-colon-here",  # malformed completion
        b"someone:else:99999",  # completion with an out-of-range tp
    ]
    for p in payloads:
        agent.send_notif(target, p)
    # Well-formed, but claims to come from D's agent: P must refuse to WRITE for it.
    agent.send_notif(target, notif.encode_push_reg(valid))
    deadline = time.time() + 2
    while time.time() < deadline:
        agent.notifs()  # drive UCX progress so the sends leave
        time.sleep(0.01)
    sock.close()
    print(json.dumps({"sent": len(payloads) + 1, "malformed": len(payloads)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
