"""Which NIXL module the daemon imports: never all of torch just to find the backend."""

from __future__ import annotations

import subprocess
import sys

from pushsvc.engine.nixl import says_no_cuda

CPU_BUILD = """from typing import Optional

__version__ = '2.13.0+cpu'
debug = False
cuda: Optional[str] = None
git_version = 'cf30153c4c131c8164ee7798e5022d810682e2cb'
hip: Optional[str] = None
"""


def test_cpu_build_says_no_cuda() -> None:
    assert says_no_cuda(CPU_BUILD)
    assert says_no_cuda("cuda = None\n")


def test_cuda_build_or_unknown_text_lets_nixl_decide() -> None:
    assert not says_no_cuda(CPU_BUILD.replace("cuda: Optional[str] = None", "cuda: Optional[str] = '12.8'"))
    assert not says_no_cuda("hip: Optional[str] = None\n")  # hip, not cuda
    assert not says_no_cuda("")


def test_importing_nixl_does_not_import_torch() -> None:
    """With this venv's CPU-only torch, the daemon's NIXL import leaves torch alone (it
    costs seconds of CPU, all before a restarted daemon is ready)."""
    code = ("import sys; from pushsvc.engine.nixl import _import_nixl; agent, _ = _import_nixl(); "
            "print(agent.__module__, 'torch' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    module, torch_imported = run.stdout.split()
    assert module.startswith("nixl") and module.endswith("._api"), module
    assert torch_imported == "False", run.stdout
