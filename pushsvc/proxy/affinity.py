"""Prefix affinity: send a prompt to the P whose prefix cache likely holds its start (pure).

vLLM's prefix cache keeps the KV of the prompts a P computed, by blocks of tokens, so a P
that computed a prompt starting the same way computes only the rest. The proxy sees text,
not tokens: ``prefix_keys`` hashes a prompt's leading text at every ``CHUNK`` bytes (at
most ``MAX_CHUNKS``), so two prompts sharing their first kilobytes share their first
keys, and a prompt shorter than one chunk has none (there is nothing worth keeping a P
busy for). ``PrefixMap`` remembers, per key, the P that last took a prompt starting so
(bounded, least recently used first out) and ``lookup`` answers the P of the longest
prefix it knows. Load still decides first: ``BackendPool.pick`` takes the preferred P
only while it has at most ``slack`` more requests outstanding than the least busy healthy
one, so a popular prefix cannot pile every request onto one P.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Generic, TypeVar

from pushsvc.proxy.legs import CHAT

CHUNK = 512  # bytes of prompt text per key: a few vLLM blocks of English text
MAX_CHUNKS = 64  # keys per prompt: its first 32 KiB decide
MAX_ENTRIES = 1 << 16

B = TypeVar("B")


def prompt_text(endpoint: str, body: dict[str, Any]) -> bytes:
    """The part of a request body that becomes the prompt's leading tokens, as bytes: the
    completion prompt (the first of a list; token ids as their numbers), or the chat
    messages' roles and text in order. Whatever it cannot read counts as no prompt."""
    if endpoint == CHAT:
        parts: list[str] = []
        for message in body.get("messages") or ():
            if not isinstance(message, dict):
                break
            content = message.get("content")
            if isinstance(content, list):  # content parts: the text ones
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict)
                                  and isinstance(p.get("text"), str))
            parts.append(f"{message.get('role', '')}\n{content if isinstance(content, str) else ''}\n")
        return "".join(parts).encode("utf-8", "replace")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, str):
        return prompt.encode("utf-8", "replace")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return b",".join(str(t).encode() for t in prompt)
    return b""


def prefix_keys(text: bytes) -> list[bytes]:
    """A key per whole ``CHUNK`` of ``text``'s start: key ``i`` hashes its first ``(i+1) * CHUNK`` bytes."""
    keys = []
    h = hashlib.blake2b(digest_size=8)
    for i in range(min(len(text) // CHUNK, MAX_CHUNKS)):
        h.update(text[i * CHUNK:(i + 1) * CHUNK])
        keys.append(h.copy().digest())
    return keys


class PrefixMap(Generic[B]):
    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self._max = max_entries
        self._owner: OrderedDict[bytes, B] = OrderedDict()

    def lookup(self, keys: list[bytes]) -> B | None:
        """The backend that last took the longest of these prefixes, or None."""
        for key in reversed(keys):
            owner = self._owner.get(key)
            if owner is not None:
                return owner
        return None

    def remember(self, keys: list[bytes], backend: B) -> None:
        """``backend`` now holds every prefix in ``keys`` (it takes this prompt)."""
        for key in keys:
            self._owner[key] = backend
            self._owner.move_to_end(key)
        while len(self._owner) > self._max:
            self._owner.popitem(last=False)

    def forget(self, backend: B) -> None:
        """``backend`` lost its cache (restarted, or taken out)."""
        for key in [k for k, b in self._owner.items() if b is backend]:
            del self._owner[key]

    def __len__(self) -> int:
        return len(self._owner)
