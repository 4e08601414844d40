"""End to end across hosts: two Ps, two Ds and the proxy each on a host of its own.

The hosts are network namespaces on a bridge, each process also in an IPC namespace of
its own (``netns.py``): nothing but TCP between them. The daemons listen off loopback, so
they run as an operator would run them between hosts: the side channel authenticated by
a shared secret, the peers they may dial restricted to the hosts' network, the health
endpoint behind a bearer token. The proxy is given only vLLM's URLs and learns P's daemon
from P's answers. The proxy sends a prompt that starts like an earlier one to the P that
computed that start (its prefix cache hits). The operator drains a P and a D under load
and resumes them (the proxy's admin routes, behind its token). vLLM's own router serves
the same four instances. Then one D host dies (every process on it,
SIGKILL): P frees what it held for that D, and the proxy sends later requests to the
other D.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from conftest import kept_on_failure
from helpers import (
    E2EStack,
    Outcome,
    Req,
    build_requests,
    completion,
    generate,
    generate_all,
    get_json,
    http_post,
    metric,
    scrape,
    text_with_tokens,
    wait_for,
)
from outputs import assert_like_colocated
from netns import Host, Hosts

from pushsvc.launch import Proc, connector_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from fronts import start_vllm_router  # noqa: E402 - the benchmark of both fronts starts the router the same way

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PEER_TIMEOUT_S = 5.0  # the daemons' default peer timeout: a dead host is noticed within it
# P's blocks no D claimed are released after this (the dead D host's test waits for it).
# Four engines share the host's two cores here, and under load a request can wait in an
# engine's queue for tens of seconds: with 10 s, a request of the drain test failed 10.8 s
# in, at about P's lease.
P_LEASE_S = 30.0
# D's watchdog at the daemon's default: no test here waits for it, and under load a request
# waited up to 38 s in P's queue while D held its registration (with 20 s, such requests failed).
D_WATCHDOG_S = 120.0
CPUS = {"p1": "0", "p2": "1", "d1": "0", "d2": "1"}  # two engines per core
SETTLE_S = 30.0


def _secret_file(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o400)
    return str(path)


@dataclass
class Cluster:
    hosts: Hosts
    stack: E2EStack
    refs: dict[str, Outcome]
    reqs: list[Req]
    auth: dict[str, str]
    prefill_daemons: dict[str, Proc]
    decode_daemons: dict[str, Proc]
    prefills: dict[str, Proc]
    decodes: dict[str, Proc]
    proxy: Proc
    model: str
    tokenizer: Any

    def logs(self, n: int = 30) -> str:
        return self.stack.logs(n)

    def daemon_metric(self, daemon: Proc, name: str, **labels: str) -> float:
        return metric(scrape(daemon.url, self.auth), name, **labels) or 0.0

    def tables(self, daemon: Proc) -> dict[str, int]:
        return get_json(f"{daemon.url}/v1/info", headers=self.auth)["tables"]

    def pushes_done(self) -> float:
        return sum(self.daemon_metric(d, "pushsvc_transfers_total", result="done")
                   for d in self.prefill_daemons.values())

    def start_prefill(self, name: str, model: str, port: int = 0) -> Proc:
        proc = self.stack.vllm(f"vllm-{name}", model, port,
                               kv_transfer_config=connector_config("kv_producer", self.prefill_daemons[name]),
                               cpus=CPUS[name], on=self.hosts[name])
        self.prefills[name] = proc
        return proc


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, model_path: str, tokenizer: Any,
            colocated_refs: dict[str, Outcome]) -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.fail("the multi-host test builds network namespaces: it needs root", pytrace=False)
    reqs = build_requests(tokenizer, model_path).outputs
    with kept_on_failure(request) as workdir, E2EStack(workdir, progress=print) as st, \
            Hosts(["p1", "p2", "d1", "d2", "proxy"]) as hosts:
        refs = colocated_refs  # the same colocated server's answers as every module's

        secret = _secret_file(workdir / "side-channel.secret", secrets.token_urlsafe(32))
        token_text = secrets.token_hex(16)
        token = _secret_file(workdir / "health.token", token_text)

        def daemon(name: str, host: Host, *timers: str) -> Proc:
            return st.daemon(name, "--side-channel-host", host.ip, "--advertised-host", host.ip,
                             "--side-channel-secret-file", secret, "--allowed-peer-host", hosts.network,
                             "--health-token-file", token, "--verify", *timers, on=host)

        pdaemons = {name: daemon(f"prefill-{name}", hosts[name], "--lease-s", str(P_LEASE_S))
                    for name in ("p1", "p2")}
        ddaemons = {name: daemon(f"decode-{name}", hosts[name], "--watchdog-s", str(D_WATCHDOG_S))
                    for name in ("d1", "d2")}
        c = Cluster(hosts, st, refs, reqs, {"Authorization": f"Bearer {token_text}"}, pdaemons, ddaemons, {}, {},
                    None, model_path, tokenizer)  # type: ignore[arg-type]
        for name in ("p1", "p2"):
            c.start_prefill(name, model_path)
        c.decodes.update({name: st.vllm(f"vllm-{name}", model_path,
                                        kv_transfer_config=connector_config("kv_consumer", ddaemons[name]),
                                        cpus=CPUS[name], on=hosts[name]) for name in ("d1", "d2")})
        c.proxy = st.proxy("proxy", prefill=list(c.prefills.values()), prefill_daemons=[],
                           decode=list(c.decodes.values()), on=hosts["proxy"],
                           extra=("--health-interval-s", "1", "--admin-token-file", token))
        yield c


def test_daemons_off_loopback_refuse_what_is_not_authenticated(cluster: Cluster) -> None:
    """What listens beyond loopback asks for credentials: the health endpoint's data
    behind the token (probes stay open), the side channel behind the secret."""
    from helpers import http_get

    daemon = cluster.prefill_daemons["p1"]
    status, _ = http_get(f"{daemon.url}/v1/info")
    assert status == 401
    assert http_get(f"{daemon.url}/readyz")[0] == 200
    info = get_json(f"{daemon.url}/v1/info", headers=cluster.auth)
    assert info["side_channel_host"] == cluster.hosts["p1"].ip


def test_outputs_match_colocated_across_hosts(cluster: Cluster) -> None:
    """Every prompt's KV went from a P's host to a D's host over TCP, authenticated, checked
    byte for byte (verify mode), and both Ps and both Ds took part."""
    done_before = cluster.pushes_done()
    got = generate_all(cluster.proxy.url, cluster.reqs, concurrency=8)
    assert_like_colocated(got, cluster.refs, cluster.reqs, "the proxy on its own host", cluster.logs)
    wait_for("P daemons' completed pushes", lambda: cluster.pushes_done() - done_before,
             lambda n: n >= len(cluster.reqs), SETTLE_S)
    pushed = {name: cluster.daemon_metric(d, "pushsvc_transfers_total", result="done")
              for name, d in cluster.prefill_daemons.items()}
    identical = {name: cluster.daemon_metric(d, "pushsvc_verify_total", result="identical")
                 for name, d in cluster.decode_daemons.items()}
    assert sum(identical.values()) == len(cluster.reqs) and all(identical.values()), identical
    assert all(pushed.values()), pushed
    for daemon in (*cluster.prefill_daemons.values(), *cluster.decode_daemons.values()):
        peers = get_json(f"{daemon.url}/v1/info", headers=cluster.auth)["peers"]
        assert peers and all(p.get("authenticated") for p in peers), peers


def test_a_prompt_starting_like_an_earlier_one_goes_to_the_p_that_computed_that_start(cluster: Cluster) -> None:
    """The proxy's prefix affinity: the second prompt shares the first one's first ~1000
    tokens, lands on the same P (the proxy's metric says hit) and that P's prefix cache
    serves the shared blocks."""
    head = text_with_tokens(cluster.tokenizer, 1000, seed=8201)
    first = completion("affinity-first", cluster.model, head + " " + text_with_tokens(cluster.tokenizer, 100, 8202))
    second = completion("affinity-second", cluster.model, head + " " + text_with_tokens(cluster.tokenizer, 100, 8203))
    hits = {name: metric(scrape(p.url), "vllm:prefix_cache_hits_total") or 0.0 for name, p in cluster.prefills.items()}
    affinity = metric(scrape(cluster.proxy.url), "pushsvc_proxy_prefix_affinity_total", result="hit") or 0.0
    for req in (first, second):
        assert generate(cluster.proxy.url, req).ok
    gained = {name: (metric(scrape(p.url), "vllm:prefix_cache_hits_total") or 0.0) - hits[name]
              for name, p in cluster.prefills.items()}
    assert (metric(scrape(cluster.proxy.url), "pushsvc_proxy_prefix_affinity_total", result="hit") or 0.0) \
        == affinity + 1
    assert max(gained.values()) >= 7 * 128, f"prefix cache hits (tokens) per P: {gained}"


def _admin(cluster: Cluster, action: str, proc: Proc) -> dict[str, Any]:
    status, text = http_post(f"{cluster.proxy.url}/admin/{action}", {"backend": proc.url}, headers=cluster.auth)
    assert status == 200, f"{action} {proc.name}: {status} {text}"
    return json.loads(text)


def _served(cluster: Cluster) -> dict[str, float]:
    """Pushes each P's daemon finished and pushes each D's daemon verified, by host."""
    out = {name: cluster.daemon_metric(d, "pushsvc_transfers_total", result="done")
           for name, d in cluster.prefill_daemons.items()}
    out.update({name: cluster.daemon_metric(d, "pushsvc_verify_total", result="identical")
                for name, d in cluster.decode_daemons.items()})
    return out


def test_a_p_and_a_d_drained_under_load_finish_their_requests_take_no_new_ones_and_come_back(
        cluster: Cluster) -> None:
    """The operator takes P2 and D2 out while requests stream through the proxy: what they
    have in flight finishes, nothing fails, and until they are resumed every new request
    goes to P1 and D1; resumed, they take requests again."""
    status, _ = http_post(f"{cluster.proxy.url}/admin/drain", {"backend": cluster.decodes["d2"].url})
    assert status == 401  # the proxy listens beyond loopback: the admin routes need its token
    load, refs = cluster.reqs[4:20], cluster.refs  # 34 to 1024 prompt tokens
    # Drained under a load of each prompt twice, so that it outlasts the moment P2 and D2 are
    # seen busy: with the prompts once, the proxy gave P2 and D2 their first requests near
    # the load's end on a slow host, and the load was over when they were drained.
    under = load + [replace(r, name=f"{r.name}-again") for r in load]
    before = _served(cluster)
    try:
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(generate_all, cluster.proxy.url, under, 4)
            wait_for("P2 and D2 busy", lambda: _served(cluster), lambda s: s["p2"] > before["p2"] and
                     s["d2"] > before["d2"], 120, interval=0.05)
            drained = [_admin(cluster, "drain", proc) for proc in (cluster.prefills["p2"], cluster.decodes["d2"])]
            assert all(d["draining"] for d in drained), drained
            assert not running.done(), "the load ended before the drain: nothing was drained under load"
            wait_for("P2 and D2 idle at the proxy", lambda: [b["outstanding"] for b in get_json(
                f"{cluster.proxy.url}/admin/backends", headers=cluster.auth) if b["draining"]],
                     lambda counts: counts == [0, 0], 60, interval=0.05)
            for daemon in (cluster.prefill_daemons["p2"], cluster.decode_daemons["d2"]):
                wait_for(f"{daemon.name}'s tables empty", lambda d=daemon: cluster.tables(d),
                         lambda t: not any(t.values()), SETTLE_S)
            idle = _served(cluster)
            got = running.result(timeout=300)
        again = generate_all(cluster.proxy.url, load[:8], concurrency=4)
        wait_for("P1's pushes", lambda: _served(cluster)["p1"], lambda n: n >= idle["p1"] + 8, SETTLE_S)
        assert (_served(cluster)["p2"], _served(cluster)["d2"]) == (idle["p2"], idle["d2"])
    finally:  # the cluster's later tests need all four, whatever happened here
        resumed = [_admin(cluster, "resume", proc) for proc in (cluster.prefills["p2"], cluster.decodes["d2"])]
    assert not any(d["draining"] for d in resumed), resumed
    back = generate_all(cluster.proxy.url, load, concurrency=4)
    wait_for("P2 and D2 serving again", lambda: _served(cluster),
             lambda s: s["p2"] > idle["p2"] and s["d2"] > idle["d2"], SETTLE_S)
    # Every request of the three runs succeeded, with the colocated output (one check over
    # all 56, whose tolerance for a bf16 near-tie is one request in 24).
    runs = {"drained": (got, under), "without-p2-d2": (again, load[:8]), "resumed": (back, load)}
    outcomes = {f"{name}@{run}": o for run, (got_, _) in runs.items() for name, o in got_.items()}
    tagged = [replace(r, name=f"{r.name}@{run}") for run, (got_, sent) in runs.items() for r in sent
              if r.name in got_]
    assert_like_colocated(outcomes, {r.name: refs[r.name.partition("@")[0].removesuffix("-again")] for r in tagged},
                          tagged, "the proxy while P2 and D2 were drained and after", cluster.logs)


def test_two_ps_and_two_ds_serve_behind_vllm_router_too(cluster: Cluster) -> None:
    """vLLM's own router on the proxy's host, given the same four vLLM URLs and nothing
    about pushsvc (round robin, so both of each kind serve): every output like colocated,
    every push verified, both Ps and both Ds taking part."""
    router = start_vllm_router(cluster.stack, "vllm-router", list(cluster.prefills.values()),
                               list(cluster.decodes.values()), extra=("--policy", "round_robin"),
                               on=cluster.hosts["proxy"])
    before = _served(cluster)
    load = cluster.reqs[:16]
    got = generate_all(router.url, load, concurrency=4)
    assert_like_colocated(got, cluster.refs, load, "vllm-router with two Ps and two Ds", cluster.logs)
    served = wait_for("pushes verified at the Ds", lambda: _served(cluster),
                      lambda s: s["d1"] + s["d2"] - before["d1"] - before["d2"] >= len(load), SETTLE_S)
    assert all(served[name] > before[name] for name in before), (before, served)
    cluster.stack.stop(router)


def test_a_dead_d_host_frees_ps_blocks_and_the_proxy_routes_around_it(cluster: Cluster) -> None:
    """Requests in flight on D1 when its host dies may fail. What P holds for D1 (its
    registrations, its WRITEs) goes once P's daemon sees D1 gone (the peer timeout); P's
    blocks that no D had claimed yet (D1 died before its registration left) go at P's
    lease, the only bound there is for blocks nobody asked for. Requests after that all
    succeed, on D2."""
    long = [completion(f"dead-{i}", cluster.model, text_with_tokens(cluster.tokenizer, 1200, seed=8100 + i))
            for i in range(6)]
    with ThreadPoolExecutor(len(long)) as pool:
        futures = [pool.submit(generate, cluster.proxy.url, r) for r in long]
        wait_for("requests registered at a P", lambda: [cluster.tables(d) for d in cluster.prefill_daemons.values()],
                 lambda ts: any(sum(t.values()) > 0 for t in ts), SETTLE_S, interval=0.05)
        killed = cluster.hosts["d1"].kill_all()
        assert killed, "no process on D1's host"
        dead_at = time.monotonic()
        outcomes = [f.result(timeout=120) for f in futures]
    ps = list(cluster.prefill_daemons.values())
    wait_for("the Ps to let go of D1's registrations and WRITEs", lambda: [cluster.tables(d) for d in ps],
             lambda ts: all(t["p_registrations"] == 0 and t["p_writing"] == 0 for t in ts), PEER_TIMEOUT_S + 5)
    held_for_d1 = time.monotonic() - dead_at
    unclaimed = sum(cluster.tables(d)["p_staged"] for d in ps)
    wait_for("P daemons' tables empty", lambda: [cluster.tables(d) for d in ps],
             lambda ts: not any(any(t.values()) for t in ts), P_LEASE_S + 5)
    print(f"D1's host died: P let go of what D1 held after {held_for_d1:.1f} s, {unclaimed} unclaimed "
          f"blocks at the lease, everything after {time.monotonic() - dead_at:.1f} s")
    for name, p in cluster.prefills.items():
        wait_for(f"{name}'s vLLM KV cache back to idle", lambda u=p.url: metric(scrape(u), "vllm:kv_cache_usage_perc"),
                 lambda v: v == 0.0, SETTLE_S)
    print(f"requests in flight when D1's host died: {sum(o.ok for o in outcomes)} of {len(outcomes)} finished")
    # The proxy's health check takes D1 out; from then on every request goes to D2.
    wait_for("the proxy to see D1 down",
             lambda: metric(scrape(cluster.proxy.url), "pushsvc_proxy_backend_healthy", role="decode",
                            backend=cluster.decodes["d1"].url), lambda v: v == 0.0, 10)
    served_before = cluster.daemon_metric(cluster.decode_daemons["d2"], "pushsvc_verify_total", result="identical")
    later = cluster.reqs[:8]
    got = generate_all(cluster.proxy.url, later, concurrency=4)
    assert_like_colocated(got, cluster.refs, later, "the proxy with D1's host dead", cluster.logs)
    wait_for("D2's verified pushes", lambda: cluster.daemon_metric(cluster.decode_daemons["d2"],
                                                                    "pushsvc_verify_total", result="identical")
             - served_before, lambda n: n >= len(later), SETTLE_S)
