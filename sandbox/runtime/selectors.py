"""Kubernetes label selectors in their string form (`a=b,c!=d,e in (f,g),h notin (i),j,!k`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

Matcher = Callable[[Mapping[str, str]], bool]

_SET = re.compile(r"^\s*(!?)([A-Za-z0-9_./-]+)\s*(?:(in|notin)\s*\(([^)]*)\))?\s*$")
_EQ = re.compile(r"^\s*([A-Za-z0-9_./-]+)\s*(==|=|!=)\s*([A-Za-z0-9_.-]*)\s*$")


def _split(text: str) -> list[str]:
    """Split on commas outside parentheses."""
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p for p in parts if p.strip()]


def _requirement(text: str) -> Matcher:
    eq = _EQ.match(text)
    if eq:
        key, op, value = eq.groups()
        if op == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: labels.get(key) == value
    match = _SET.match(text)
    if match is None:
        raise ValueError(f"label selector requirement {text.strip()!r} is not valid")
    negate, key, op, values = match.groups()
    if op is None:
        if negate:
            return lambda labels: key not in labels
        return lambda labels: key in labels
    if negate:
        raise ValueError(f"label selector requirement {text.strip()!r} is not valid")
    options = {v.strip() for v in values.split(",") if v.strip()}
    if op == "in":
        return lambda labels: labels.get(key) in options
    return lambda labels: labels.get(key) not in options


def parse_selector(text: str | None) -> Matcher:
    """A predicate over labels; an empty selector matches everything."""
    if not text or not text.strip():
        return lambda _labels: True
    requirements = [_requirement(part) for part in _split(text)]
    return lambda labels: all(r(labels) for r in requirements)
