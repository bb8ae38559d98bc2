"""Traffic a server refuses: prompts longer than the model's length.

vLLM answers 400 to a prompt longer than `--max-model-len` and serves nothing of it, so such
traffic must neither be planned (a planned route for a key whose every request is refused holds
warm KV for nothing) nor replayed as if it were served (the guard's replay would let it fill a
destination's KV cache and queue everything behind it). The statistics hold each key's mean
prompt, not its requests' sizes, so a key is left out when its mean prompt is longer than the
model's length; keyless traffic likewise, as a whole. A plan computed without that traffic tells
its shares of the whole window's (`over_all_traffic`): the refused requests are requests too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from cacheroute.planner.keystats import KeyStats, UnkeyedTraffic
from cacheroute.planner.plan import Plan


@dataclass(frozen=True)
class Refused:
    """What `without_refused` left out."""

    keys: int = 0
    keyless: bool = False
    rate: float = 0.0  # requests per second
    longest_prompt_tokens: float = 0.0  # the longest mean prompt among them

    def __bool__(self) -> bool:
        return self.keys > 0 or self.keyless

    def describe(self, max_prompt_tokens: int) -> str:
        who = [f"{self.keys:,} key(s)"] if self.keys else []
        who += ["keyless traffic"] if self.keyless else []
        return (f"left out {' and '.join(who)} ({self.rate:.3g} request(s)/s) whose mean prompt is longer than "
                f"the model's length ({max_prompt_tokens:,} tokens; the longest mean "
                f"{self.longest_prompt_tokens:,.0f}): a server refuses them")


def without_refused(stats: KeyStats, max_prompt_tokens: int) -> tuple[KeyStats, Refused]:
    """`stats` less the keys (and keyless traffic) whose mean prompt is longer than
    `max_prompt_tokens`, and what that left out."""
    if max_prompt_tokens < 1:
        raise ValueError(f"the model's length must be at least one token, got {max_prompt_tokens}")
    over = stats.prompt_tokens > max_prompt_tokens
    u = stats.unkeyed
    keyless = u.rate > 0 and u.prompt_tokens > max_prompt_tokens
    if not over.any() and not keyless:
        return stats, Refused()
    longest = [float(stats.prompt_tokens[over].max())] if over.any() else []
    longest += [u.prompt_tokens] if keyless else []
    refused = Refused(
        keys=int(np.count_nonzero(over)),
        keyless=keyless,
        rate=float(stats.rate[over].sum()) + (u.rate if keyless else 0.0),
        longest_prompt_tokens=max(longest),
    )
    keep = ~over
    kept = KeyStats(
        names=tuple(name for name, k in zip(stats.names, keep.tolist(), strict=True) if k),
        rate=stats.rate[keep],
        prompt_tokens=stats.prompt_tokens[keep],
        prefix_tokens=stats.prefix_tokens[keep],
        output_tokens=stats.output_tokens[keep],
        unkeyed=UnkeyedTraffic() if keyless else u,
        window_s=stats.window_s,
        key_hashes=stats.key_hashes[keep] if stats.key_hashes is not None else None,
    )
    return kept, refused


def over_all_traffic(plan: Plan, served: KeyStats, whole: KeyStats) -> Plan:
    """`plan`, computed from `served` (`whole` less the refused traffic), with its summary's
    shares of requests and of prompt tokens taken over `whole`."""
    s = plan.summary
    summary = replace(
        s,
        admitted_request_share=s.admitted_request_share * _ratio(served.total_rate, whole.total_rate),
        admitted_token_share=s.admitted_token_share
        * _ratio(served.total_prompt_token_rate, whole.total_prompt_token_rate),
    )
    return replace(plan, summary=summary)


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 1.0
