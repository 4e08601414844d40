"""Fuzz ``load_config`` on TOML files: whatever the file holds, the only exception that
may leave it is ``ConfigError`` (which the CLI turns into a message naming the field and
exit status 2), and a config it returns passes ``validate()`` again.

A config file is read once, at start-up, before the daemon serves anything, so a refused
file is reported on stderr rather than counted in ``/metrics``.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from typing import Any

import msgspec
import pytest
from fuzzing import _text, batches, examples_for, fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from pushsvc.config import Config, load_config
from pushsvc.errors import ConfigError

# A failing batch of big inputs has a big repr; Hypothesis warns about it, which would
# hide the failure behind the warning.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:Generating overly large repr")]

_FIELDS = {f.name: f.type for f in msgspec.structs.fields(Config)}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string (lone surrogates make it invalid TOML)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(type(v))


_any_value = st.one_of(
    st.booleans(), st.integers(-(2**70), 2**70), st.floats(), _text(0, 40),
    st.lists(st.one_of(st.integers(-5, 2**40), _text(0, 8)), max_size=3),
    st.dictionaries(_text(0, 6), st.integers(), max_size=2),
)


# allowed_peer_hosts entries, valid and nearly so.
_PEER_HOSTS = st.sampled_from(["*", "10.0.0.0/8", "10.0.0.1/8", "10.0.0.0/33", "fd00::/8", "fe80::1%eth0",
                               "::ffff:10.0.0.0/104", "decode-0.example", "*.example", "10.0.0.256", "[::1]"])


def _field_value(typ: Any) -> st.SearchStrategy[Any]:
    """Mostly the right type (with edge values), sometimes anything."""
    right = {
        bool: st.booleans(),
        int: st.one_of(st.integers(-2, 70000), st.integers(-(2**64), 2**64)),
        float: st.one_of(st.floats(-1, 1e6), st.floats()),
        str: st.one_of(_text(0, 40), st.sampled_from(["", "/tmp/x", "/" + "a" * 200, "json", "info", "0.0.0.0",
                                                       "::", "-1", "a\x00b", "UCX", "127.0.0.1", "localhost",
                                                       "::1", "10.0.0.5"])),
    }.get(typ)
    if right is None:  # list[int] or list[str]
        right = st.lists(st.one_of(_text(0, 8), st.integers(-3, 2**40), _PEER_HOSTS), max_size=3)
    return st.one_of(right, right, _any_value)


@st.composite
def _documents(draw: st.DrawFn) -> bytes:
    names = draw(st.lists(st.sampled_from(sorted(_FIELDS)) | _text(1, 12), max_size=6, unique=True))
    lines = [f"{json.dumps(n)} = {_toml_value(draw(_field_value(_FIELDS.get(n, str))))}" for n in names]
    if draw(st.booleans()):
        lines.insert(0, "[pushsvc]")
        if draw(st.booleans()):
            lines.append(f"[{draw(st.sampled_from(['other', 'pushsvc', 'pushsvc.sub']))}]\nx = 1")
    return "\n".join(lines).encode("utf-8", "surrogatepass")


# Just past tomllib's recursion limit (about a thousand levels): deeper costs time, not
# coverage.
_deep = st.sampled_from([b"a = " + b"[" * 1200 + b"]" * 1200, b"a = " + b"{b = " * 1200 + b"1" + b"}" * 1200,
                         b"[pushsvc]\n" + b"health_port = " + b"[" * 1200])


def test_config_loader_fuzz(fuzz_cases: int) -> None:
    counts = {"inputs": 0, "loaded": 0, "refused": 0}
    fd, path = tempfile.mkstemp(prefix="psfuzz", suffix=".toml")
    os.close(fd)

    @fuzz_settings(examples_for(fuzz_cases))
    @given(batch=batches(st.one_of(_documents(), _documents(), st.binary(max_size=64), _deep)))
    def fuzz(batch: list[bytes]) -> None:
        for doc in batch:
            with open(path, "wb") as f:
                f.write(doc)
            try:
                cfg = load_config(path, env={})
            except ConfigError as exc:
                assert exc.message, doc  # the field may be "": a key spelled ""
                counts["refused"] += 1
            else:
                cfg.validate()  # what it returns is valid, and stays so
                assert cfg.resolve({}) == cfg, doc
                counts["loaded"] += 1
        counts["inputs"] += len(batch)

    start = time.perf_counter()
    try:
        fuzz()
    finally:
        os.unlink(path)
    print(f"\nconfig fuzz: {counts} in {time.perf_counter() - start:.1f}s")
    assert counts["inputs"] >= fuzz_cases
    assert counts["loaded"] > 0 and counts["refused"] > 0
