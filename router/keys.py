"""Finding a request's affinity key, and estimating its prompt size.

Sources, in order of precedence (the plan's `KeyExtraction`, flags may override):

1. the key header (default `x-affinity-key`);
2. a field of the JSON body (default `user`, the OpenAI end-user id; dotted paths such as
   `metadata.session_id` reach into objects);
3. the session header;
4. the first N characters of the system prompt followed by the first user message
   (system text, a newline, then user text; just the prompt for the completions API).

The key is hashed with `affinity_key_hash`, exactly like the planner hashes keys.

Token estimates (no tokenizer on the request path): prompt tokens = body bytes / 4; prefix
tokens = bytes of the message list before the newest message / 4 (the part a follow-up request
of the same conversation can find in the KV cache; JSON punctuation included). When the
response carries OpenAI `usage`, its `prompt_tokens` replaces the estimate, unless it is past
`MAX_USAGE_TOKENS` (not believed: the estimate stays).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Final, NamedTuple

from cacheroute.planner.plan import KeyExtraction, affinity_key_hash

CHARS_PER_TOKEN: Final = 4
# No model reads a prompt of a hundred million tokens: a larger usage figure is a broken upstream.
MAX_USAGE_TOKENS: Final = 100_000_000

HEADER: Final = "header"
BODY: Final = "body"
SESSION: Final = "session"
PROMPT: Final = "prompt"


class Key(NamedTuple):
    hash: int
    source: str
    # The clear key; None for prompt-derived keys (prompt text is never exported).
    name: str | None


def header_value(headers: Mapping[str, str], name: str | None) -> str | None:
    if not name:
        return None
    value = headers.get(name)
    return value if value else None


def key_from_headers(headers: Mapping[str, str], extraction: KeyExtraction) -> Key | None:
    value = header_value(headers, extraction.header)
    if value is not None:
        return Key(affinity_key_hash(value), HEADER, value)
    return None


class HeaderKeys(dict[str, Key]):
    """Header keys of recent requests by value, so that a key is hashed once, not on every
    request of it: `get(value)`, else `add(value)`. At most `capacity` keys are kept; the memory
    starts over when full, which costs a hash per key again and nothing else."""

    def __init__(self, capacity: int = 16_384) -> None:
        super().__init__()
        self.capacity = capacity

    def add(self, value: str) -> Key:
        if len(self) >= self.capacity:
            self.clear()
        key = self[value] = Key(affinity_key_hash(value), HEADER, value)
        return key


def session_key(headers: Mapping[str, str], extraction: KeyExtraction) -> Key | None:
    value = header_value(headers, extraction.session_header)
    if value is not None:
        return Key(affinity_key_hash(value), SESSION, value)
    return None


def wants_body(extraction: KeyExtraction) -> bool:
    return bool(extraction.body_field) or extraction.prompt_prefix_chars > 0


def parse_body(body: bytes) -> dict[str, Any] | None:
    """The JSON object of a request body; None for anything else (malformed, not an object)."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        # ValueError covers bad JSON, bad UTF-8 and integers of thousands of digits; nesting
        # deeper than the interpreter's recursion limit raises RecursionError.
        return None
    return doc if isinstance(doc, dict) else None


def _field(doc: Mapping[str, Any], path: str) -> object:
    value: object = doc
    for part in path.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


def text_of(content: object) -> str:
    """Text of an OpenAI message content: a string, or the text parts of a list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)
        )
    return ""


def prompt_messages(doc: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    messages = doc.get("messages")
    if not isinstance(messages, list):
        # The Responses API: `input` is a string or a list of messages.
        messages = doc.get("input")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not isinstance(messages, list):
            return []
    return [m for m in messages if isinstance(m, Mapping)]


def prompt_prefix(doc: Mapping[str, Any], chars: int) -> str:
    """The first `chars` characters of system prompt + newline + first user message."""
    messages = prompt_messages(doc)
    if messages:
        system = text_of(doc.get("instructions")) or next(
            (text_of(m.get("content")) for m in messages if m.get("role") in ("system", "developer")), ""
        )
        user = next((text_of(m.get("content")) for m in messages if m.get("role") == "user"), "")
        text = f"{system}\n{user}" if system else user
    else:
        prompt = doc.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        text = prompt if isinstance(prompt, str) else ""
    return text[:chars]


def key_from_body(doc: Mapping[str, Any], extraction: KeyExtraction) -> Key | None:
    """The body-field key, if present (a non-empty string or an integer)."""
    if not extraction.body_field:
        return None
    value = _field(doc, extraction.body_field)
    if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
        return None
    text = str(value)
    return Key(affinity_key_hash(text), BODY, text)


def key_from_prompt(doc: Mapping[str, Any], extraction: KeyExtraction) -> Key | None:
    if extraction.prompt_prefix_chars <= 0:
        return None
    text = prompt_prefix(doc, extraction.prompt_prefix_chars)
    return Key(affinity_key_hash(text), PROMPT, None) if text else None


def request_key(
    headers: Mapping[str, str], doc: Mapping[str, Any] | None, extraction: KeyExtraction
) -> Key | None:
    """The key by precedence, given the headers and (when seen and well-formed) the body."""
    key = key_from_headers(headers, extraction)
    if key is None and doc is not None:
        key = key_from_body(doc, extraction)
    if key is None:
        key = session_key(headers, extraction)
    if key is None and doc is not None:
        key = key_from_prompt(doc, extraction)
    return key


def estimate_prompt_tokens(body_bytes: int) -> int:
    return -(-body_bytes // CHARS_PER_TOKEN)


def estimate_prefix_tokens(body: bytes) -> int:
    """Tokens of everything before the newest message (what a follow-up turn can reuse).

    Counted on the raw JSON, from the start of the message list to the last `"role"` key, so a
    megabyte body costs two byte searches instead of a parse on the event loop. A quote inside
    a JSON string is escaped, so `"role"` only matches keys (or a value that is exactly "role").
    """
    start = body.find(b'"messages"')
    if start < 0:
        start = body.find(b'"input"')
    last = body.rfind(b'"role"')
    if start < 0 or last <= start:
        return 0
    first = body.find(b'"role"', start)
    if first >= last:
        return 0
    return -(-(last - start) // CHARS_PER_TOKEN)


_PROMPT_TOKENS: Final = re.compile(rb'"prompt_tokens"\s*:\s*(\d{1,12})(?![\d.eE])')


def usage_prompt_tokens(chunk: bytes) -> int | None:
    """`usage.prompt_tokens` of an OpenAI response (or its last stream event), if in this chunk
    and believable (an integer up to MAX_USAGE_TOKENS)."""
    if b'"prompt_tokens"' not in chunk:
        return None
    match = _PROMPT_TOKENS.search(chunk)
    if match is None:
        return None
    tokens = int(match.group(1))
    return tokens if tokens <= MAX_USAGE_TOKENS else None
