"""A NIXL agent that takes the name of a dead D incarnation's agent and sends P a
well-formed PUSH_REG under it, as a notification of the old incarnation that arrives
late would. Prints one JSON line when done.

Usage: late_push_reg.py HOST PORT P_ENGINE AGENT_NAME REQUEST_ID BLOCK...
"""

from __future__ import annotations

import json
import sys
import time

from plain_peer import open_session, stranger_hello

from pushsvc.engine.nixl import NixlEngine
from pushsvc.protocol import notif


def main() -> int:
    host, port, p_engine, agent_name, request_id = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    blocks = [int(b) for b in sys.argv[6:]]
    agent = NixlEngine(["UCX"]).create_agent(agent_name)
    # Learn P's agent the way any peer does; this one advertises no agents of its own.
    sock, theirs = open_session(host, port, stranger_hello("late-ghost"))
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
