"""The demo's prompts: deterministic, mixed lengths from a few words to several hundred.

Text comes from the generator the tiny model's tokenizer was trained on, so the
tokens-per-word ratio is realistic for that tokenizer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pushsvc.tinymodel import _corpus

SHORTEST_WORDS = 8
LONGEST_WORDS = 600
_SEED = 20261


@dataclass(frozen=True)
class Prompt:
    request_id: str
    text: str

    @property
    def words(self) -> int:
        return len(self.text.split())


def word_counts(n: int) -> list[int]:
    """``n`` lengths spread geometrically from SHORTEST_WORDS to LONGEST_WORDS, shuffled
    (seeded) so that short and long prompts are in flight together."""
    if n <= 1:
        return [SHORTEST_WORDS] * n
    ratio = LONGEST_WORDS / SHORTEST_WORDS
    counts = [round(SHORTEST_WORDS * ratio ** (i / (n - 1))) for i in range(n)]
    random.Random(_SEED).shuffle(counts)
    return counts


def make_prompts(n: int, prefix: str = "demo") -> list[Prompt]:
    sentences = _corpus(_SEED, n_sentences=4000)
    rng = random.Random(_SEED)
    prompts = []
    for i, count in enumerate(word_counts(n)):
        words: list[str] = []
        while len(words) < count:
            words += rng.choice(sentences).split()
        prompts.append(Prompt(f"{prefix}-{i:02d}", " ".join(words[:count])))
    return prompts
