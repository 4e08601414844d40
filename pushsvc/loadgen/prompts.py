"""Deterministic prompt sets: mixed lengths from a few words to several hundred, and long
prompts of a given token count.

Text comes from the generator the tiny model's tokenizer was trained on, so the
tokens-per-word ratio is realistic for that tokenizer. Every set is seeded: the same call
gives the same prompts, so runs compare prompt for prompt.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pushsvc.tinymodel import _corpus

SHORTEST_WORDS = 8
LONGEST_WORDS = 600
_SEED = 20261


class Encoding(Protocol):
    @property
    def ids(self) -> list[int]: ...


class Tokenizer(Protocol):
    """What the prompt sets need of a tokenizer; ``tokenizers.Tokenizer`` is one."""

    def encode(self, text: str) -> Encoding: ...


def count_tokens(tokenizer: Tokenizer, text: str) -> int:
    """Prompt tokens as vLLM counts them (the tiny tokenizer's post-processor adds the BOS)."""
    return len(tokenizer.encode(text).ids)


@dataclass(frozen=True)
class Prompt:
    request_id: str
    text: str
    tokens: int | None = None  # count_tokens(); None where the set was made without a tokenizer

    @property
    def words(self) -> int:
        return len(self.text.split())


def word_counts(n: int, shortest: int = SHORTEST_WORDS, longest: int = LONGEST_WORDS) -> list[int]:
    """``n`` lengths spread geometrically from ``shortest`` to ``longest`` words, shuffled
    (seeded) so that short and long prompts are in flight together."""
    ratio = longest / shortest
    counts = [round(shortest * ratio ** (i / max(1, n - 1))) for i in range(n)]
    random.Random(_SEED).shuffle(counts)
    return counts


def mixed_prompts(n: int, *, shortest: int = SHORTEST_WORDS, longest: int = LONGEST_WORDS, prefix: str = "mixed",
                  tokenizer: Tokenizer | None = None) -> list[Prompt]:
    """``n`` prompts of ``word_counts`` words each; with a ``tokenizer``, their token counts too."""
    sentences, rng = _sentences(), random.Random(_SEED)
    out = []
    for i, count in enumerate(word_counts(n, shortest, longest)):
        words = _draw_words(sentences, rng, lambda ws: len(ws) >= count)
        text = " ".join(words[:count])
        out.append(Prompt(f"{prefix}-{i:02d}", text, None if tokenizer is None else count_tokens(tokenizer, text)))
    return out


def long_prompts(tokenizer: Tokenizer, n: int = 8, lo: int = 1000, hi: int = 1500,
                 prefix: str = "long") -> list[Prompt]:
    """``n`` prompts of ``lo``..``hi`` tokens (evenly spaced, shuffled)."""
    targets = [round(lo + (hi - lo) * i / max(1, n - 1)) for i in range(n)]
    random.Random(_SEED + 1).shuffle(targets)
    sentences, rng = _sentences(), random.Random(_SEED + 1)
    out = []
    for i, target in enumerate(targets):
        words = _draw_words(sentences, rng, lambda ws: count_tokens(tokenizer, " ".join(ws)) >= target)
        # Trim word by word to the last prefix that still reaches the target.
        while len(words) > 1 and count_tokens(tokenizer, " ".join(words[:-1])) >= target:
            words.pop()
        text = " ".join(words)
        out.append(Prompt(f"{prefix}-{i:02d}", text, count_tokens(tokenizer, text)))
    return out


def _sentences() -> list[str]:
    return _corpus(_SEED, n_sentences=4000)


def _draw_words(sentences: Sequence[str], rng: random.Random, enough: Callable[[list[str]], bool]) -> list[str]:
    """Whole random sentences, split into words, until ``enough(words)``."""
    words: list[str] = []
    while not enough(words):
        words += rng.choice(sentences).split()
    return words
