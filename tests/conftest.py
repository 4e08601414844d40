"""Options shared by every test directory (registered here so that a plain ``pytest``
from the repository root knows them)."""

from __future__ import annotations

import pytest

FUZZ_CASES = 100_000


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fuzz-examples", type=int, default=FUZZ_CASES, metavar="N",
        help=f"decoder inputs per fuzzed decoder in tests/unit/test_fuzz_*.py (default {FUZZ_CASES})",
    )
