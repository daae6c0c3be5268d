"""Budgets: plan-keyed limits per key (or per client address), counted once per request, the
X-RateLimit-* header policy, and a key's standing for GET /v1/rate_limit."""

from __future__ import annotations

import functools
import ipaddress
import logging
import math
import threading
import time
from typing import Any

from flask import Response, current_app, request
from limits import RateLimitItem
from limits.strategies import FixedWindowRateLimiter

from petstore.caller import Caller
from petstore.errors import APIError
from petstore.plans import Limits, Shown
from petstore.ratelimit import bans
from petstore.ratelimit.limiter import PlanLimiter

log = logging.getLogger(__name__)

# flask-limiter's scope of an application-wide limit: part of every storage key.
SCOPE = "global"
# The budget that addresses without a key share once AnonymousClients is full.
OVERFLOW = "ip:overflow"
# An IPv6 client is keyed by its /64: one subscriber's network, however many addresses it uses.
IPV6_PREFIX = 64


def client_key(address: str | None) -> str:
    """Whose budget a request without a valid key spends: its address (an IPv6 one by its /64)."""
    if address and ":" in address:
        try:
            network = ipaddress.IPv6Network((address, IPV6_PREFIX), strict=False)
        except ValueError:
            return f"ip:{address}"
        return f"ip:{network}"
    return f"ip:{address}"


def get_limiter() -> PlanLimiter:
    """The limiter of the current app."""
    limiter: PlanLimiter = current_app.extensions["petstore.limiter"]
    return limiter


def count(caller: Caller | None) -> tuple[Shown | None, APIError | None]:
    """Spend one request of the caller's budget (the key's, else the client address's); return
    (what X-RateLimit-* show, the refusal if any).

    Every limit is counted, smallest window first, as flask-limiter does; the first one spent
    answers 429 and counts a strike against the key (bans.strike), unless the database says the
    key is banned meanwhile (429 api_key_banned then). Otherwise the headers show the limit
    nearest to running out.
    """
    limiter = get_limiter()
    if not limiter.enabled:
        return None, None
    who, limits = budget_of(caller)
    prefix = current_app.config["RATELIMIT_STRATEGY"]
    shown: Shown | None = None
    for limit, (allowed, remaining, reset) in zip(
        limits, limiter.count(limits, prefix, who, SCOPE), strict=False
    ):
        if not allowed:
            warning = ""
            if caller is not None:
                # No ban without warning: each 429 of a key says how many more ban it.
                batched = limiter.refusing(limits, prefix, who, SCOPE)
                banned, warning = bans.strike(limiter, caller, limit, batched)
                if banned is not None:
                    return banned
            return Shown(limit, 0, math.ceil(reset), limits), APIError(
                429,
                f"Rate limit exceeded: {limit.amount} per {limit.GRANULARITY.name}.{warning}",
                "rate_limited",
                headers={"Retry-After": str(bans.seconds_until(reset))},
            )
        if shown is None or remaining < shown.remaining:
            shown = Shown(limit, remaining, math.ceil(reset), limits)
    return shown, None


def outcome(limited: APIError | None) -> str:
    """The count's outcome in its trace span: counted, fallback (counted in memory while the
    storage is down), refused (429 rate_limited) or banned."""
    if limited is None:
        return "fallback" if get_limiter().storage_dead else "counted"
    return "banned" if limited.code == "api_key_banned" else "refused"


def show_unspent() -> Shown | None:
    """What X-RateLimit-* show for a request that spends nothing: the client address's budget as
    it stands. For answers that are not the client's doing (the database cannot say who is
    calling)."""
    limiter = get_limiter()
    if not limiter.enabled:
        return None
    who, limits = budget_of(None)
    prefix = current_app.config["RATELIMIT_STRATEGY"]
    try:  # counting nothing; no headers when the storage cannot be read
        return nearest(window_stats(limiter, prefix, who, limits), limits)
    except Exception:
        log.exception("cannot read the rate limit windows")
        return None


def budget_of(caller: Caller | None) -> tuple[str, Limits]:
    """(whose budget, its limits): the key's plan, else the client address's IP_LIMITS."""
    if caller is not None:
        return f"key:{caller.key_id}", caller.limits
    extensions = current_app.extensions
    ip_limits: Limits = extensions["petstore.ip_limits"]
    clients: AnonymousClients | None = extensions["petstore.anonymous_clients"]
    who = client_key(request.remote_addr)
    if clients is not None and not clients.admit(who):
        who = OVERFLOW
    return who, ip_limits


class AnonymousClients:
    """The client addresses that have budgets of their own in memory://, at most `capacity`.

    Every address without a key would otherwise keep its windows in the worker's memory for
    as long as the longest one (a day by default), however many addresses a client owns. Past
    the capacity, new addresses share one budget (OVERFLOW) until old ones' windows end.
    Redis bounds its own memory: every window expires with its limit.
    """

    def __init__(self, capacity: int, seconds: int) -> None:
        self.capacity = capacity
        self.seconds = seconds  # the longest window: an address's windows all end by then
        self.until: dict[str, float] = {}
        self.lock = threading.Lock()

    def admit(self, who: str) -> bool:
        """Whether `who` counts in a budget of its own (always, once admitted, until it ends)."""
        now = time.time()
        until = self.until.get(who)
        if until is not None and until > now:
            return True
        with self.lock:
            if len(self.until) >= self.capacity:
                self.until = {key: end for key, end in self.until.items() if end > now}
            if len(self.until) >= self.capacity:
                return False
            self.until[who] = now + self.seconds
            return True


def window_stats(
    limiter: PlanLimiter, prefix: str, who: str, limits: Limits
) -> list[tuple[RateLimitItem, int, int]]:
    """(limit, remaining, reset) of each limit as it stands, read from the limiter, counting nothing.

    A window nothing was counted in yet ends a whole window from now: for the fixed window, now
    on the storage's clock (its get_expiry of a missing window is its now, Redis's for Redis).
    Raises what the storage raises (the fallback's numbers while it is down, as for counting).
    """
    fixed = isinstance(limiter.limiter, FixedWindowRateLimiter)
    stood = []
    for limit in limits:
        reset, remaining = limiter.limiter.get_window_stats(limit, prefix, who, SCOPE)
        if remaining == limit.amount:
            reset = (reset if fixed else time.time()) + limit.get_expiry()
        stood.append((limit, remaining, math.ceil(reset)))
    return stood


def nearest(stood: list[tuple[RateLimitItem, int, int]], limits: Limits) -> Shown:
    """What the headers show: the limit with the fewest requests left (the first on a tie)."""
    limit, remaining, reset = min(stood, key=lambda window: window[1])
    return Shown(limit, remaining, reset, limits)


@functools.lru_cache(maxsize=1024)
def window_name(limit: RateLimitItem) -> str:
    """A limit's name in /v1/rate_limit and RateLimit-Policy: `minute`, `day`, `5minute`..."""
    name = limit.GRANULARITY.name
    return name if limit.multiples == 1 else f"{limit.multiples}{name}"


def rate_limit_standing(caller: Caller) -> tuple[dict[str, Any], Shown]:
    """(A key's own standing, what X-RateLimit-* show), counting nothing: the body of GET
    /v1/rate_limit (its plan, each limit's window, its ban and its strikes), and the limit
    nearest to running out.

    A storage that cannot be read is a 503: these numbers have no stand-in.
    """
    limiter = get_limiter()
    config = current_app.config
    prefix = config["RATELIMIT_STRATEGY"]
    who, limits = budget_of(caller)
    try:
        stood = window_stats(limiter, prefix, who, limits)
        strikes = limiter.limiter.storage.get(bans.caller_strike_key(config, caller))
        strikes += bans.tallies().pending(caller.key_id)
    except Exception:
        log.exception("cannot read the rate limit windows")
        raise APIError(
            503,
            "The rate limit storage is unavailable; retry later.",
            headers={"Retry-After": str(config["RETRY_AFTER"])},
        ) from None
    named = {
        window_name(limit): {
            "limit": limit.amount,
            "remaining": remaining,
            "used": limit.amount - remaining,
            "reset": reset,
        }
        for limit, remaining, reset in stood
    }
    banned_until = caller.banned_until
    return {
        "plan": caller.plan,
        "limits": named,
        "ban": None if banned_until is None else {"until": math.ceil(banned_until.timestamp())},
        "strikes": {"count": strikes, "threshold": config["BAN_THRESHOLD"]},
    }, nearest(stood, limits)


@functools.lru_cache(maxsize=1024)
def policy_field(limits: Limits) -> str:
    """RateLimit-Policy (draft-ietf-httpapi-ratelimit-headers-10): one item per limit, its quota
    and window in seconds, e.g. `"minute";q=60;w=60, "day";q=1000;w=86400`. Made once per limits."""
    return ", ".join(
        f'"{window_name(limit)}";q={limit.amount};w={limit.get_expiry()}' for limit in limits
    )


def set_headers(response: Response, shown: Shown | None) -> None:
    """X-RateLimit-* showing `shown` (none for None), and beside them the draft standard's
    RateLimit-Policy and RateLimit: the same limit, its remaining requests `r` and the seconds
    `t` until its window ends."""
    if shown is not None:
        limit, remaining, reset, limits = shown
        headers = response.headers
        headers["X-RateLimit-Limit"] = str(limit.amount)
        headers["X-RateLimit-Remaining"] = str(remaining)
        headers["X-RateLimit-Reset"] = str(reset)
        headers["RateLimit-Policy"] = policy_field(limits)
        seconds = max(0, int(reset - time.time()))
        headers["RateLimit"] = f'"{window_name(limit)}";r={remaining};t={seconds}'
