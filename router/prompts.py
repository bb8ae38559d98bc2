"""A request's prompt as a chain of prefix ids, for the memory of routed prefixes.

The router has no tokenizer and sees no KV blocks, so it names prefixes of the prompt's text:
the text is cut into pieces of `BLOCK_CHARS` characters, and the id of piece i is a hash of the
id of piece i-1 and the piece itself, so each id names the whole prompt up to the end of its
piece (two prompts share the first k ids exactly when they share their first k pieces). A piece
is `BLOCK_TOKENS` tokens at four characters per token: the same granularity as the replay's
prefix blocks (256 tokens for the generated workloads), so the memory it feeds
(`planner/prefixes.py`) counts matched tokens the same way in both.

The text is what the engine's chat template sees, in order: the Responses API's `instructions`,
then every message's role and text; the completions API's prompt as it is. Message boundaries
are marked so that moving text from one message to the next changes the id.

Ids come from Python's `hash`, which is salted per process: they are compared only within one
router process, and no id leaves it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cacheroute.router.keys import CHARS_PER_TOKEN, prompt_messages, text_of

BLOCK_TOKENS = 256
BLOCK_CHARS = BLOCK_TOKENS * CHARS_PER_TOKEN
# Blocks hashed per prompt at most: 512 blocks are 131,072 tokens, past any model's context
# window; a longer body stops its chain there (it can still match and be recorded up to it).
MAX_BLOCKS = 512
_ROLE_MARK = "\x1e"
_TEXT_MARK = "\x1f"


def prompt_text(doc: Mapping[str, Any]) -> str:
    """The prompt's text as the chain hashes it (module docstring); "" when the body has none."""
    messages = prompt_messages(doc)
    if messages:
        parts = [text_of(doc.get("instructions"))]
        for m in messages:
            role = m.get("role")
            parts.append(f"{_ROLE_MARK}{role if isinstance(role, str) else ''}{_TEXT_MARK}{text_of(m.get('content'))}")
        return "".join(parts)
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else ""


def prefix_chain(text: str) -> list[int]:
    """The ids of the prompt's prefixes, one per block of `BLOCK_CHARS` characters (the last block
    may be shorter)."""
    end = min(len(text), MAX_BLOCKS * BLOCK_CHARS)
    chain: list[int] = []
    append = chain.append
    h = 0
    for start in range(0, end, BLOCK_CHARS):
        h = hash((h, text[start : start + BLOCK_CHARS]))
        append(h)
    return chain
