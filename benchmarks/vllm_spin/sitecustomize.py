"""Shorten how long vLLM's workers spin for the next step, in every Python process that
has this folder on PYTHONPATH, when ``BENCH_VLLM_SPIN_S`` is set (seconds).

vLLM's multiprocess executor hands each step to its workers through a shared-memory
queue whose reader, after every read, polls the queue with ``sched_yield`` for
``busy_loop_s`` (1 s, ``SpinCondition`` in ``shm_broadcast.py``) before it sleeps on a
socket. vLLM offers no knob for it. On a host with fewer cores than busy processes the
spinning workers take the cores the other processes need (``latency.py
--vllm-spin-ms``). A diagnostic: vLLM's idle wake-up can then be late (seconds, seen at
1 ms), so figures with it say what the spin costs, not how to run vLLM.
"""

import importlib.abc
import importlib.machinery
import os
import sys

_MODULE = "vllm.distributed.device_communicators.shm_broadcast"


class _PatchSpin(importlib.abc.MetaPathFinder):
    """Patches ``SpinCondition`` right after its module is first imported (vLLM is not
    imported here: most processes that inherit this path never use it)."""

    def __init__(self, spin_s: float) -> None:
        self.spin_s = spin_s

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 - importlib's signature
        if name != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        load, spin_s = spec.loader.exec_module, self.spin_s

        def exec_module(module):  # noqa: ANN001, ANN202
            load(module)
            init = module.SpinCondition.__init__

            def __init__(self, is_reader, context, notify_address, busy_loop_s=1):  # noqa: ANN001, N807
                init(self, is_reader, context, notify_address, spin_s)

            module.SpinCondition.__init__ = __init__

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("BENCH_VLLM_SPIN_S"):
    sys.meta_path.insert(0, _PatchSpin(float(os.environ["BENCH_VLLM_SPIN_S"])))
