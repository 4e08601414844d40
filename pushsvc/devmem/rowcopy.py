"""One kernel that copies rows: ``dst[dst_rows[i]] = src[src_rows[i]]`` for every ``i``,
each row read and written once (the D-side landing copy, docs/gpu.md).

With Triton installed (every CUDA build of vLLM brings it) that is a small Triton kernel,
compiled and checked against torch when a device is first used. Without it, torch's
``index_select`` into a temporary and ``index_copy_`` out of it: the same result, with
the bytes passed twice.
"""

from __future__ import annotations

from typing import Any, Callable

import structlog

log = structlog.get_logger("pushsvc.devmem")

RowCopy = Callable[[Any, Any, Any, Any], None]  # (src, src_rows, dst, dst_rows)

_BLOCK = 1024  # elements of a row one program copies


def _torch_copy(src: Any, src_rows: Any, dst: Any, dst_rows: Any) -> None:
    dst.index_copy_(0, dst_rows, src.index_select(0, src_rows))


def _triton_copy() -> RowCopy | None:
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def rows_kernel(src, dst, src_rows, dst_rows, row_len, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        chunk = tl.program_id(1)
        s = tl.load(src_rows + i).to(tl.int64)
        d = tl.load(dst_rows + i).to(tl.int64)
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_len
        tl.store(dst + d * row_len + offs, tl.load(src + s * row_len + offs, mask=mask), mask=mask)

    def copy(src: Any, src_rows: Any, dst: Any, dst_rows: Any) -> None:
        n = src_rows.numel()
        if n:
            row_len = src.shape[1]
            rows_kernel[(n, triton.cdiv(row_len, _BLOCK))](src, dst, src_rows, dst_rows, row_len, BLOCK=_BLOCK)

    return copy


def row_copier(torch: Any, device: Any) -> RowCopy:
    """The fastest row copy that checks out on ``device``."""
    copy = _triton_copy()
    if copy is not None:
        try:
            src = torch.arange(64 * 300, dtype=torch.int64, device=device).view(64, 300)
            dst = torch.zeros(80, 300, dtype=torch.int64, device=device)
            src_rows = torch.tensor([5, 0, 63, 7], dtype=torch.int64, device=device)
            dst_rows = torch.tensor([79, 3, 0, 40], dtype=torch.int64, device=device)
            copy(src, src_rows, dst, dst_rows)
            expected = torch.zeros_like(dst)
            _torch_copy(src, src_rows, expected, dst_rows)
            if torch.equal(dst, expected):
                log.info("row_copy", kernel="triton")
                return copy
            log.warning("row_copy", kernel="torch", reason="the Triton kernel copied wrong bytes")
        except Exception as exc:  # a Triton that cannot build for this device
            log.warning("row_copy", kernel="torch", reason=f"Triton failed: {str(exc)[:300]}")
    return _torch_copy
