"""The plans: each one's requests per minute and per day, as rate limits (the spec's Limits table)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

from limits import RateLimitItem
from limits.limits import RateLimitItemPerDay, RateLimitItemPerMinute

# Enterprise numbers are stored on each key; other plans may override theirs there.
PLAN_LIMITS: dict[str, tuple[int, int]] = {
    "free": (60, 1_000),
    "pro": (300, 10_000),
    "business": (1_000, 100_000),
}
PLANS = (*PLAN_LIMITS, "enterprise")

Limits = tuple[RateLimitItem, ...]


class Shown(NamedTuple):
    """What X-RateLimit-* show: the limit nearest to running out, its remaining requests, when
    its window ends (unix seconds), and all the caller's limits."""

    limit: RateLimitItem
    remaining: int
    reset: int
    limits: Limits


@functools.lru_cache(maxsize=1024)
def per_minute_and_day(per_minute: int, per_day: int) -> Limits:
    """The limits of `per_minute` and `per_day` requests, smallest window first, made once."""
    return (RateLimitItemPerMinute(per_minute), RateLimitItemPerDay(per_day))


def key_limits(key: Mapping[str, Any]) -> Limits:
    """A key's limits: its plan's numbers, or its own where the key has them."""
    per_minute, per_day = PLAN_LIMITS.get(key["plan"], (0, 0))
    return per_minute_and_day(key["per_minute"] or per_minute, key["per_day"] or per_day)
