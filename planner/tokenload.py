"""Token-aware load: what a destination still owes, counted in requests and in prompt tokens.

The router and the replay measure a destination's load the same way (the routing rule only
compares loads):

    load = in_flight_weight x requests in flight + requests queued (scraped)
           + prompt tokens still to prefill / tokens_per_unit

Requests in flight are the router's own, from dispatch to the end of the response; the queue is
`vllm:num_requests_waiting`. A queued request weighs 1: it holds a newcomer back until it is
admitted. A request in flight weighs `in_flight_weight`, a quarter by default: once running, it
shares each engine step with the newcomer (chunked prefill batches new prompts with decodes), so
it delays a newcomer's first token by a fraction of a step, not by a place in the queue. Counting
it whole sent requests away from a destination busy decoding to one with requests queued (the
load GIE's queue scorer compares is the queue alone; the figures are in docs/capacity.md). It is
not 0: between two scrapes, the requests in flight are the only count the router has of its own
dispatches.

A request still to be prefilled also counts the prompt tokens it brings, as estimated from its
body. A destination chewing through a few long prompts is then as loaded as one serving many
short ones: counting requests alone sends a 60k-token prompt to the replica already prefilling
another one. `tokens_per_unit` is how many such tokens weigh as much as one more request in
flight: 4,096 by default, half of vLLM's default step budget on H100 (about 0.3 s of prefill for
a 70B TP=2 replica). Once its first token is out, a request's prompt costs nothing more, but
neither side sees first tokens (the router would have to take every response chunk). vLLM admits
requests in arrival order, so of the requests in flight to a destination, the newest `waiting + 1`
are the queued ones and the one prefilling: their charges are what is still to prefill
(`pending_prompt_tokens`). The router recounts them at every scrape and adds whatever it sends
between two scrapes; the replay, which reads the queue exactly, recounts them at every decision.
Charging a prompt until the response ended instead counted the prompts of requests long since
decoding. The figures behind both choices are in docs/capacity.md.

When requests follow their routed prefixes (`prefixes.PrefixFollower`), a request is charged only
the tokens past the prefix the memory says its destination holds (`uncached_tokens`).

Request size comes from the body: its bytes times a tokens-per-byte ratio learned from the
`usage.prompt_tokens` of responses (`TokenEstimator`), starting at 1/4 (about four characters per
token of English text and JSON). The replay has no text; it gives every request a body of four
bytes per token, so its estimates start right where the router's converge.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

DEFAULT_TOKENS_PER_LOAD_UNIT: Final = 4096
DEFAULT_IN_FLIGHT_WEIGHT: Final = 0.25
BYTES_PER_TOKEN: Final = 4
# Weight of the newest observation in the learned ratio: about the last 200 responses count.
_LEARNING_RATE: Final = 0.005
# Ratios outside this range come from bodies that are mostly not prompt (images, tools): ignored.
_MIN_RATIO, _MAX_RATIO = 0.02, 2.0


def check_tokens_per_unit(tokens: float) -> None:
    if not tokens >= 0:
        raise ValueError(f"tokens per load unit must not be negative (0: requests only), got {tokens}")


def check_in_flight_weight(weight: float) -> None:
    if not 0 <= weight <= 1:
        raise ValueError(f"in-flight weight must be within [0, 1] (1: a request in flight weighs a queued one), "
                         f"got {weight}")


class TokenEstimator:
    """Prompt tokens from the size of a request body, with the ratio learned from responses."""

    __slots__ = ("ratio", "samples")

    def __init__(self, ratio: float = 1.0 / BYTES_PER_TOKEN) -> None:
        self.ratio = ratio
        self.samples = 0

    def estimate(self, body_bytes: int) -> int:
        return int(body_bytes * self.ratio + 0.5)

    def learn(self, body_bytes: int, prompt_tokens: int) -> None:
        """A response's `usage.prompt_tokens` for a body of `body_bytes`."""
        if body_bytes <= 0 or prompt_tokens <= 0:
            return
        observed = prompt_tokens / body_bytes
        if not _MIN_RATIO <= observed <= _MAX_RATIO:
            return
        self.samples += 1
        # Plain mean over the first responses, then an exponential average.
        weight = max(_LEARNING_RATE, 1.0 / self.samples)
        self.ratio += weight * (observed - self.ratio)


def pending_prompt_tokens(charges: Mapping[int, int], waiting: int) -> tuple[int, int]:
    """The prompt tokens still to prefill at a destination, from the charges of its requests in
    flight in dispatch order (oldest first) and its queue depth: the newest `waiting + 1`
    charges, and the ticket of the oldest of them (every later ticket is counted too)."""
    total = 0
    oldest = 0
    left = waiting + 1
    for ticket in reversed(charges):
        if left <= 0:
            break
        total += charges[ticket]
        oldest = ticket
        left -= 1
    return total, oldest


def uncached_tokens(prompt_tokens: int, held_tokens: int) -> int:
    """Prompt tokens a destination is expected to compute: all of them but the leading ones the
    router's memory says it sent there before (`PrefixMemory.held_by`)."""
    return max(prompt_tokens - held_tokens, 0)
