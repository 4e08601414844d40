"""Side-channel handshake time, with and without shared-secret authentication.

    python benchmarks/handshake.py [--n 50] [--json]

One acceptor ``PeerManager`` per mode runs in a child process, the dialers in this one
(each on its own uvloop, over loopback TCP); the modes take turns, so load on the
machine hits them alike. Each sample is one ``PeerManager.ensure`` on a fresh dialer:
TCP connect, preamble, the auth exchange when a secret is set, and the hellos (one
agent with 8 KiB of metadata and 64 regions, about the size of a real one), until the
dialer has adopted the peer. Mode ``rejected`` times a dialer with another secret until
its handshake fails. Prints the median and p90 per mode.
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
from pushsvc.server.peers import Peer, PeerManager, PeerSettings

SECRET = b"benchmark-secret-0123456789abcdef"
OTHER = b"another-secret-0123456789abcdef!!"
AGENT = pp.AgentInfo(rank=0, tp_size=1, agent_name="bench/r0/00000000.1", metadata=bytes(8192),
                     regions=[pp.RegionInfo(base=0x7F0000000000 + i * (1 << 24), block_len=16384, num_blocks=1024)
                              for i in range(64)])


class _Ignore:
    """Peer events with nowhere to go: the benchmark measures the handshake alone."""

    def peer_up(self, peer: Peer) -> None: ...
    def agents_announced(self, peer: Peer, agents: list[pp.AgentInfo]) -> None: ...
    def peer_down(self, peer: Peer) -> None: ...
    def peer_gone(self, peer: Peer) -> None: ...
    def push_failed(self, peer: Peer, msg: pp.PushFailed) -> None: ...
    def cancel_push(self, peer: Peer, msg: pp.CancelPush) -> None: ...
    def push_cancelled(self, peer: Peer, msg: pp.PushCancelled) -> None: ...
    def write_started(self, peer: Peer, msg: pp.WriteStarted) -> None: ...


def _manager(engine_id: str, secret: bytes | None) -> PeerManager:
    return PeerManager(daemon_id=f"{engine_id}-{time.monotonic_ns()}", engine_id=engine_id,
                       advertised_host="127.0.0.1", local_agents=lambda: [AGENT], events=_Ignore(),
                       metrics=Metrics(), settings=PeerSettings(64 << 20, 5.0, 1.0, 5.0), secret=secret)


def _acceptor(secret: bytes | None, port_out: mp.Queue, stop: mp.Event) -> None:
    configure_logging("console", "error")

    async def main() -> None:
        mgr = _manager("acceptor", secret)
        port_out.put(await mgr.start("127.0.0.1", 0))
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await mgr.close()

    uvloop.run(main())


# (mode, acceptor's secret, dialer's secret)
MODES = (("plain", None, None), ("auth", SECRET, SECRET), ("rejected", SECRET, OTHER))


async def _dial_once(port: int, secret: bytes | None, expect_failure: bool, i: int) -> float:
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
    return dt


async def _dial_samples(ports: dict[str, int], n: int) -> dict[str, list[float]]:
    # The modes take turns, so a load spike on the machine hits all of them alike.
    samples: dict[str, list[float]] = {mode: [] for mode, _, _ in MODES}
    for i in range(n + 3):  # the first rounds warm up imports and caches
        for mode, secret, dialer_secret in MODES:
            dt = await _dial_once(ports[mode], dialer_secret, dialer_secret != secret, i)
            if i >= 3:
                samples[mode].append(dt)
    return samples


def measure(n: int) -> dict[str, list[float]]:
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    children, ports = [], {}
    try:
        for mode, secret, _ in MODES:
            port_q = ctx.Queue()
            child = ctx.Process(target=_acceptor, args=(secret, port_q, stop))
            child.start()
            children.append(child)
            ports[mode] = port_q.get(timeout=30)
        return uvloop.run(_dial_samples(ports, n))
    finally:
        stop.set()
        for child in children:
            child.join(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=50, help="handshakes per mode (default 50)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    configure_logging("console", "error")  # one log line per handshake otherwise
    result = {}
    for mode, samples in measure(args.n).items():
        s = sorted(samples)
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
