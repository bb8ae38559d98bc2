"""Prompt text for a trace's requests: equal prefix blocks become equal text.

A trace describes a prompt as a chain of block ids of `block_size` tokens (the last block usually
partial). Each block id becomes `block_size` words derived from the id alone, one word per token
for the emulator's tokenizer (`sandbox.emulator.tokens`), so two prompts share text exactly as
far as they share blocks, and a prompt has exactly the trace's input length in tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache


@lru_cache(maxsize=8192)
def block_text(block_id: int, words: int) -> str:
    """`words` tokens of text standing for block `block_id` (its first `words` tokens)."""
    tag = f"{block_id & 0xFFFFFFFFFFFFFFFF:x}"
    return " ".join(f"b{tag}.{j}" for j in range(words))


def prompt_text(blocks: Sequence[int], input_tokens: int, block_size: int, *, salt: int = 0) -> str:
    """A prompt of `input_tokens` tokens made of `blocks`' text; filler beyond the blocks is unique to `salt`."""
    parts: list[str] = []
    left = input_tokens
    for block in blocks:
        if left <= 0:
            break
        take = min(block_size, left)
        parts.append(block_text(int(block), take))
        left -= take
    if left > 0:
        parts.append(" ".join(f"r{salt:x}.{j}" for j in range(left)))
    return " ".join(parts)
