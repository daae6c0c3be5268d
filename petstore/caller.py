"""The caller of a request: its key as it stands at one instant, made once from the key's row
(queries.keys.find_key_by_hash) and passed on, typed, from stage to stage."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from petstore.plans import Limits, key_limits


@dataclass(frozen=True, slots=True)
class Caller:
    """A valid key (expired or not) as it stands at one instant; made by caller_at."""

    key_id: int
    plan: str
    # The plan's numbers, or the key's own where it has them, smallest window first.
    limits: Limits
    scopes: frozenset[str]
    expires_at: datetime | None
    # Whether expires_at had passed: the key then gets the 401 that says so.
    expired: bool
    # The end of a ban still running, else None.
    banned_until: datetime | None
    # When `petstore bans lift` last forgave the key's strikes (bans.strike_key), else None.
    strikes_forgiven_at: datetime | None
    # The hash of the secret the key was found by: a strike reads the key again with it.
    key_hash: bytes


def instant(moment: datetime | None) -> float:
    """Unix seconds of `moment`; None (never) is infinitely far."""
    return math.inf if moment is None else moment.timestamp()


def caller_at(found: Mapping[str, Any], key_hash: bytes, now: float) -> Caller | None:
    """The caller the row `found` by `key_hash` is at `now` (unix seconds), or None if by then
    it names no valid key (its previous secret's grace has ended)."""
    if instant(found["grace_until"]) <= now:
        return None
    banned_until = found["banned_until"]
    return Caller(
        key_id=found["id"],
        plan=found["plan"],
        limits=key_limits(found),
        # Space-separated in the row (find_key_by_hash): split once here, not on every check.
        scopes=frozenset(found["scopes"].split()),
        expires_at=found["expires_at"],
        expired=instant(found["expires_at"]) <= now,
        banned_until=banned_until if instant(banned_until) > now else None,
        strikes_forgiven_at=found["strikes_forgiven_at"],
        key_hash=key_hash,
    )


def next_change(found: Mapping[str, Any], now: float) -> float:
    """The first instant after `now` at which caller_at(found, ...) answers otherwise."""
    moments = (instant(found[name]) for name in ("expires_at", "grace_until", "banned_until"))
    return min((moment for moment in moments if moment > now), default=math.inf)
