"""A NIXL agent that takes the name of a dead D incarnation's agent and sends P a
well-formed PUSH_REG under it, as a notification of the old incarnation that arrives
late would. Prints one JSON line when done.

Usage: late_push_reg.py HOST PORT P_ENGINE AGENT_NAME REQUEST_ID BLOCK...
"""

from __future__ import annotations

import json
import socket
import sys
import time

from pushsvc.engine.nixl import NixlEngine
from pushsvc.protocol import notif
from pushsvc.protocol import peer as pp
from pushsvc.protocol.framing import HEADER, PREAMBLE, encode_preamble, frame


def _exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def main() -> int:
    host, port, p_engine, agent_name, request_id = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    blocks = [int(b) for b in sys.argv[6:]]
    agent = NixlEngine(["UCX"]).create_agent(agent_name)
    # Learn P's agent the way any peer does; this one advertises no agents of its own.
    sock = socket.create_connection((host, port), timeout=10)
    hello = pp.PeerHello(daemon_id="late-ghost", engine_id="late-ghost", side_channel_host="127.0.0.1",
                         side_channel_port=1, agents=[])
    sock.sendall(encode_preamble(pp.MAGIC, pp.MAJOR, pp.MINOR) + frame(pp.encode(hello)))
    sock.recv(PREAMBLE.size, socket.MSG_WAITALL)
    (length,) = HEADER.unpack(_exact(sock, HEADER.size))
    theirs = pp.peer_decoder.decode(_exact(sock, length))
    target = agent.add_remote(theirs.agents[0].metadata)
    reg = notif.PushReg(request_id=request_id, decode_engine_id="decode", decode_host="127.0.0.1",
                        decode_port=1, decode_tp_size=1, local_block_ids=[blocks],
                        remote_engine_id=p_engine, remote_host=host, remote_port=port, remote_tp_size=1)
    agent.send_notif(target, notif.encode_push_reg(reg))
    deadline = time.time() + 2
    while time.time() < deadline:
        agent.notifs()  # drive UCX progress so the send leaves
        time.sleep(0.01)
    sock.close()
    agent.close()
    print(json.dumps({"sent": 1}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
