"""Prompt text for a trace's requests: equal prefix blocks become equal text.

A trace describes a prompt as a chain of block ids of `block_size` tokens (the last block usually
partial). Each block id becomes `block_size` words derived from the id alone, one word per token
for the emulator's tokenizer (`sandbox.emulator.tokens`), so two prompts share text exactly as
far as they share blocks, and a prompt has exactly the trace's input length in tokens.

Words are three characters and a space, about what a real tokenizer's token spans in English
text, so that a router estimating tokens from bytes (4 characters per token) counts what the
emulator counts. They come from a hash of (block id, position): two different blocks sharing
every word of a 16-token emulator block would take a collision of 48 random characters.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache

_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"
_WORDS = len(_ALPHABET) ** 3


def _words(seed: bytes, count: int) -> str:
    digest = hashlib.shake_128(seed).digest(2 * count)
    out = []
    for j in range(count):
        v = (digest[2 * j] << 8 | digest[2 * j + 1]) % _WORDS
        out.append(_ALPHABET[v // 1296] + _ALPHABET[v // 36 % 36] + _ALPHABET[v % 36])
    return " ".join(out)


@lru_cache(maxsize=8192)
def block_text(block_id: int, words: int) -> str:
    """`words` tokens of text standing for block `block_id` (its first `words` tokens)."""
    return _words(b"b%d" % (block_id & 0xFFFFFFFFFFFFFFFF), words)


def prompt_parts(blocks: Sequence[int], input_tokens: int, block_size: int, *, salt: int = 0) -> list[str]:
    """The text of each block of a prompt of `input_tokens` tokens; filler beyond the blocks,
    unique to `salt`, is one more part."""
    parts: list[str] = []
    left = input_tokens
    for block in blocks:
        if left <= 0:
            break
        take = min(block_size, left)
        parts.append(block_text(int(block), take))
        left -= take
    if left > 0:
        parts.append(_words(b"r%d" % salt, left))
    return parts


def prompt_text(blocks: Sequence[int], input_tokens: int, block_size: int, *, salt: int = 0) -> str:
    """A prompt of `input_tokens` tokens made of `blocks`' text; filler beyond the blocks is unique to `salt`."""
    return " ".join(prompt_parts(blocks, input_tokens, block_size, salt=salt))
