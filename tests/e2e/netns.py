"""Hosts on one machine: network namespaces joined by a bridge, for the multi-host tests.

``Hosts`` builds, per host, a network namespace with one veth leg on a bridge in the
root namespace (10.77.<n>.0/24; the root namespace, where the tests run, is .254), and
starts processes in it in an IPC namespace of their own as well (``unshare --ipc``), so
UCX finds no shared memory between "hosts" and goes over TCP, as between real hosts.
Everything it made is removed on exit, whatever the exit; names carry the pid of the
test process, and names a crashed earlier run left behind are removed first.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

PREFIX = "psh"  # every namespace, link and bridge made here starts with it


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    ip: str

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run on this host: in its network namespace and an IPC namespace of its
        own (``ip netns exec`` and ``unshare`` both exec, so the pid and the process group
        stay those of the command)."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--ipc", "--", *argv]

    def kill_all(self) -> list[int]:
        """SIGKILL every process of the host, as when its power goes: the pids killed."""
        out = _ip("netns", "pids", self.netns, check=False).stdout.split()
        pids = [int(p) for p in out if p.isdigit()]
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        return pids


class Hosts:
    def __init__(self, names: list[str], subnet: int = 77) -> None:
        self.tag = f"{os.getpid() % 100000}"
        self.bridge = f"{PREFIX}br{self.tag}"
        self.subnet = subnet
        self.hosts = {name: Host(name, f"{PREFIX}-{self.tag}-{name}", f"10.{subnet}.0.{i + 1}")
                      for i, name in enumerate(names)}
        self.gateway = f"10.{subnet}.0.254"
        self.network = f"10.{subnet}.0.0/24"

    def __enter__(self) -> Hosts:
        self.remove_leftovers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, host in enumerate(self.hosts.values()):
            outer, inner = f"{PREFIX}{self.tag}v{i}", f"{PREFIX}{self.tag}i{i}"
            _ip("netns", "add", host.netns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("link", "set", inner, "netns", host.netns)
            run = ("-n", host.netns)
            _ip(*run, "addr", "add", f"{host.ip}/24", "dev", inner)
            _ip(*run, "link", "set", inner, "up")
            _ip(*run, "link", "set", "lo", "up")
            _ip(*run, "route", "add", "default", "via", self.gateway)

    def close(self) -> None:
        for host in self.hosts.values():
            host.kill_all()
            _ip("netns", "del", host.netns, check=False)  # takes its veth leg, and so the pair
        _ip("link", "del", self.bridge, check=False)

    @staticmethod
    def remove_leftovers() -> None:
        """Namespaces and bridges of earlier runs whose test process is gone."""
        alive = {str(p % 100000) for p in map(int, filter(str.isdigit, os.listdir("/proc")))}
        for line in _ip("netns", "list", check=False).stdout.splitlines():
            m = re.match(rf"({PREFIX}-(\d+)-\S+)", line)
            if m and m.group(2) not in alive:
                Host("", m.group(1), "").kill_all()
                _ip("netns", "del", m.group(1), check=False)
        for line in _ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
            m = re.match(rf"\d+: ({PREFIX}br(\d+))[:@]", line)
            if m and m.group(2) not in alive:
                _ip("link", "del", m.group(1), check=False)
