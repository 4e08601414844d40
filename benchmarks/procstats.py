"""CPU time of a stack's processes, summed over whole process trees.

A vLLM server is three kinds of process: the API server (the one we start), its
``VLLM::EngineCore`` child and that child's worker (a process or threads, depending on
the executor). Daemons and proxies are single processes. ``CpuMeter`` snapshots
user+system time of every process under the given roots (threads included, since psutil
reports per-process totals) and reports deltas between snapshots, by process and by role.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class Snapshot:
    # pid -> (label, cpu seconds so far)
    cpu: dict[int, tuple[str, float]]


def _cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


class CpuMeter:
    """CPU seconds used by the process trees under ``roots`` ({label: pid})."""

    def __init__(self, roots: dict[str, int]) -> None:
        self.roots = dict(roots)

    def _walk(self) -> dict[int, tuple[str, psutil.Process]]:
        found: dict[int, tuple[str, psutil.Process]] = {}
        for label, pid in self.roots.items():
            try:
                root = psutil.Process(pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for p in procs:
                try:
                    # vLLM names its processes with setproctitle (VLLM::EngineCore, VLLM::Worker...)
                    name = p.name() if p.pid != pid else "root"
                except psutil.Error:
                    continue
                found[p.pid] = (f"{label}/{name}", p)
        return found

    def snapshot(self) -> Snapshot:
        out: dict[int, tuple[str, float]] = {}
        for pid, (label, p) in self._walk().items():
            try:
                out[pid] = (label, _cpu(p))
            except psutil.Error:
                pass
        return Snapshot(out)

    @staticmethod
    def delta(before: Snapshot, after: Snapshot) -> dict[str, float]:
        """CPU seconds by process label between two snapshots (processes that started in
        between count from 0; ones that ended in between are lost, which does not happen
        in a stack that stays up)."""
        used: dict[str, float] = {}
        for pid, (label, cpu) in after.cpu.items():
            start = before.cpu.get(pid, (label, 0.0))[1]
            used[label] = used.get(label, 0.0) + max(0.0, cpu - start)
        return used


def total(used: dict[str, float]) -> float:
    return sum(used.values())
