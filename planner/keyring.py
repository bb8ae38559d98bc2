"""The two destinations an unplanned key may use: key-seeded power-of-two choices.

A key outside the plan still has follow-up requests (the next turns of a conversation) that
reuse its prompt's prefix. Drawing p2c's two candidates at random scatters them over the whole
fleet; drawing them from the key's hash keeps them on two destinations while the long tail of
small keys still spreads like p2c. The candidates come from a consistent-hash ring so that adding
or removing a destination moves only the keys that had it as a candidate, and so that every router
replica (and the shadow replay) derives the same pair from the same key and the same members.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from typing import Final

DEFAULT_POINTS_PER_MEMBER: Final = 64
# How a router sends keys the plan does not hold: key-seeded p2c, or p2c on two random candidates.
UNPLANNED_MODES: Final = ("key-p2c", "p2c")
DEFAULT_UNPLANNED: Final = "key-p2c"
_MASK: Final = (1 << 64) - 1


def check_unplanned_mode(mode: str) -> str:
    if mode not in UNPLANNED_MODES:
        raise ValueError(f"unplanned must be one of {', '.join(UNPLANNED_MODES)}, got {mode!r}")
    return mode


def _point(member: str, index: int) -> int:
    digest = hashlib.blake2b(f"{member}#{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _mix(h: int) -> int:
    """Spread a 64-bit key hash over the ring (splitmix64's finaliser): keys whose hashes share
    high bits would otherwise land on neighbouring points."""
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK
    return h ^ (h >> 31)


class KeyRing:
    """Members (destination ids or addresses) on a hash ring, `points` points each."""

    __slots__ = ("_owners", "_positions", "members")

    def __init__(self, members: Sequence[str], points: int = DEFAULT_POINTS_PER_MEMBER) -> None:
        if points < 1:
            raise ValueError(f"points per member must be at least 1, got {points}")
        if len(set(members)) != len(members):
            raise ValueError("ring members must be distinct")
        self.members = tuple(members)
        ring = sorted((_point(m, k), i) for i, m in enumerate(self.members) for k in range(points))
        self._positions = [p for p, _ in ring]
        self._owners = [i for _, i in ring]

    def __len__(self) -> int:
        return len(self.members)

    def pair(self, key_hash: int) -> tuple[int, int]:
        """Indices (into `members`) of the key's first and second candidate; equal when the ring
        has one member."""
        owners = self._owners
        n = len(owners)
        if not n:
            raise ValueError("the ring has no members")
        i = bisect.bisect_left(self._positions, _mix(key_hash & _MASK))
        first = owners[i % n]
        for step in range(1, n):
            other = owners[(i + step) % n]
            if other != first:
                return first, other
        return first, first
