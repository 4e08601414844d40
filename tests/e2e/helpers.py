"""Helpers of the end-to-end tests: prompts, requests, HTTP calls, metrics, polling.

Plain blocking code (stdlib HTTP, threads for concurrency): the tests drive real servers and
spend their time waiting on them, not on the client.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import shutil
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from pushsvc.launch import Host, Proc, Stack, vllm_dtype

# vLLM's MLA backend whose KV layout the MLA tests are written for: vLLM picks AMX_MLA
# instead on a CPU with AMX tiles (bfloat16 only) unless CPU_MLA is asked for.
CPU_MLA = ("--attention-backend", "CPU_MLA")
# Bytes of one KV value in the servers' dtype (``vllm_dtype``: float32 on a CPU with AMX tiles).
KV_ELEMENT_BYTES = 4 if vllm_dtype() == "float32" else 2

T = TypeVar("T")

# Decode daemon: a registration with no push fails after this. Long enough for the modules'
# loads on a 2-core host without AMX, where vLLM CPU runs bfloat16 and a request can wait
# 20-40 s in P's queue while D holds its registration (20 s failed such requests); the
# fault tests that wait for it take that much longer.
WATCHDOG_S = 60.0
LEASE_S = 30.0  # prefill daemon: blocks no decoder claimed are released after this

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MAX_TOKENS = 16
HTTP_TIMEOUT_S = 120.0


class Tokenizer(Protocol):
    def __call__(self, text: str) -> Any: ...


# ---------------------------------------------------------------------------- prompts

_WORDS = """the of and to in is it that was for on are with as his they be at one have this from or had by word
but what some we can out other were all there when up use your how said an each she which do their
time if will way about many then them write would like so these her long make thing see him two has
look more day could go come did number sound no most people my over know water than call first who
may down side been now find any new work part take get place made live where after back little only
round man year came show every good me give our under name very through just form sentence great
think say help low line differ turn cause much mean before move right boy old too same tell does set
three want air well also play small end put home read hand port large spell add even land here must
big high such follow act why ask men change went light kind off need house picture try us again
animal point mother world near build self earth father river garden window letter morning evening
story music market winter summer doctor teacher village mountain
""".split()


def english_words(seed: int, n: int) -> list[str]:
    """``n`` words of English-like text (sentences with capitals and punctuation), fixed by ``seed``."""
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n:
        sentence = rng.choices(_WORDS, k=rng.randint(5, 14))
        sentence[0] = sentence[0].capitalize()
        sentence[-1] += rng.choice([".", ".", ".", ",", "?", "!"])
        out += sentence
    return out[:n]


def count_tokens(tokenizer: Tokenizer, text: str) -> int:
    """Prompt tokens as vLLM counts them for /v1/completions (the BOS included)."""
    return len(tokenizer(text)["input_ids"])


def text_with_tokens(tokenizer: Tokenizer, target: int, seed: int) -> str:
    """English-like text of ``target`` prompt tokens (exactly, when a suffix gets it there)."""
    words = english_words(seed, target + 8)  # every word is at least one token
    lo, hi = 1, len(words)  # the largest prefix of words within the target
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(tokenizer, " ".join(words[:mid])) <= target:
            lo = mid
        else:
            hi = mid - 1
    text = " ".join(words[:lo])
    for _ in range(4):  # close the gap with short suffixes, one token at a time
        have = count_tokens(tokenizer, text)
        if have >= target:
            break
        for suffix in (".", ",", " a", " I", "!", " x", " 7"):
            if count_tokens(tokenizer, text + suffix) == have + 1:
                text += suffix
                break
        else:
            break
    return text


# The outputs test's prompt lengths (tokens): short ones, each side of the 128-token KV
# block (the last block is partial or exactly full), and long ones up to 1500.
PROMPT_LENGTHS = (5, 8, 13, 21, 34, 55, 89, 127, 128, 129, 200, 255, 256, 257, 384, 500, 640, 767, 768, 900,
                  1024, 1200, 1400, 1500)


@dataclass(frozen=True)
class Req:
    """One generation request: where it goes and the body sent (the same to every server)."""

    name: str
    path: str
    body: dict[str, Any]

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    def with_body(self, **changes: Any) -> Req:
        return Req(self.name, self.path, {**self.body, **changes})


def completion(name: str, model: str, prompt: str, *, stream: bool = False, max_tokens: int = MAX_TOKENS) -> Req:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "return_token_ids": True}
    if stream:
        body["stream"] = True
    return Req(name, COMPLETIONS, body)


def chat(name: str, model: str, content: str, *, stream: bool = False, max_tokens: int = MAX_TOKENS) -> Req:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content}],
                            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    if stream:
        body["stream"] = True
    return Req(name, CHAT, body)


@dataclass
class RequestSets:
    """Every request whose colocated output some test compares against."""

    outputs: list[Req]  # test_outputs_match_colocated, sent concurrently
    prefix: list[Req]  # test_prefix_cache_hit_on_d, sent in order
    long_prompt_tokens: int  # of the first prefix request (sent twice)
    shared_prefix_tokens: int  # tokens the last prefix request shares with the first
    later: list[Req]  # restart and P-killed tests

    def all(self) -> list[Req]:
        return [*self.outputs, *self.prefix, *self.later]


def build_requests(tokenizer: Tokenizer, model: str) -> RequestSets:
    prompts = [text_with_tokens(tokenizer, n, seed=1000 + i) for i, n in enumerate(PROMPT_LENGTHS)]
    outputs = [completion(f"cmpl-{n}", model, p) for n, p in zip(PROMPT_LENGTHS, prompts)]
    outputs += [
        chat("chat-40", model, text_with_tokens(tokenizer, 40, seed=2001)),
        chat("chat-700", model, text_with_tokens(tokenizer, 700, seed=2002)),
        chat("chat-stream-300", model, text_with_tokens(tokenizer, 300, seed=2003), stream=True),
        completion("cmpl-stream-60", model, text_with_tokens(tokenizer, 60, seed=2004), stream=True),
        completion("cmpl-stream-1100", model, text_with_tokens(tokenizer, 1100, seed=2005), stream=True),
    ]
    # A long prompt twice, then one sharing its first ~1000 tokens (a new tail).
    long_text = text_with_tokens(tokenizer, 1200, seed=3001)
    head = text_with_tokens(tokenizer, 1000, seed=3001)
    assert long_text.startswith(head)
    branch = head + " " + " ".join(english_words(3002, 150))
    long_ids, branch_ids = tokenizer(long_text)["input_ids"], tokenizer(branch)["input_ids"]
    shared = next((i for i, (a, b) in enumerate(zip(long_ids, branch_ids)) if a != b), min(len(long_ids),
                                                                                          len(branch_ids)))
    prefix = [completion("prefix-long", model, long_text), completion("prefix-long-again", model, long_text),
              completion("prefix-branch", model, branch)]
    later = [completion(f"later-{n}", model, text_with_tokens(tokenizer, n, seed=4000 + n)) for n in (30, 300, 900)]
    return RequestSets(outputs, prefix, len(long_ids), shared, later)


# ---------------------------------------------------------------------------- the deployment


class E2EStack(Stack):
    """``Stack`` with two things more on its vLLM servers: statistics (the tests read
    ``vllm:kv_cache_usage_perc`` and ``vllm:prefix_cache_hits`` from /metrics, which
    ``--disable-log-stats`` removes) and the dev endpoints (``/pause`` and ``/resume``)."""

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None,
               on: Host | None = None) -> Proc:
        if "vllm.entrypoints.openai.api_server" in argv:
            argv = [a for a in argv if a != "--disable-log-stats"]
            env = {**(env or {}), "VLLM_SERVER_DEV_MODE": "1"}
        return super()._spawn(name, argv, env, on=on)

    def logs(self, n: int = 30) -> str:
        """The last ``n`` lines of every process's log, for a failure message, then every
        process's warnings and errors (the last ``WARNINGS_KEPT`` of each): the cause of a
        failure is usually one of those, long before the tail."""
        tails = "\n".join(f"--- {p.name} ({p.log})\n{p.tail(n)}" for p in self.procs)
        return f"{tails}\n=== warnings and errors, by process\n{warnings(self.procs)}"


@dataclass(frozen=True)
class PDOptions:
    """How a module's stack is started; a test module overrides the ``pd_options`` fixture."""

    flags: dict[str, tuple[str, ...]] | None = None  # each daemon's flags; None: the default lease and watchdog
    with_refs: bool = True  # the colocated reference outputs (once per session: conftest's colocated_refs)
    prefill_extra: dict[str, object] | None = None  # more kv_connector_extra_config for P


@dataclass
class PD:
    """The running P/D deployment. Tests that restart or kill a process update it."""

    stack: E2EStack
    model: str
    requests: RequestSets
    refs: dict[str, Outcome]
    daemon_flags: dict[str, tuple[str, ...]]
    verify: bool
    prefill_daemon: Proc
    decode_daemon: Proc
    prefill: Proc
    decode: Proc
    proxy: Proc

    def req(self, name: str) -> Req:
        return next(r for r in self.requests.all() if r.name == name)

    def daemon_urls(self) -> dict[str, str]:
        return {"prefill": self.prefill_daemon.url, "decode": self.decode_daemon.url}

    def restart_daemon(self, name: str) -> Proc:
        """Start daemon ``name`` again on the same runtime dir, so on the same socket path, and
        on the same health port (the proxy is configured with P's daemon URL); the side
        channel gets a new port."""
        old: Proc = getattr(self, f"{name}_daemon")
        if old.log.exists():  # the new process writes the same log file
            shutil.copyfile(old.log, old.log.with_suffix(f".{int(time.time())}.log"))
        proc = self.stack.daemon(name, *self.daemon_flags[name], "--health-port", str(old.info["health_port"]))
        setattr(self, f"{name}_daemon", proc)
        return proc

    def logs(self, n: int = 30) -> str:
        return self.stack.logs(n)


WARNINGS_KEPT = 15
# structlog's JSON warnings and errors; of vLLM's lines only its errors (its start-up warnings are many)
_WARNING_MARKS = ('"level": "warning"', '"level": "error"', '"level": "critical"', " ERROR ", "Traceback")


def warnings(procs: Iterable[Proc], kept: int = WARNINGS_KEPT, width: int = 400) -> str:
    """Each process's last ``kept`` warning and error lines, each cut to ``width`` characters."""
    out = []
    for p in procs:
        try:
            lines = p.log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        marked = [line[:width] for line in lines if any(m in line for m in _WARNING_MARKS)]
        if marked:
            out.append(f"--- {p.name}: {len(marked)} warning/error lines, the last {min(kept, len(marked))}")
            out.extend(marked[-kept:])
    return "\n".join(out) or "(none)"


# ---------------------------------------------------------------------------- HTTP


@dataclass
class Outcome:
    """What a generation request got back."""

    status: int
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    error: str = ""  # an error body, or an error event inside a stream
    elapsed_s: float = 0.0
    body: Any = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    def __str__(self) -> str:
        what = f"tokens={self.tokens}" if self.ok else f"error={self.error[:300]!r}"
        return f"<{self.status} in {self.elapsed_s:.2f}s {what}>"


def _request(url: str, body: dict[str, Any] | None, headers: dict[str, str] | None) -> urllib.request.Request:
    data = None if body is None else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    return urllib.request.Request(url, data=data, headers=hdrs, method="GET" if body is None else "POST")


def http_get(url: str, timeout: float = 10.0, headers: dict[str, str] | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def http_post(url: str, body: dict[str, Any] | None = None, timeout: float = 30.0,
              headers: dict[str, str] | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(_request(url, body or {}, headers), timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def get_json(url: str, timeout: float = 10.0, headers: dict[str, str] | None = None) -> Any:
    status, text = http_get(url, timeout, headers)
    assert status == 200, f"GET {url}: {status} {text[:500]}"
    return json.loads(text)


def _error_of(doc: Any) -> str:
    if isinstance(doc, dict) and "error" in doc:
        err = doc["error"]
        return json.dumps(err) if not isinstance(err, str) else err
    return ""


def _tokens_of(choice: dict[str, Any]) -> tuple[list[int], str]:
    text = choice.get("text")
    if text is None:
        text = (choice.get("message") or choice.get("delta") or {}).get("content") or ""
    return list(choice.get("token_ids") or ()), text


def generate(base_url: str, req: Req, *, timeout: float = HTTP_TIMEOUT_S, request_id: str | None = None) -> Outcome:
    """Send ``req`` to ``base_url`` and collect the generated token ids, streamed or not.

    Never raises for an HTTP error or a dropped connection: the outcome says what happened.
    """
    headers = {"X-Request-Id": request_id or f"e2e-{req.name}-{uuid.uuid4().hex[:8]}"}
    started = time.monotonic()
    out = Outcome(status=0)
    try:
        with urllib.request.urlopen(_request(base_url + req.path, req.body, headers), timeout=timeout) as r:
            out.status = r.status
            if req.stream:
                _read_stream(r, out)
            else:
                doc = json.load(r)
                out.body = doc
                out.error = _error_of(doc)
                if not out.error:
                    out.tokens, out.text = _tokens_of(doc["choices"][0])
    except urllib.error.HTTPError as exc:
        out.status = exc.code
        raw = exc.read().decode(errors="replace")
        try:
            out.body = json.loads(raw)
            out.error = _error_of(out.body) or raw
        except ValueError:
            out.error = raw or f"HTTP {exc.code} with an empty body"
    except (OSError, ValueError, http.client.HTTPException) as exc:  # refused, reset, timed out, cut short
        out.error = f"{type(exc).__name__}: {exc}"
    out.elapsed_s = time.monotonic() - started
    return out


def _read_stream(response: Any, out: Outcome) -> None:
    done = False
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            done = True
            break
        doc = json.loads(data)
        if err := _error_of(doc):
            out.error = err
            continue
        for choice in doc.get("choices") or ():
            tokens, text = _tokens_of(choice)
            out.tokens += tokens
            out.text += text
    if not done and not out.error:
        out.error = "stream ended without [DONE]"


def generate_all(base_url: str, reqs: Sequence[Req], concurrency: int = 8,
                 timeout: float = HTTP_TIMEOUT_S) -> dict[str, Outcome]:
    with ThreadPoolExecutor(concurrency) as pool:
        outcomes = pool.map(lambda r: generate(base_url, r, timeout=timeout), reqs)
        return {r.name: o for r, o in zip(reqs, outcomes)}


def remote_prefill_params(prefill_daemon_info: dict[str, Any]) -> dict[str, Any]:
    """A decode leg's ``kv_transfer_params`` naming a P daemon, as the proxy builds them."""
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": prefill_daemon_info["engine_id"],
            "remote_host": prefill_daemon_info["side_channel_host"],
            "remote_port": prefill_daemon_info["side_channel_port"], "remote_tp_size": 1}


PREFILL_LEG_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}


def _raw_post(base_url: str, path: str, body: dict[str, Any], request_id: str) -> socket.socket:
    url = urllib.parse.urlsplit(base_url)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    head = (f"POST {path} HTTP/1.1\r\nHost: {url.hostname}:{url.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nX-Request-Id: {request_id}\r\nConnection: close\r\n\r\n")
    sock.sendall(head.encode() + payload)
    return sock


def open_post(base_url: str, req: Req, request_id: str) -> socket.socket:
    """Send ``req`` and return the open connection, unread: closing it is the client leaving."""
    return _raw_post(base_url, req.path, req.body, request_id)


@contextlib.contextmanager
def paused(vllm_url: str) -> Iterator[None]:
    """Freeze the vLLM server's scheduler (queued requests stay queued) for the block.

    ``POST /pause?mode=keep`` and ``/resume`` exist where ``VLLM_SERVER_DEV_MODE=1``.
    """
    status, text = http_post(vllm_url + "/pause?mode=keep")
    assert status == 200, f"pause {vllm_url}: {status} {text}"
    try:
        yield
    finally:
        status, text = http_post(vllm_url + "/resume")
        assert status == 200, f"resume {vllm_url}: {status} {text}"


def stream_and_drop(base_url: str, req: Req, request_id: str, timeout: float = 60.0) -> bytes:
    """Send a streamed ``req``, read until the first SSE event, close the connection; the bytes read."""
    assert req.stream
    sock = _raw_post(base_url, req.path, req.body, request_id)
    got = b""
    deadline = time.monotonic() + timeout
    try:
        while b"data:" not in got or not got.rstrip(b"\r\n ").endswith(b"}"):
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
            if b"\r\n\r\n" in got and not got.startswith(b"HTTP/1.1 200"):
                break
    finally:
        sock.close()
    return got


# ---------------------------------------------------------------------------- metrics and state


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def scrape(base_url: str, headers: dict[str, str] | None = None) -> list[Sample]:
    status, text = http_get(base_url + "/metrics", headers=headers)
    assert status == 200, f"GET {base_url}/metrics: {status}"
    return [Sample(s.name, dict(s.labels), s.value)
            for family in text_string_to_metric_families(text) for s in family.samples]


def metric(samples: Iterable[Sample], name: str, **labels: str) -> float | None:
    """Sum of the samples called ``name`` whose labels include ``labels``; None if there is none."""
    found = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(found) if found else None


def by_label(samples: Iterable[Sample], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in samples:
        if s.name == name and label in s.labels:
            out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
    return out


def kv_usage(vllm_url: str) -> float:
    """The vLLM server's KV cache usage gauge (0..1)."""
    value = metric(scrape(vllm_url), "vllm:kv_cache_usage_perc")
    assert value is not None, f"{vllm_url}/metrics has no vllm:kv_cache_usage_perc (are stats logged?)"
    return value


def prefix_cache_hits(vllm_url: str) -> float:
    value = metric(scrape(vllm_url), "vllm:prefix_cache_hits_total")
    assert value is not None, f"{vllm_url}/metrics has no vllm:prefix_cache_hits_total"
    return value


def verify_results(daemon_url: str) -> dict[str, float] | None:
    """Verify mode's per-push counter by result (identical, mismatch, ...), None if the daemon has none."""
    names = {s.name for s in scrape(daemon_url) if "verify" in s.name and s.name.endswith("_total")
             and "block" not in s.name}
    if not names:
        return None
    assert len(names) == 1, f"several per-push verify counters: {names}"
    return by_label(scrape(daemon_url), names.pop(), "result")


def assert_pushes_identical(daemon_url: str, before: dict[str, float], pushes: int, timeout: float) -> None:
    """D's daemon at ``daemon_url`` (verify mode) has checked ``pushes`` more pushes since
    its counters read ``before`` (``verify_results`` then), and found each byte-identical
    to P's blocks: none mismatched, none short, none more."""
    def since() -> dict[str, float]:
        now = verify_results(daemon_url) or {}
        return {k: v - before.get(k, 0.0) for k, v in now.items() if v != before.get(k, 0.0)}

    checked = wait_for("D daemon's verified pushes", since, lambda d: sum(d.values()) >= pushes, timeout)
    assert checked.get("identical", 0) == pushes == sum(checked.values()), (
        f"verify mode: {checked} for {pushes} pushes")


def tables(daemon_url: str) -> dict[str, int]:
    return get_json(daemon_url + "/v1/info")["tables"]


def wait_for(what: str, probe: Callable[[], T], done: Callable[[T], bool], timeout: float,
             interval: float = 0.25) -> T:
    """Poll ``probe`` until ``done`` says yes; fail with the last value after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: still {value!r} after {timeout:.0f}s")
        time.sleep(interval)


def wait_tables_zero(daemon_urls: dict[str, str], timeout: float) -> None:
    for name, url in daemon_urls.items():
        wait_for(f"{name} daemon tables", lambda u=url: tables(u), lambda t: not any(t.values()), timeout)


def wait_kv_usage(vllm_urls: dict[str, str], at_most: dict[str, float], timeout: float) -> None:
    for name, url in vllm_urls.items():
        wait_for(f"{name} vLLM KV cache usage (baseline {at_most[name]})", lambda u=url: kv_usage(u),
                 lambda v, b=at_most[name]: v <= b + 1e-9, timeout)
