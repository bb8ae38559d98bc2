"""A deterministic stand-in for a tokenizer: one whitespace-separated word is one token.

Prefix caching works on blocks of tokens, chained as vLLM chains them: a block's id depends on
its own tokens and on the id of the block before it, so two prompts share block ids exactly as
far as they share whole blocks of text from the start. The last, partial block of a prompt is
never shared (vLLM hashes full blocks only). Ids come from Python's `hash`, which is stable
within one process: every emulator's cache lives in the process that computes its ids.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

# Ids of partial blocks: negative and unique, so they never hit and never collide with a chain.
_private = itertools.count(1)

_VOCABULARY = (
    "the", "cache", "keeps", "every", "prefix", "warm", "while", "the", "router", "plans", "which", "replica",
    "serves", "each", "key", "and", "the", "engine", "batches", "tokens", "step", "by", "step", "until", "the",
    "answer", "is", "complete",
)


def words(text: str) -> list[str]:
    return text.split()


def block_ids(tokens: Sequence[str], block_size: int, *, shared: bool = True) -> list[int]:
    """Chained ids of the prompt's full blocks, then a private id for its partial tail.

    With `shared=False` (prefix caching off) every block is private.
    """
    ids: list[int] = []
    full = len(tokens) // block_size
    if shared:
        previous = 0
        for b in range(full):
            previous = hash((previous, *tokens[b * block_size : (b + 1) * block_size]))
            ids.append(previous)
    else:
        ids.extend(-next(_private) for _ in range(full))
    if len(tokens) % block_size:
        ids.append(-next(_private))
    return ids


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                parts.append(part)
        return " ".join(parts)
    raise ValueError("message content must be a string or a list of content parts")


def chat_prompt(messages: Sequence[Mapping[str, Any]]) -> str:
    """The prompt a chat template would build: each message after a role marker, then the reply's."""
    if not messages:
        raise ValueError("messages must not be empty")
    parts = []
    for message in messages:
        if not isinstance(message, Mapping) or "role" not in message:
            raise ValueError("every message needs a role")
        parts.append(f"<|{message['role']}|>")
        parts.append(_content_text(message.get("content")))
    parts.append("<|assistant|>")
    return " ".join(parts)


def output_words(start: int, count: int) -> Iterator[str]:
    """`count` words of made-up output, from position `start` of the answer."""
    n = len(_VOCABULARY)
    for k in range(start, start + count):
        yield _VOCABULARY[k % n]


def output_text(start: int, count: int) -> str:
    """Output tokens [start, start + count) as text, each word led by a space (as BPE pieces are)."""
    return "".join(" " + w for w in output_words(start, count))
