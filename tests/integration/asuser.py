"""A worker under another uid and other groups: starts as root (the interpreter and the
tree need not be readable by that uid), drops to ``--uid``/``--gid``/``--groups`` before it
touches the socket, then tries hello + Ping. Prints one JSON line; exit 0 either way."""

from __future__ import annotations

import argparse
import json
import os
import select
import time

from pushsvc.client import DaemonClient
from pushsvc.errors import PushsvcError
from pushsvc.protocol import worker as wp


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--uid", type=int, required=True)
    ap.add_argument("--gid", type=int, required=True)
    ap.add_argument("--groups", default="", help="comma-separated supplementary gids")
    args = ap.parse_args()
    os.setgroups([int(g) for g in args.groups.split(",") if g])
    os.setgid(args.gid)
    os.setuid(args.uid)  # last: after it there is no way back
    out: dict = {"uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups())}
    client = DaemonClient(args.socket, engine_id=args.engine_id, rank=0, tp_size=1, role="both", timeout_s=10)
    try:
        client.connect()
        client.send(wp.Ping(token=7))
        deadline = time.monotonic() + 10
        while not any(isinstance(e, wp.Pong) and e.token == 7 for e in client.poll()):
            if time.monotonic() > deadline:
                raise TimeoutError("no Pong")
            select.select([client.fileno()], [], [], 0.5)
        out.update(admitted=True, error="")
    except (PushsvcError, OSError) as exc:
        out.update(admitted=False, error=f"{type(exc).__name__}: {exc}")
    finally:
        client.close()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
