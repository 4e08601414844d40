"""Hypothesis strategies for the decoder fuzz tests (``test_fuzz_*.py``).

Inputs come in three kinds, mixed in every test:

* raw random bytes;
* valid msgpack of random structures (maps, arrays, scalars, bytes);
* messages built from the protocol's own ``msgspec.Struct`` types (``st.builds`` with
  every field drawn within the bounds msgspec enforces, read from ``msgspec.inspect``),
  then, often, mutated: a field dropped, replaced by a random value or added; deep
  nesting injected; the encoding truncated, bit-flipped or spliced.

Sizes are kept small on purpose: a case must cost microseconds so that 10^5 of them per
decoder fit in a CI run; the bounds that matter (lengths, ranges) are reached through
the integer and length edges Hypothesis favours, not through big inputs.
"""

from __future__ import annotations

import asyncio
import random
import re
import typing
from typing import Any

import msgspec
import msgspec.inspect as mi
from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st

_MAX_LIST = 2  # items per generated list: enough to reach loops, cheap to encode
_MAX_TEXT = 12
_INT_EDGE = 2**64 + 1  # beyond msgpack's integer range on purpose


def fuzz_settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        # Big, slow, filtered inputs are the point of a fuzzer, not a smell.
        suppress_health_check=list(HealthCheck),
        # Shrinking a failure is welcome; an explanation phase doubles the run.
        phases=[p for p in settings.default.phases if p.name != "explain"],
    )


# ---------------------------------------------------------------- values within bounds


def _ints(t: mi.IntType) -> st.SearchStrategy[int]:
    lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else -_INT_EDGE)
    hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else _INT_EDGE)
    return st.integers(lo, hi)


def _floats(t: mi.FloatType) -> st.SearchStrategy[float]:
    lo = t.ge if t.ge is not None else t.gt
    hi = t.le if t.le is not None else t.lt
    return st.floats(lo, hi, exclude_min=t.gt is not None, exclude_max=t.lt is not None, allow_nan=False)


def _text(min_size: int, max_size: int) -> st.SearchStrategy[str]:
    # Latin-1 from random bytes: a tenth of the cost of ``st.text`` and still multi-byte
    # in UTF-8 above 0x7f, which is what length caps in bytes versus characters need.
    return st.binary(min_size=min_size, max_size=max_size).map(lambda b: b.decode("latin-1"))


_ALTERNATIVES = re.compile(r"\^\(([\w|]+)\)\$")


def _strings(t: mi.StrType) -> st.SearchStrategy[str]:
    if t.pattern is not None:
        alternatives = _ALTERNATIVES.fullmatch(t.pattern)
        if alternatives:  # "^(DRAM|VRAM)$": from_regex is slow for what is an enum
            return st.sampled_from(alternatives.group(1).split("|"))
        return st.from_regex(t.pattern, fullmatch=True)
    lo = t.min_length or 0
    hi = min(t.max_length if t.max_length is not None else _MAX_TEXT, max(lo, _MAX_TEXT))
    if not t.max_length:
        return _text(lo, hi)
    # Sometimes exactly at the cap, in one-, two- and four-byte characters: the edge the
    # decoder must accept.
    n = t.max_length
    return st.one_of(_text(lo, hi), st.sampled_from(["a" * n, "\u00e9" * n, "\U0001f600" * n]))


def valid_value(t: mi.Type) -> st.SearchStrategy[Any]:
    """Values of ``t`` that msgspec's decoder accepts (struct instances for structs)."""
    if isinstance(t, mi.IntType):
        return _ints(t)
    if isinstance(t, mi.FloatType):
        return _floats(t)
    if isinstance(t, mi.StrType):
        return _strings(t)
    if isinstance(t, mi.BytesType):
        lo = t.min_length or 0
        return st.binary(min_size=lo, max_size=max(lo, 16))
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, mi.ListType):
        lo = t.min_length or 0
        hi = min(t.max_length if t.max_length is not None else _MAX_LIST, max(lo, _MAX_LIST))
        return st.lists(valid_value(t.item_type), min_size=lo, max_size=hi)
    if isinstance(t, mi.UnionType):
        return st.one_of(*(valid_value(u) for u in t.types))
    if isinstance(t, mi.StructType):
        return structs(t.cls)
    raise TypeError(f"no strategy for {t!r}")


def structs(cls: type[msgspec.Struct]) -> st.SearchStrategy[msgspec.Struct]:
    """``st.builds`` on a Struct, each field within its declared bounds; fields with a
    default are sometimes left out (so the default path is exercised). Values its
    ``__post_init__`` refuses across fields (a region whose blocks overlap) are skipped:
    the decoder refuses them too, which the mutated messages exercise."""
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    required = {f.name: valid_value(f.type) for f in info.fields if f.required}
    optional = {f.name: valid_value(f.type) for f in info.fields if not f.required}
    return st.fixed_dictionaries(required, optional=optional).map(lambda kw: _built(cls, kw))


def _built(cls: type[msgspec.Struct], kw: dict[str, Any]) -> msgspec.Struct:
    try:
        return cls(**kw)
    except ValueError:
        assume(False)
        raise


def message_types(union: Any) -> list[type[msgspec.Struct]]:
    """The Struct classes of a tagged union (or the one class)."""
    return list(typing.get_args(union)) or [union]


def messages(union: Any) -> st.SearchStrategy[msgspec.Struct]:
    return st.one_of(*(structs(cls) for cls in message_types(union)))


# ---------------------------------------------------------------- hostile inputs

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), _text(0, _MAX_TEXT),
    st.binary(max_size=16),
)
# Two levels of containers, built without ``st.recursive`` (several times slower); the
# deep shapes come from ``deep`` and the byte mutator instead.
_containers = st.one_of(
    st.lists(_scalars, max_size=_MAX_LIST),
    st.dictionaries(st.one_of(_text(0, 8), st.integers(-5, 5)), _scalars, max_size=_MAX_LIST),
)
random_values = st.one_of(
    _scalars,
    _containers,
    st.lists(_containers, max_size=_MAX_LIST),
    st.dictionaries(_text(0, 8), _containers, max_size=_MAX_LIST),
)


def deep(depth: int, kind: str) -> bytes:
    """``depth`` nested msgpack arrays or maps around a 1 (already encoded)."""
    return (b"\x91" if kind == "array" else b"\x81\xa1k") * depth + b"\x01"


def _mutate_fields(draw: st.DrawFn, fields: dict[str, Any]) -> dict[str, Any]:
    keys = sorted(fields)
    op = draw(st.sampled_from(["drop", "replace", "add", "retag"] if keys else ["add"]))
    if op == "drop":
        del fields[draw(st.sampled_from(keys))]
    elif op == "replace":
        fields[draw(st.sampled_from(keys))] = draw(random_values)
    elif op == "add":
        fields[draw(_text(0, 12))] = draw(random_values)
    else:
        fields["t"] = draw(_text(0, 12))
    return fields


@st.composite
def _mutated_structure(draw: st.DrawFn, union: Any) -> bytes:
    fields = msgspec.to_builtins(draw(messages(union)))
    if draw(st.booleans()):
        fields = _mutate_fields(draw, fields)
    else:
        # Deep nesting where a field's value should be, or in an unknown field placed
        # before the tag, which makes msgspec skip (and so walk) it.
        nest = msgspec.Raw(deep(draw(st.sampled_from([10, 1000, 100_000])), draw(st.sampled_from(["array", "map"]))))
        key = draw(st.sampled_from(sorted(fields) + ["zz_unknown"]))
        fields = {key: nest, **{k: v for k, v in fields.items() if k != key}}
    return msgspec.msgpack.encode(fields)


# Cheap byte-level mutations, applied by a seeded PRNG to each Hypothesis example: one
# example yields ``PER_EXAMPLE`` decoder inputs, so Hypothesis' per-example overhead
# (about a millisecond here) is paid once per batch, not once per input.
PER_EXAMPLE = 50

_INTERESTING_BYTES = bytes([0x00, 0x01, 0x7F, 0x80, 0x90, 0xA0, 0xC0, 0xC1, 0xC2, 0xC4, 0xCF, 0xD3, 0xD9, 0xDB,
                            0xDC, 0xDD, 0xDE, 0xDF, 0xFF])
# Headers that announce far more than follows (lying lengths inside msgpack), the reserved
# byte, extreme integers, a deep nest.
_INTERESTING_CHUNKS = (
    b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff",
    b"\xc7\xff\x01", b"\xc1", b"\xcf" + b"\xff" * 8, b"\xd3\x80" + b"\x00" * 7, b"\xcb\x7f\xf8" + b"\x00" * 6,
    b"\x91" * 2000,
)


def _mutate(data: bytearray, rng: random.Random) -> None:
    i = rng.randrange(len(data) + 1)
    op = rng.randrange(7)
    if op == 0 and i < len(data):
        data[i] ^= 1 << rng.randrange(8)
    elif op == 1 and i < len(data):
        data[i] = rng.choice(_INTERESTING_BYTES)
    elif op == 2:
        del data[i:]
    elif op == 3:
        data[i:i] = rng.randbytes(rng.randint(1, 8))
    elif op == 4:
        data[i:i] = rng.choice(_INTERESTING_CHUNKS)
    elif op == 5:
        del data[i : i + rng.randint(1, 8)]
    else:
        j = rng.randrange(len(data) + 1)
        data[i:i] = data[min(i, j) : max(i, j)][:64]


def expand(seeds: list[bytes], rng_seed: int, count: int = PER_EXAMPLE) -> list[bytes]:
    """The ``seeds`` themselves, then mutants of them (one to three mutations each) up to
    ``count`` inputs."""
    rng = random.Random(rng_seed)
    out = list(seeds[:count])
    while len(out) < count:
        data = bytearray(seeds[len(out) % len(seeds)])
        for _ in range(rng.randint(1, 3)):
            _mutate(data, rng)
        out.append(bytes(data))
    return out


def seeds(union: Any) -> st.SearchStrategy[bytes]:
    """One input of every kind for a decoder of ``union``: valid, near-valid, garbage."""
    return st.one_of(
        st.binary(max_size=64),
        random_values.map(msgspec.msgpack.encode),
        messages(union).map(msgspec.msgpack.encode),
        _mutated_structure(union),
    )


def batches(seed_strategy: st.SearchStrategy[bytes], count: int = PER_EXAMPLE) -> st.SearchStrategy[list[bytes]]:
    """``count`` decoder inputs per Hypothesis example: up to five seeds (so that a tenth
    of the inputs are unmutated) and their mutants."""
    return st.builds(expand, st.lists(seed_strategy, min_size=1, max_size=5), st.integers(0, 2**32 - 1),
                     st.just(count))


def examples_for(cases: int, count: int = PER_EXAMPLE) -> int:
    """Hypothesis examples needed for at least ``cases`` decoder inputs."""
    return max(1, -(-cases // count))


class Driven:
    """An async context manager (an in-process daemon, a P/D pair) entered on a private
    event loop that a synchronous test drives one ``run`` at a time, so Hypothesis
    generates its examples while no loop is running."""

    def __init__(self, cm: Any, timeout_s: float = 120.0) -> None:
        self.loop = asyncio.new_event_loop()
        self._cm = cm
        self._timeout = timeout_s
        try:
            self.value = self.run(cm.__aenter__())
        except BaseException:
            self.loop.close()
            raise

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, self._timeout))

    def close(self) -> None:
        try:
            self.run(self._cm.__aexit__(None, None, None))
        finally:
            self.loop.close()
