"""The routing rule: which destination one request goes to, given its key, the plan and the load.

The router (`router/picker.py`) and the replay's planned policies (`replay/planned.py`) both
decide through `RoutingRule.choose`, so what the replay measures is what the router does.

1. **Planned key**: when the plan credits its entries with less than the whole prompt
   (`entry_credit` < 1: most of what the plan saves comes from keys whose prefixes stay cached
   wherever they go, `credit.py`), the caller keeps a memory of routed
   prefixes and no remembered prefix is worth following, the request is scored as step 6 scores
   an unplanned one, its entry credited with holding `entry_credit` of the prompt (more where it
   is remembered to hold more), ties to the entry; a pinned route is never scored. Otherwise:
   the least-loaded usable destination among the key's candidates; ties go to
   the first at or after `key_hash % len(candidates)`, so every router replica with the same view
   of load picks the same one. A key's candidates are its plan entry, whose length the planner
   decides from the key's load (`load.replicas_needed`). With `widen_planned` (router
   `--widen-planned`) and key-seeded p2c, a computed route's candidates are instead its two ring
   candidates followed by as many of its planned destinations as its entry is long, so no key
   is held to one destination; pinned routes keep their entry. It is off by default: when the KV
   cache binds, a second candidate per key caches its prefix twice (docs/capacity.md).
2. **Bounded affinity**: when that destination's load exceeds
   `spill_threshold x mean load + spill_slack`, the request spills to p2c among the other usable
   destinations (unless it is the only one). A planned key with no usable candidate spills too.
3. **Unplanned key, key-seeded p2c** (`unplanned="key-p2c"`): the less loaded of the key's two
   candidates on the consistent-hash ring (`keyring.KeyRing`), the first on a tie; an unusable
   candidate is skipped, and with neither usable the request goes to plain p2c.
4. **Plain p2c** (unplanned keys with `unplanned="p2c"`, keyless requests): the less loaded of two
   distinct destinations drawn uniformly, the first drawn on a tie.
5. **Following a prefix**: when the caller knows where the longest earlier prompt sharing most
   of this one went, and that no other destination holds as much of it (`follow`: the memory of
   routed prefixes, `prefixes.PrefixFollower`, kept by
   the router over its endpoints and by the replay over its destinations),
   the request goes there instead, as long as that destination's load is at most
   `follow_ratio x` the load of the destination steps 1-4 chose, plus `follow_slack`, plus
   `follow_gain`: what the request itself weighs less there, its remembered prefix in the
   units of load (`tokenload.py`). The next turn of a conversation finds its history in that
   destination's cache; a long shared document is not prefilled twice. A key the plan pins
   (`pinned`: a route the AffinityPlan fixes) stays on its entry unless it spills.

6. **Scoring an unplanned request** (key-seeded p2c only, and only when the caller keeps a memory
   of routed prefixes and passes `held`): when the request's key is not planned (or it has none)
   and no remembered prefix is worth following (step 5 has no `follow`), every usable destination
   gets `PREFIX_WEIGHT x` the share of the prompt it is remembered to hold plus `LOAD_WEIGHT x`
   its load's place between the most and the least loaded (1 for the least, 0 for the most, 1
   for all when loads are equal), and the request goes to the best score; ties go to the key's
   first ring candidate, then its second, then the first in `usable` (a keyless request's to the
   first at or after a random index, one draw). These are the weights of
   GIE's default profile (prefix 3, queue 2): a short shared prefix (a system prompt, the start
   of a document) pulls a request only while loads are close, while key-seeded p2c would confine
   the key to two destinations, hot or not, that may hold nothing of it.

Load is whatever the caller's `Loads` says: the rule compares loads and never measures them
(both callers count requests in flight, queued requests, and prompt tokens in flight:
`tokenload.py`). Destinations are opaque: the router passes its `Endpoint` objects, the replay
destination indexes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Final, Generic, Protocol, TypeVar

from cacheroute.planner.keyring import KeyRing

# Bounded affinity: a planned destination takes a request while its load is at most
# threshold x mean load + slack (in units of the load measure, `tokenload.py`: one queued request).
DEFAULT_SPILL_THRESHOLD: Final = 1.5
DEFAULT_SPILL_SLACK: Final = 2.0
# A request follows its prefix while that destination's load is at most ratio x the other
# choice's + slack.
DEFAULT_FOLLOW_RATIO: Final = 1.5
DEFAULT_FOLLOW_SLACK: Final = 2.0
# Candidates of a planned key under key-seeded p2c: at least its two ring candidates.
MIN_KEY_CANDIDATES: Final = 2

PLANNED: Final = "planned"
SPILLED: Final = "spilled"
KEY_P2C: Final = "key-p2c"
P2C: Final = "p2c"
FOLLOWED: Final = "followed"
SCORED: Final = "scored"
OUTCOMES: Final = (PLANNED, SPILLED, KEY_P2C, P2C, FOLLOWED, SCORED)
# Scoring unplanned requests (step 6): the weights of GIE's prefix and queue scorers in its
# default profile (CacheRoute's load, which counts queued requests and prompt tokens in flight,
# stands for the queue; it has no KV-usage term).
PREFIX_WEIGHT: Final = 3.0
LOAD_WEIGHT: Final = 2.0

D = TypeVar("D")
D_contra = TypeVar("D_contra", contravariant=True)


class Loads(Protocol[D_contra]):
    """What the rule knows of load: one destination's, and the mean over the usable ones."""

    def load(self, destination: D_contra, /) -> float: ...

    def mean(self) -> float: ...


def check_spill(threshold: float, slack: float) -> None:
    """Refuse spill settings out of range (for settings at the edges; the rule itself takes any)."""
    if not threshold > 0:
        raise ValueError(f"spill threshold must be positive, got {threshold}")
    if not slack >= 0:
        raise ValueError(f"spill slack must not be negative, got {slack}")


def check_follow(ratio: float, slack: float) -> None:
    """Refuse prefix-following settings out of range (ratio 0 turns following off)."""
    if not ratio >= 0:
        raise ValueError(f"follow ratio must not be negative, got {ratio}")
    if not slack >= 0:
        raise ValueError(f"follow slack must not be negative, got {slack}")


def ring_candidates(ring: KeyRing, members: Sequence[D], *, memo: bool = False) -> Callable[[int], tuple[D, D]]:
    """The key-seeded p2c candidates of a key hash: `members[i]` for the ring's pair (i, j).

    `memo` remembers each key's pair: right for the replay, whose keys are a finite set; the router
    sees arbitrary keys and must not grow a table of them.
    """
    pair = ring.pair
    if not memo:

        def candidates(key_hash: int) -> tuple[D, D]:
            i, j = pair(key_hash)
            return members[i], members[j]

        return candidates
    seen: dict[int, tuple[D, D]] = {}

    def remembered(key_hash: int) -> tuple[D, D]:
        found = seen.get(key_hash)
        if found is None:
            i, j = pair(key_hash)
            found = seen[key_hash] = (members[i], members[j])
        return found

    return remembered


def key_candidates(planned: Sequence[D], pair: tuple[D, D]) -> Sequence[D]:
    """A planned key's candidates under key-seeded p2c: its ring pair, then its planned
    destinations not already in it, `max(2, len(planned))` in all (fewer when there are not as
    many distinct ones)."""
    a, b = pair
    want = max(MIN_KEY_CANDIDATES, len(planned))
    out = [a] if a == b else [a, b]
    for d in planned:
        if len(out) >= want:
            break
        if d not in out:
            out.append(d)
    return out


class RoutingRule(Generic[D]):
    """The rule of the module docstring, bound to one caller's loads, random draws and settings.

    `draw` returns uniform floats in [0, 1) (`random.Random.random`): both callers seed one and
    consume it in the same order, so equal states and seeds give equal decisions.
    `key_candidates` gives a key's two ring candidates (`ring_candidates`); None routes unplanned
    keys by plain p2c; `widen_planned` widens computed planned routes with them (module docstring;
    `pinned` entries never are).
    `follow_ratio` 0 never follows.
    """

    __slots__ = ("_draw", "_key_candidates", "_load", "_mean", "entry_credit", "follow_ratio", "follow_slack",
                 "spill_slack", "spill_threshold", "widen_planned")

    def __init__(
        self,
        loads: Loads[D],
        draw: Callable[[], float],
        *,
        spill_threshold: float = DEFAULT_SPILL_THRESHOLD,
        spill_slack: float = DEFAULT_SPILL_SLACK,
        key_candidates: Callable[[int], tuple[D, D]] | None = None,
        follow_ratio: float = DEFAULT_FOLLOW_RATIO,
        follow_slack: float = DEFAULT_FOLLOW_SLACK,
        widen_planned: bool = False,
        entry_credit: float = 1.0,
    ) -> None:
        self._load = loads.load
        self._mean = loads.mean
        self._draw = draw
        self._key_candidates = key_candidates
        self.spill_threshold = spill_threshold
        self.spill_slack = spill_slack
        self.follow_ratio = follow_ratio
        self.follow_slack = follow_slack
        self.widen_planned = widen_planned
        self.entry_credit = entry_credit

    def choose(
        self,
        key_hash: int | None,
        planned: Sequence[D] | None,
        usable: Sequence[D],
        is_usable: Callable[[D], bool] | None = None,
        *,
        follow: D | None = None,
        follow_gain: float = 0.0,
        pinned: bool = False,
        held: Mapping[D, int] | None = None,
        prompt_tokens: int = 0,
    ) -> tuple[str, D]:
        """The outcome (one of `OUTCOMES`) and destination of one request.

        `planned` is the key's plan entry (None: the key is not planned), `usable` the destinations
        that may take the request (at least one), `is_usable` tells whether a destination of the
        plan entry, a ring candidate or `follow` is among them (None: all of them are). `follow`
        is where the caller's memory says most of this prompt was sent before (None: nowhere), and
        `follow_gain` what the request weighs less there, in load units. A `pinned` plan entry
        is taken as it is, without the key's ring candidates, and is not left to follow a prefix.
        `held` maps destinations to the tokens of this `prompt_tokens`-token prompt they are
        remembered to hold (absent: none); given, an unplanned request with no `follow` is scored
        (module docstring, step 6).
        """
        # One function, no helper call: this runs once per request on the router's hot path.
        outcome = P2C
        chosen: D | None = None
        if key_hash is not None:
            ring = self._key_candidates
            if planned is not None:
                if held is not None and follow is None and self.scores_planned(pinned):
                    return self.credited(planned, usable, is_usable, held, prompt_tokens)
                if ring is not None and self.widen_planned and not pinned:
                    planned = key_candidates(planned, ring(key_hash))
                best: D | None
                if len(planned) == 1:
                    # Most keys have one planned destination: no search.
                    best = planned[0]
                    if is_usable is not None and not is_usable(planned[0]):
                        best = None
                else:
                    best = self.least_loaded(planned, key_hash, is_usable)
                if best is None:
                    outcome, chosen = SPILLED, self.p2c(usable)
                elif len(usable) == 1 or self._load(best) <= self.spill_threshold * self._mean() + self.spill_slack:
                    # Within the bounded-affinity limit (`overloaded`).
                    outcome, chosen = PLANNED, best
                else:
                    outcome, chosen = SPILLED, self.p2c(usable, best)
            elif ring is not None:
                if held is not None and follow is None:
                    return SCORED, self.scored(ring(key_hash), usable, is_usable, held, prompt_tokens)
                outcome, chosen = KEY_P2C, self.key_p2c(ring(key_hash), usable, is_usable)
        elif held is not None and follow is None and self._key_candidates is not None:
            return SCORED, self.scored(None, usable, is_usable, held, prompt_tokens)
        if chosen is None:
            chosen = self.p2c(usable)
        if (
            follow is not None
            and follow != chosen
            and not (pinned and outcome == PLANNED)
            and self.follow_ratio > 0
            and (is_usable is None or is_usable(follow))
            and self._load(follow) <= self.follow_ratio * self._load(chosen) + self.follow_slack + follow_gain
        ):
            return FOLLOWED, follow
        return outcome, chosen

    def least_loaded(self, planned: Sequence[D], key_hash: int, is_usable: Callable[[D], bool] | None) -> D | None:
        """The usable destination of `planned` with the least load; ties go to the first at or
        after `key_hash % len(planned)`. (`choose` takes a single planned destination without it.)"""
        n = len(planned)
        load = self._load
        best: D | None = None
        best_load = 0.0
        start = key_hash % n if n else 0
        for step in range(n):
            i = start + step
            d = planned[i if i < n else i - n]
            if is_usable is None or is_usable(d):
                value = load(d)
                if best is None or value < best_load:
                    best, best_load = d, value
        return best

    def overloaded(self, destination: D) -> bool:
        """Bounded affinity: whether `destination` is above `threshold x mean + slack`."""
        return self._load(destination) > self.spill_threshold * self._mean() + self.spill_slack

    def key_p2c(self, pair: tuple[D, D], usable: Sequence[D], is_usable: Callable[[D], bool] | None) -> D:
        """The less loaded usable one of a key's two ring candidates (the first on a tie)."""
        a, b = pair
        if is_usable is None:
            a_ok, b_ok = True, b != a
        else:
            a_ok = is_usable(a)
            b_ok = b != a and is_usable(b)
        if a_ok and b_ok:
            load = self._load
            return b if load(b) < load(a) else a
        if a_ok:
            return a
        if b_ok:
            return b
        return self.p2c(usable)

    def scores_planned(self, pinned: bool) -> bool:
        """Whether a planned request of this (un)`pinned` route is scored when the caller passes
        `held` (step 1): what tells the caller to read its memory of routed prefixes for it."""
        return self.entry_credit < 1.0 and not pinned and self._key_candidates is not None

    def credited(
        self,
        planned: Sequence[D],
        usable: Sequence[D],
        is_usable: Callable[[D], bool] | None,
        held: Mapping[D, int],
        prompt_tokens: int,
    ) -> tuple[str, D]:
        """A planned request scored as step 6 scores an unplanned one, its plan entry credited with
        holding `entry_credit` of the prompt (more where it is remembered to hold more); ties go to
        the entry, in plan order. PLANNED when it lands on its entry, SCORED elsewhere."""
        floor = int(self.entry_credit * prompt_tokens)
        credit = dict(held)
        for d in planned:
            if credit.get(d, 0) < floor:
                credit[d] = floor
        chosen = self.scored(planned, usable, is_usable, credit, prompt_tokens)
        return (PLANNED if chosen in planned else SCORED), chosen

    def scored(
        self,
        pair: Sequence[D] | None,
        usable: Sequence[D],
        is_usable: Callable[[D], bool] | None,
        held: Mapping[D, int],
        prompt_tokens: int,
    ) -> D:
        """The usable destination of the best score (module docstring, step 6); ties go to the
        `pair` (the key's ring pair, or a planned key's entry: `credited`), then to the first in
        `usable`; without a pair (keyless) to the first at or
        after a random index of `usable`."""
        load = self._load
        loads = [load(d) for d in usable]
        least = min(loads)
        span = max(loads) - least
        most = least + span
        per_token = PREFIX_WEIGHT / prompt_tokens if prompt_tokens > 0 else 0.0
        per_load = LOAD_WEIGHT / span if span > 0 else 0.0
        flat = LOAD_WEIGHT if span <= 0 else 0.0
        get = held.get
        best: D | None = None
        best_score = 0.0
        if pair is not None:
            for d in pair:
                if is_usable is None or is_usable(d):
                    score = per_token * get(d, 0) + per_load * (most - load(d)) + flat
                    if best is None or score > best_score:
                        best, best_score = d, score
        n = len(usable)
        # A keyless request's ties go to a random destination (the first at or after a drawn
        # index), so that short prompts spread as under p2c instead of piling on the first.
        start = 0 if pair is not None else int(self._draw() * n)
        for step in range(n):
            i = start + step
            if i >= n:
                i -= n
            score = per_token * get(usable[i], 0) + per_load * (most - loads[i]) + flat
            if best is None or score > best_score:
                best, best_score = usable[i], score
        assert best is not None  # `usable` is never empty
        return best

    def p2c(self, usable: Sequence[D], exclude: D | None = None) -> D:
        """Power of two choices among `usable`, without `exclude` (which must be one of them)."""
        n = len(usable)
        draw = self._draw
        if exclude is None or n == 1:
            if n == 1:
                return usable[0]
            i = int(draw() * n)
            j = int(draw() * (n - 1))
            if j >= i:
                j += 1
        else:
            skip = usable.index(exclude)
            if n == 2:
                return usable[1 - skip]
            # Two distinct draws among the n - 1 others, mapped around the excluded position.
            i = int(draw() * (n - 1))
            j = int(draw() * (n - 2))
            if j >= i:
                j += 1
            if i >= skip:
                i += 1
            if j >= skip:
                j += 1
        a, b = usable[i], usable[j]
        load = self._load
        return b if load(b) < load(a) else a
