"""Request-id normalisation shared by P and D matching."""

from __future__ import annotations

_HEX = frozenset("0123456789abcdef")


def base_request_id(request_id: str) -> str:
    """Strip the per-engine random suffix vLLM appends to a request id.

    The proxy gives both legs one ``X-Request-Id``; each engine turns it into
    ``cmpl-<uuid>-<index>-<8 hex>``. Dropping just the last ``-<8 hex>`` makes P's and D's
    ids equal again while keeping the completion index, so sub-requests stay distinct.
    An id without such a suffix is its own base.
    """
    head, sep, tail = request_id.rpartition("-")
    if sep and head and len(tail) == 8 and _HEX.issuperset(tail):
        return head
    return request_id
