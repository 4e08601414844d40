"""The landing copy kernel's PTX assembles for the GPUs we support (its behaviour is
checked on a GPU: tests/gpu/test_copy_kernel.py, and by every daemon at start)."""

from __future__ import annotations

import glob
import shutil
import subprocess

import pytest

from pushsvc.devmem.kernel import WIDTHS, kernel_name, ptx


def _ptxas() -> str | None:
    return shutil.which("ptxas") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/ptxas"))), None)


def test_the_module_has_one_entry_per_width() -> None:
    text = ptx()
    for w in WIDTHS:
        assert text.count(f".entry {kernel_name(w)}(") == 1


@pytest.mark.skipif(_ptxas() is None, reason="no ptxas (CUDA toolkit) on this host")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_ptx_assembles(tmp_path, arch) -> None:
    src = tmp_path / "copy.ptx"
    src.write_text(ptx())
    out = subprocess.run([_ptxas(), f"-arch={arch}", "-v", str(src), "-o", str(tmp_path / "copy.cubin")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "spill" in out.stderr and " 0 bytes spill stores" in out.stderr
