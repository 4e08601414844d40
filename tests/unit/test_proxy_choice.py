"""Choosing the P: prefix affinity (proxy/affinity.py), prompts that start alike go to the
P whose prefix cache holds that start, bounded by load (short prompts and a busy or lost P
fall back to least outstanding); and a P that refuses the connection hands the request on."""

from __future__ import annotations

import pytest
from proxy_standins import COMPLETION, closed_port_url, cluster, outstanding, transfer_id_of, wait_until

from pushsvc.proxy.affinity import CHUNK, MAX_CHUNKS, PrefixMap, prefix_keys, prompt_text
from pushsvc.proxy.backends import PREFILL, Backend, BackendPool
from pushsvc.proxy.legs import CHAT, COMPLETIONS

LONG_A = "alpha " * 400  # 2400 bytes: 4 whole chunks
LONG_B = "bravo " * 400


def test_keys_are_shared_exactly_as_far_as_two_prompts_start_alike() -> None:
    a = prefix_keys(LONG_A.encode())
    assert len(a) == len(LONG_A) // CHUNK
    branch = prefix_keys((LONG_A[:2 * CHUNK] + LONG_B).encode())
    assert branch[:2] == a[:2] and branch[2] != a[2]
    assert prefix_keys(b"x" * (CHUNK - 1)) == []  # not a whole chunk: no key
    assert len(prefix_keys(b"y" * (CHUNK * (MAX_CHUNKS + 5)))) == MAX_CHUNKS


def test_prompt_text_reads_completions_chat_and_token_ids_and_ignores_the_rest() -> None:
    assert prompt_text(COMPLETIONS, {"prompt": "hi"}) == b"hi"
    assert prompt_text(COMPLETIONS, {"prompt": ["first", "second"]}) == b"first"
    assert prompt_text(COMPLETIONS, {"prompt": [5, 6, 70]}) == b"5,6,70"
    assert prompt_text(COMPLETIONS, {"prompt": {"odd": 1}}) == b""
    chat = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "image_url"}]}]}
    assert prompt_text(CHAT, chat) == b"system\nbe brief\nuser\nhello\n"
    assert prompt_text(CHAT, {"messages": "not a list of messages"}) == b""


def test_the_map_answers_the_longest_known_prefix_and_forgets_a_backend() -> None:
    m: PrefixMap[str] = PrefixMap(max_entries=8)
    a = prefix_keys(LONG_A.encode())
    m.remember(a[:2], "p0")
    m.remember(a, "p1")
    assert m.lookup(a) == "p1" and m.lookup(a[:1]) == "p1"  # p1 took the whole prompt since
    m.forget("p1")
    assert m.lookup(a) is None and len(m) == 0
    m.remember(prefix_keys(b"z" * CHUNK * 20), "p2")
    assert len(m) == 8  # bounded: the oldest keys went


def _pool(*outstanding: int) -> BackendPool:
    backends = [Backend(f"http://p{i}", PREFILL, outstanding=n) for i, n in enumerate(outstanding)]
    return BackendPool(backends)


def test_the_preferred_backend_wins_only_within_the_slack() -> None:
    pool = _pool(3, 1)
    p0, p1 = pool.backends
    assert pool.pick(p0, slack=2) is p0  # 3 <= 1 + 2
    assert pool.pick(p0, slack=2) is p1  # now 4 > 1 + 2: least outstanding
    p1.mark_failed("down")
    assert pool.pick(p1, slack=10) is p0, "an unhealthy preferred backend is skipped while another is up"
    assert pool.pick(Backend("http://elsewhere", PREFILL), slack=10) in (p0, p1)


@pytest.mark.asyncio
async def test_a_prompt_starting_like_an_earlier_one_goes_to_the_same_p() -> None:
    async with cluster(n_prefill=2) as c:
        for text in (LONG_A, LONG_B, LONG_A + " and more", LONG_B + " again"):
            status, _, _ = await c.post("/v1/completions", {**COMPLETION, "prompt": text})
            assert status == 200
        took = {p.name: [r.body["prompt"][:5] for r in p.received] for p in c.prefill}
        assert sorted(took.values()) == [["alpha", "alpha"], ["bravo", "bravo"]], took
        text = await c.metrics()
        assert 'pushsvc_proxy_prefix_affinity_total{result="hit"} 2.0' in text
        assert 'pushsvc_proxy_prefix_affinity_total{result="miss"} 2.0' in text
        status, _, _ = await c.post("/v1/completions", COMPLETION)  # short: least outstanding alone
        assert status == 200 and 'pushsvc_proxy_prefix_affinity_total{result="short"} 1.0' in await c.metrics()


@pytest.mark.asyncio
async def test_affinity_off_balances_by_outstanding_alone() -> None:
    async with cluster(n_prefill=2, prefix_affinity_slack=-1) as c:
        for _ in range(4):
            status, _, _ = await c.post("/v1/completions", {**COMPLETION, "prompt": LONG_A})
            assert status == 200
        assert [len(p.received) for p in c.prefill] == [2, 2]  # ties go round robin


@pytest.mark.parametrize("daemons", ["given", "learned"])
@pytest.mark.asyncio
async def test_a_p_that_refuses_the_connection_hands_the_request_to_another(daemons: str) -> None:
    """A P taken out before the probe noticed: its leg cannot connect, so nothing reached it
    and nothing reached the client; the exchange runs again on the other P, with a new match
    key, and D's first leg (if it was sent) is closed."""
    config = {"prefill_daemon": []} if daemons == "learned" else {}
    async with cluster(n_prefill=2, **config) as c:
        gone = c.server.proxy.prefill.backends[0]
        gone.url = closed_port_url()
        status, _, doc = await c.post("/v1/completions", COMPLETION)
        assert status == 200 and doc["choices"][0]["text"] == "from d0"
        assert len(c.prefill[1].received) == 1 and not gone.healthy
        keys = [transfer_id_of(r.body) for r in c.d.received]
        assert keys[-1] == transfer_id_of(c.prefill[1].received[0].body)
        assert len(set(keys)) == len(keys), "a retried exchange carries a new match key"
        assert 'pushsvc_proxy_prefill_retries_total 1.0' in await c.metrics()
        await wait_until(lambda: outstanding(c) == [0, 0, 0])
        status, _, _ = await c.post("/v1/completions", COMPLETION)  # the probe's verdict stands: no retry
        assert status == 200 and len(c.prefill[1].received) == 2
        assert 'pushsvc_proxy_prefill_retries_total 1.0' in await c.metrics()


@pytest.mark.asyncio
async def test_with_every_p_unreachable_the_client_gets_one_502() -> None:
    async with cluster(n_prefill=2) as c:
        for backend in c.server.proxy.prefill.backends:
            backend.url = closed_port_url()
        status, _, doc = await c.post("/v1/completions", COMPLETION)
        assert status == 502 and "unreachable" in doc["error"]["message"]
        assert 'pushsvc_proxy_prefill_retries_total 1.0' in await c.metrics()  # tried the other once
