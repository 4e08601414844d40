"""Client load and process accounting for the fault tests on real vLLM.

``Load`` keeps requests flowing through the proxy from a few threads and records every
outcome with its start time; ``group_fd_kinds`` counts the open files of a process group,
by kind (a vLLM server is its API process plus the engine core it forks).
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Self

from helpers import Outcome, Req, generate


@dataclass(frozen=True)
class Sent:
    """One request of a load run: what, when (monotonic, at the send) and what came back."""

    req: Req
    started: float
    outcome: Outcome


def kind(out: Outcome) -> str:
    """ok; a clean error (an HTTP 5xx or 4xx with an error body, or an error event in a
    stream); or unclean (no status: refused, reset, timed out)."""
    if out.ok:
        return "ok"
    if out.status >= 400 and out.error:
        return f"error-{out.status}"
    if out.status == 200 and out.error:
        return "error-in-stream"
    return "unclean"


class Load:
    """``concurrency`` threads sending ``reqs`` (in random order) to ``url`` until stopped.

    A thread whose request failed waits ``backoff_s`` before the next, as clients do: while
    a daemon is down the proxy fails requests in a millisecond, and without a pause four
    threads send thousands a second, starving the restarting daemon of CPU on a small host.
    """

    def __init__(self, url: str, reqs: Sequence[Req], concurrency: int, timeout_s: float, seed: int = 0,
                 backoff_s: float = 0.5) -> None:
        self.url, self.reqs, self.timeout_s, self.backoff_s = url, list(reqs), timeout_s, backoff_s
        self.sent: list[Sent] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._threads = [threading.Thread(target=self._run, name=f"load-{i}", daemon=True)
                         for i in range(concurrency)]

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                req = self._rng.choice(self.reqs)
            started = time.monotonic()
            out = generate(self.url, req, timeout=self.timeout_s)
            with self._lock:
                self.sent.append(Sent(req, started, out))
            if not out.ok:
                self._stop.wait(self.backoff_s)

    def __enter__(self) -> Self:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> list[Sent]:
        """Stop sending; wait for the requests in flight (each ends by its timeout at worst)."""
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 30)
        assert not any(t.is_alive() for t in self._threads), "a load thread outlived its request timeout"
        return self.sent

    def count(self) -> int:
        with self._lock:
            return len(self.sent)

    def outcomes(self, since: float = 0.0) -> Counter[str]:
        """Outcomes of the requests sent at ``since`` or later."""
        with self._lock:
            return Counter(kind(s.outcome) for s in self.sent if s.started >= since)


def group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: fields count from the last ')'.
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def _tcp_inodes() -> set[str]:
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                inodes.update(line.split()[9] for line in f)
        except OSError:
            pass
    return inodes


def group_fd_kinds(pgid: int) -> Counter:
    """The descriptors of the group ``pgid`` by what they are open on: ``tcp``, ``socket``
    (Unix and others), ``pipe``, ``anon_inode``, ``memfd``, device and plain files."""
    tcp = _tcp_inodes()
    kinds: Counter = Counter()
    for pid in group_pids(pgid):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                kinds["tcp" if target[8:-1] in tcp else "socket"] += 1
            elif target.startswith("/memfd:"):
                kinds["memfd"] += 1
            elif ":[" in target or target.startswith("anon_inode:"):
                kinds[target.split(":")[0]] += 1
            else:
                kinds["device" if target.startswith("/dev/") else "file"] += 1
    return kinds
