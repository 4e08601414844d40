"""End to end: client request ids through the proxy, vLLM P and D and their daemons.

Two requests sent at once with one ``X-Request-Id`` must each get their own prompt's
output: the proxy gives each exchange its own match key (``transfer_id``), and P's daemon
pairs D's registration with P's blocks by it, not by the ids vLLM derives from the shared
``X-Request-Id``. An ``X-Request-Id`` longer than the daemons could carry once vLLM has
wrapped it is refused by the proxy at once, instead of leaving the request unanswered.

One deployment serves the module, with colocated reference outputs (see conftest).
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import PD, Outcome, generate, metric, scrape, wait_tables_zero
from outputs import assert_same_as_colocated

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SETTLE_S = 15.0  # for P's push and the last engine steps after the answers

# Requests of the shared output set (helpers.build_requests) sent in pairs under one id. The
# completion pairs fill the same number of 128-token KV blocks, so a push paired with the
# wrong request would fit D's blocks and show as wrong tokens, not as an error.
PAIRS = [("cmpl-129", "cmpl-200"), ("cmpl-255", "cmpl-256"), ("cmpl-767", "cmpl-768"), ("chat-40", "chat-700")]
ROUNDS = 3  # a crossed pairing depends on timing: give it several chances


def _assert_colocated_output(pd: PD, name: str, got: Outcome, context: str) -> None:
    assert_same_as_colocated(got, pd.refs[name], f"{name} ({context})", pd.logs)


def test_two_concurrent_requests_with_one_request_id_each_get_their_own_output(pd: PD) -> None:
    with ThreadPoolExecutor(2) as pool:
        for round_ in range(ROUNDS):
            for pair in PAIRS:
                rid = f"e2e-shared-{uuid.uuid4().hex[:8]}"
                reqs = [pd.req(name) for name in pair]
                got = list(pool.map(lambda r, rid=rid: generate(pd.proxy.url, r, request_id=rid), reqs))
                for req, outcome in zip(reqs, got):
                    _assert_colocated_output(pd, req.name, outcome, f"round {round_}, X-Request-Id {rid}")
    wait_tables_zero(pd.daemon_urls(), SETTLE_S)


def test_request_id_over_200_characters_is_refused_by_the_proxy_at_once(pd: PD) -> None:
    refused_before = _refused(pd)
    got = generate(pd.proxy.url, pd.req("cmpl-13"), request_id="x" * 400, timeout=10)
    assert got.status == 400, f"{got}\n{pd.logs()}"
    assert got.elapsed_s < 5 and "at most 200" in got.error, got
    assert _refused(pd) == refused_before + 1
    wait_tables_zero(pd.daemon_urls(), SETTLE_S)  # nothing reached a daemon, or it was cleaned up


def test_request_id_of_200_characters_goes_through(pd: PD) -> None:
    """The longest id the proxy takes still fits the daemons once vLLM has wrapped it
    (``chatcmpl-<id>-<8 hex>``, ``cmpl-<id>-0-<8 hex>``)."""
    for name in ("cmpl-13", "chat-40"):
        rid = f"e2e-{uuid.uuid4().hex}".ljust(200, "z")
        _assert_colocated_output(pd, name, generate(pd.proxy.url, pd.req(name), request_id=rid),
                                 "a 200-character X-Request-Id")
    wait_tables_zero(pd.daemon_urls(), SETTLE_S)


def _refused(pd: PD) -> float:
    return metric(scrape(pd.proxy.url), "pushsvc_proxy_request_id_refused_total", reason="too_long") or 0.0
