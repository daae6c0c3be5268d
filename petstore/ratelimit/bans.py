"""Strikes and bans: a key that keeps calling after 429 is banned for a while, in PostgreSQL."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from flask import current_app
from limits import RateLimitItem
from limits.storage import storage_from_string

from petstore import db, durable, keycache, keys, metrics
from petstore.caller import Caller
from petstore.errors import DATABASE_UNAVAILABLE, APIError
from petstore.plans import Shown
from petstore.queries import bans as ban_sql
from petstore.ratelimit import storages
from petstore.ratelimit.limiter import PlanLimiter

log = logging.getLogger(__name__)

# A hot key's strikes in one worker are counted in the storage at most this often (Tallies).
STRIKE_BATCH_SECONDS = 1.0
# A tally with nothing pending is forgotten after this long.
FORGET_TALLY_SECONDS = 120.0


def seconds_until(instant: float) -> int:
    """Whole seconds from now until `instant`, at least 1 (a Retry-After value)."""
    return max(1, math.ceil(instant - time.time()))


def strike_key(config: Mapping[str, Any], key_id: int, forgiven_at: datetime | None) -> str:
    """The limiter storage key of a key's strike counter since its strikes were last forgiven.

    `petstore bans lift` stamps the key's row (strikes_forgiven_at), and a new stamp names a new
    counter: the strikes counted before it are left behind to expire with their window. So the
    lift reaches every worker's memory:// as it reaches Redis, through the key's row.
    """
    counter = f"{config['RATELIMIT_STRATEGY']}/strikes/{key_id}"
    if forgiven_at is None:
        return counter
    return f"{counter}/{round(forgiven_at.timestamp() * 1_000_000)}"


def caller_strike_key(config: Mapping[str, Any], caller: Caller) -> str:
    """strike_key of the caller."""
    return strike_key(config, caller.key_id, caller.strikes_forgiven_at)


def refuse_banned(caller: Caller | None) -> tuple[Shown | None, APIError | None]:
    """(what X-RateLimit-* show, the 429 api_key_banned) while the caller's ban runs (it spends
    no budget); (None, None) for a caller not banned."""
    if caller is None or caller.banned_until is None:
        return None, None
    until = caller.banned_until.timestamp()
    limits = caller.limits
    return Shown(limits[0], 0, math.ceil(until), limits), APIError(
        429,
        f"This API key is banned until {caller.banned_until.isoformat(timespec='seconds')} "
        "for continuing to call after 429 responses.",
        "api_key_banned",
        headers={"Retry-After": str(seconds_until(until))},
    )


def duration(seconds: int) -> str:
    """900 -> "15 minutes": a ban's length as people say it."""
    for unit, size in (("hour", 3600), ("minute", 60)):
        if seconds >= size and seconds % size == 0:
            count = seconds // size
            return f"{count} {unit}{'s' if count != 1 else ''}"
    return f"{seconds} second{'s' if seconds != 1 else ''}"


def times(factor: int) -> str:
    """2 -> "twice": how many times as long a repeat ban lasts, as people say it."""
    return {1: "as long", 2: "twice as long"}.get(factor, f"{factor} times as long")


def warning(config: Mapping[str, Any], strikes: int) -> str:
    """What a 429 adds to its message after its strike: how many more refusals ban the key."""
    left = config["BAN_THRESHOLD"] - strikes
    return (
        f" {left} more refused request{'s' if left != 1 else ''} in this window "
        f"ban{'s' if left == 1 else ''} this key for {duration(config['BAN_SECONDS'])} "
        f"({times(config['BAN_ESCALATION'])} as its last ban, up to "
        f"{duration(config['BAN_MAX_SECONDS'])}, when that ended less than "
        f"{duration(config['BAN_REPEAT_SECONDS'])} ago)."
    )


def reread(caller: Caller) -> Caller:
    """The caller as the database has it now, by the hash it was found by, before a strike.

    The key cache's row may predate a ban another worker stored, or a lift that forgave the
    key's strikes: the database says (a refused request's query, paid by the caller that keeps
    calling, not by everyone). The caller as held when the key is gone or the database cannot
    be asked.
    """
    try:
        fresh = keycache.current().reread(caller.key_hash, keys.find_key)
    except DATABASE_UNAVAILABLE:
        log.warning("cannot read key %s again before its strike", caller.key_id)
        return caller
    return caller if fresh is None else fresh


def ban_key(
    conn: db.Connection, settings: Mapping[str, Any], key_id: int, strikes: int
) -> dict[str, Any] | None:
    """Ban the key `key_id` after `strikes` strikes, as the BAN_* `settings` say (BAN_SECONDS, or
    longer for a repeat); None when it is banned already. Run it in a transaction."""
    return ban_sql.insert_ban(
        conn,
        key_id=key_id,
        base_seconds=settings["BAN_SECONDS"],
        strikes=strikes,
        escalation=settings["BAN_ESCALATION"],
        max_seconds=settings["BAN_MAX_SECONDS"],
        repeat_seconds=settings["BAN_REPEAT_SECONDS"],
    )


@dataclass(slots=True)
class Tally:
    """A key's strikes in this worker not yet counted in the storage, and the storage's count."""

    pending: int = 0
    known: int = 0
    counted_at: float = 0.0


class Tallies:
    """Strikes of the requests a worker refuses from a remembered refusal (a hot key,
    petstore.ratelimit.leases), counted in the storage in batches: at most once every
    STRIKE_BATCH_SECONDS per key, and at once when they would reach the ban threshold. So a key
    is banned at most one batch of each worker's refusals past the threshold."""

    def __init__(self) -> None:
        self.tallies: dict[int, Tally] = {}
        self.lock = threading.Lock()

    def add(self, key_id: int, threshold: int, now: float) -> tuple[int, int]:
        """Tally a strike: (the strikes to count in the storage now, 0 while not due; the strikes
        the 429 shows)."""
        with self.lock:
            tally = self.tallies.get(key_id)
            if tally is None:
                tally = self.tallies[key_id] = Tally(counted_at=now)
            tally.pending += 1
            shown = tally.known + tally.pending
            if now - tally.counted_at < STRIKE_BATCH_SECONDS and shown < threshold:
                return 0, shown
            due, tally.pending, tally.counted_at = tally.pending, 0, now
            for other, quiet in list(self.tallies.items()):
                if not quiet.pending and now - quiet.counted_at > FORGET_TALLY_SECONDS:
                    del self.tallies[other]
            return due, shown

    def counted(self, key_id: int, strikes: int) -> None:
        """The storage's count of the key's strikes, after a batch (0 after a ban)."""
        with self.lock:
            tally = self.tallies.get(key_id)
            if tally is not None:
                tally.known = strikes

    def pending(self, key_id: int) -> int:
        """The key's strikes tallied here and not yet counted in the storage."""
        tally = self.tallies.get(key_id)
        return 0 if tally is None else tally.pending


def tallies() -> Tallies:
    """The current app's strike tallies."""
    found: Tallies = current_app.extensions["petstore.strike_tallies"]
    return found


def strike(
    limiter: PlanLimiter, caller: Caller, spent: RateLimitItem, batched: bool = False
) -> tuple[tuple[Shown, APIError] | None, str]:
    """Count a 429 against the key in the limiter storage; at the threshold, ban it in PostgreSQL.

    First the key as the database has it now (`reread`): a key banned meanwhile gets its 429
    api_key_banned, returned first. `batched`: the 429 came from a remembered refusal, and its
    strike is tallied (Tallies) and counted with the next batch.

    Returns the sentence the 429's message ends with: how many more refused requests in this
    window ban the key, and for how long; or that it is now banned. The 429 stands even when the
    strike cannot be counted or the ban stored (the sentence is empty then).
    """
    config = current_app.config
    strikes = 1
    if batched:
        strikes, shown = tallies().add(caller.key_id, config["BAN_THRESHOLD"], time.time())
        if not strikes:
            return None, warning(config, shown)
    caller = reread(caller)
    ban_shown, banned = refuse_banned(caller)
    if banned is not None:
        assert ban_shown is not None
        return (ban_shown, banned), ""
    return None, count_strikes(limiter, caller, spent, strikes, batched)


def count_strikes(
    limiter: PlanLimiter, caller: Caller, spent: RateLimitItem, strikes: int, batched: bool
) -> str:
    """strike's count in the storage and its ban at the threshold: the 429's sentence."""
    config = current_app.config
    storage = limiter.limiter.storage
    strikes_at = caller_strike_key(config, caller)
    try:
        strikes = storage.incr(strikes_at, spent.get_expiry(), strikes)
        if batched:
            tallies().counted(caller.key_id, strikes)
        if strikes < config["BAN_THRESHOLD"]:
            return warning(config, strikes)
        conn = db.get_conn()
        # Bounded like every write: a primary deposed behind its back would hold the commit
        # (and the 429) forever. A ban not replicated is no ban: the 429 says nothing of one.
        with durable.durable_write(conn), conn.transaction():
            ban = ban_key(conn, config, caller.key_id, strikes)
        # This worker's next request of the key sees the ban, whoever stored it.
        keycache.current().forget(caller.key_id)
        # A new ban starts a new count: after it ends, the key gets a full threshold again.
        storage.clear(strikes_at)
        if batched:
            tallies().counted(caller.key_id, 0)
    except Exception:
        log.exception("cannot count a strike against key %s", caller.key_id)
        return ""
    if ban is None:  # another worker banned it first
        return " This key is now banned for calling on after 429 responses."
    metrics.ban_created()
    log.warning("banned key %s for %s s after %s strikes", caller.key_id, ban["seconds"], strikes)
    return (
        f" This key is now banned for {duration(ban['seconds'])} for calling on after 429 "
        "responses."
    )


def clear_strikes(settings: dict[str, Any], key_id: int, forgiven_at: datetime | None) -> int:
    """Forget the key's strikes counted since `forgiven_at` in the limiter storage of `settings`
    (the service's own); how many. memory:// is the service's own memory: nothing here."""
    storage = storage_from_string(
        storages.storage_uri(settings["RATELIMIT_STORAGE_URI"]),
        **storages.storage_options(settings),
    )
    strikes_at = strike_key(settings, key_id, forgiven_at)
    strikes = int(cast(int, storage.get(strikes_at)))  # a sync storage: never a coroutine
    storage.clear(strikes_at)
    return strikes
