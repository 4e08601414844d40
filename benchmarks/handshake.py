"""Side-channel handshake time, with and without shared-secret authentication.

    python benchmarks/handshake.py [--n 50] [--json]

An acceptor ``PeerManager`` runs in a child process, a dialer in this one (each on its
own uvloop, over loopback TCP). Each sample is one ``PeerManager.ensure`` on a fresh
dialer: TCP connect, preamble, the auth exchange when a secret is set, and the hellos
(one agent with 8 KiB of metadata and 64 regions, about the size of a real one), until
the dialer has adopted the peer. Mode ``rejected`` times a dialer with another secret
until its handshake fails. Prints the median and p90 per mode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import time

import uvloop

from pushsvc.errors import HandshakeError
from pushsvc.logging import configure_logging
from pushsvc.metrics import Metrics
from pushsvc.protocol import peer as pp
from pushsvc.server.peers import PeerEvents, PeerManager

SECRET = b"benchmark-secret-0123456789abcdef"
OTHER = b"another-secret-0123456789abcdef!!"
AGENT = pp.AgentInfo(rank=0, tp_size=1, agent_name="bench/r0/00000000.1", metadata=bytes(8192),
                     regions=[pp.RegionInfo(base=0x7F0000000000 + i * (1 << 24), block_len=16384, num_blocks=1024)
                              for i in range(64)])


def _manager(engine_id: str, secret: bytes | None) -> PeerManager:
    return PeerManager(daemon_id=f"{engine_id}-{time.monotonic_ns()}", engine_id=engine_id,
                       advertised_host="127.0.0.1", local_agents=lambda: [AGENT], events=PeerEvents(),
                       metrics=Metrics(), max_frame=64 << 20, handshake_timeout_s=5.0, heartbeat_interval_s=1.0,
                       peer_timeout_s=5.0, secret=secret)


def _acceptor(secret: bytes | None, port_out: mp.Queue, stop: mp.Event) -> None:
    configure_logging("console", "error")
    async def main() -> None:
        mgr = _manager("acceptor", secret)
        port_out.put(await mgr.start("127.0.0.1", 0))
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await mgr.close()

    uvloop.run(main())


async def _dial_samples(port: int, secret: bytes | None, n: int, expect_failure: bool) -> list[float]:
    samples = []
    for i in range(n + 3):  # the first few warm up imports and caches
        dialer = _manager(f"dialer{i}", secret)
        t0 = time.perf_counter()
        try:
            await dialer.ensure("127.0.0.1", port, "acceptor")
            assert not expect_failure, "a dialer with another secret was accepted"
        except HandshakeError:
            if not expect_failure:
                raise
        dt = time.perf_counter() - t0
        await dialer.close()
        if i >= 3:
            samples.append(dt)
    return samples


def measure(secret: bytes | None, n: int, dialer_secret: bytes | None) -> list[float]:
    ctx = mp.get_context("spawn")
    port_q, stop = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_acceptor, args=(secret, port_q, stop))
    child.start()
    try:
        port = port_q.get(timeout=30)
        return uvloop.run(_dial_samples(port, dialer_secret, n, expect_failure=dialer_secret != secret))
    finally:
        stop.set()
        child.join(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=50, help="handshakes per mode (default 50)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    configure_logging("console", "error")  # one log line per handshake otherwise
    result = {}
    for mode, secret, dialer_secret in (("plain", None, None), ("auth", SECRET, SECRET),
                                        ("rejected", SECRET, OTHER)):
        s = sorted(measure(secret, args.n, dialer_secret))
        result[mode] = {"n": len(s), "median_ms": round(statistics.median(s) * 1e3, 3),
                        "p90_ms": round(s[int(0.9 * (len(s) - 1))] * 1e3, 3)}
    if args.json:
        print(json.dumps(result))
        return
    for mode, r in result.items():
        print(f"{mode:8s}: median {r['median_ms']:.3f} ms, p90 {r['p90_ms']:.3f} ms over {r['n']} handshakes")
    extra = result["auth"]["median_ms"] - result["plain"]["median_ms"]
    print(f"authentication adds {extra:.3f} ms to the median handshake")


if __name__ == "__main__":
    main()
