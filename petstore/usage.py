"""Requests per key, UTC hour and outcome: counted in the worker, written in batches (key_usage).

A request costs a lock and a dict update (count_request, from petstore.pipeline.after_view), never
a round trip. Each worker's flusher writes what it counted every USAGE_FLUSH_SECONDS in one
statement, on a connection of the pool taken outside any request, and once more when the worker
stops (atexit: SIGTERM, max_requests, gunicorn's re-exec), so a graceful stop loses nothing. A
worker killed with kill -9 loses what it counted since its last batch, at most
USAGE_FLUSH_SECONDS of requests. Workers and hosts add to the same rows (insert ... on conflict
do update), so their counts add up exactly. A batch PostgreSQL refused is kept and added to the
next one.

Each batch goes through durable.durable_write: one whose commit's wait was cancelled is kept for
the next, and the flush at exit ends within EXIT_FLUSH_SECONDS past the write bound (what a
failover may cost: docs/faults.rst).

Requests without a valid key are counted under key id 0 (AGGREGATE), never per client address.
Paths outside /v1 (the probes, /metrics) are not counted.
"""

from __future__ import annotations

import atexit
import logging
import math
import threading
import time
import weakref
from datetime import UTC, datetime
from typing import Any

import psycopg
import psycopg_pool
from flask import Flask, Response, current_app, g

from petstore import durable, metrics, periodic, web
from petstore.caller import Caller
from petstore.plans import PLANS
from petstore.queries import usage as usage_sql

log = logging.getLogger(__name__)

EXTENSION = "petstore.usage"

# The key id and plan label of the requests without a valid key.
AGGREGATE = 0
NO_PLAN = "none"

# The plan label of petstore_plan_requests: a fixed set, never a key.
PLAN_LABELS = (*PLANS, NO_PLAN)

# How long a flush waits for a connection of the pool (seconds): requests come first.
FLUSH_POOL_TIMEOUT = 2.0
# The flush at a worker's exit ends within the write bound (durable.write_bound) plus this many
# seconds, the flusher's write in flight included: with the shipped settings (statement timeout
# 5 s) 8 s, within gunicorn's graceful timeout (20 s) after the running requests' 8 s.
EXIT_FLUSH_SECONDS = FLUSH_POOL_TIMEOUT

# (key id, plan, hour as Unix seconds) -> requests by outcome, in usage_sql.OUTCOMES' order.
Counts = dict[tuple[int, str, int], list[int]]


def outcome_index(status: int) -> int:
    """The outcome a status is counted by: 2xx (any status below 400), 4xx (but 429), 429, 5xx."""
    if status < 400:
        return 0
    if status == 429:
        return 2
    return 1 if status < 500 else 3


def caller_key(caller: Caller | None) -> tuple[int, str]:
    """(key id, plan) of the request's caller; the aggregate's without a valid key.

    The one place usage reads the caller.
    """
    if caller is None:
        return AGGREGATE, NO_PLAN
    return caller.key_id, caller.plan


class UsageCounter:
    """One worker's requests not yet written to key_usage."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counts = {}
        # One flush at a time: the flusher's and the one at exit.
        self.flushing = threading.Lock()

    def add(self, key_id: int, plan: str, status: int, now: float) -> None:
        """One request of `key_id` answered with `status` at `now` (Unix seconds)."""
        slot = (key_id, plan, int(now) // 3600 * 3600)
        with self.lock:
            outcomes = self.counts.get(slot)
            if outcomes is None:
                outcomes = self.counts[slot] = [0, 0, 0, 0]
            outcomes[outcome_index(status)] += 1

    def take(self) -> Counts:
        """Everything counted so far, leaving the counter empty."""
        with self.lock:
            taken, self.counts = self.counts, {}
        return taken

    def put_back(self, counts: Counts) -> None:
        """Counts a flush could not write: added to the next batch."""
        with self.lock:
            for slot, outcomes in counts.items():
                add_outcomes(self.counts, slot, outcomes)

    def requests(self) -> int:
        """How many requests are counted and not yet written."""
        with self.lock:
            return sum(sum(outcomes) for outcomes in self.counts.values())

    def flush(
        self, app: Flask, pool: psycopg_pool.ConnectionPool[Any], within: float | None = None
    ) -> int:
        """Write the counts in one statement, durably; how many (key, hour) rows. Kept on failure.

        With `within` (seconds), it ends by then, a flush in flight waited for included.
        """
        deadline = math.inf if within is None else time.monotonic() + within
        if not self.flushing.acquire(timeout=-1 if within is None else within):
            log.warning("usage counts not written: the flush in flight outlasted %.1f s", within)
            return 0
        try:
            counts = self.take()
            if not counts:
                return 0
            metrics.requests_by_plan(plan_totals(counts), app)
            rows = batch_rows(counts)
            try:
                pool_wait = max(0.01, min(FLUSH_POOL_TIMEOUT, deadline - time.monotonic()))
                with pool.connection(timeout=pool_wait) as conn, app.app_context():
                    left = None if within is None else max(0.0, deadline - time.monotonic())
                    with durable.durable_write(conn, left):
                        usage_sql.add_usage(conn, rows)
            except (psycopg.Error, psycopg_pool.PoolTimeout) as exc:
                # Kept for the next batch. A connection lost during the commit, or a commit whose
                # wait was cancelled (CommitNotReplicated), leaves the batch on a server that a
                # failover may throw away, or may keep: then its requests count twice.
                self.put_back(counts)
                log.warning("usage counts kept for the next batch: %s", exc)
                return 0
            return len(rows)
        finally:
            self.flushing.release()


def add_outcomes(into: dict[Any, list[int]], slot: Any, outcomes: list[int]) -> None:
    """Add requests by outcome to `into[slot]` (zeros when new)."""
    mine = into.setdefault(slot, [0, 0, 0, 0])
    for index, requests in enumerate(outcomes):
        mine[index] += requests


def plan_totals(counts: Counts) -> dict[tuple[str, str], int]:
    """Requests by (plan, outcome) of a batch: Prometheus's bounded labels."""
    totals: dict[tuple[str, str], int] = {}
    for (_key_id, plan, _hour), outcomes in counts.items():
        label = plan if plan in PLAN_LABELS else NO_PLAN
        for outcome, requests in zip(usage_sql.OUTCOMES, outcomes, strict=True):
            if requests:
                totals[label, outcome] = totals.get((label, outcome), 0) + requests
    return totals


def batch_rows(counts: Counts) -> list[tuple[int, datetime, int, int, int, int]]:
    """The rows of usage_sql.add_usage, sorted by (key id, hour), plans merged."""
    merged: dict[tuple[int, int], list[int]] = {}
    for (key_id, _plan, hour), outcomes in counts.items():
        add_outcomes(merged, (key_id, hour), outcomes)
    return [
        (key_id, datetime.fromtimestamp(hour, UTC), *outcomes)  # type: ignore[misc]
        for (key_id, hour), outcomes in sorted(merged.items())
    ]


def count_request(response: Response) -> None:
    """Count the request for its key (or the aggregate) by outcome: the one per-request call."""
    if not web.in_api():
        return
    key_id, plan = caller_key(g.get("caller"))
    counter: UsageCounter = current_app.extensions[EXTENSION]
    counter.add(key_id, plan, response.status_code, time.time())


def flush(app: Flask, within: float | None = None) -> int:
    """Write the app's counts now (within `within` seconds), unless its pool is closed; how many rows."""
    counter: UsageCounter = app.extensions[EXTENSION]
    pool = app.extensions.get("petstore.pool")
    if pool is None or pool.closed:
        return 0
    return counter.flush(app, pool, within)


def flush_while_open(app: Flask) -> bool:
    """The flusher's step, every USAGE_FLUSH_SECONDS until the app's pool is closed: `flush`."""
    pool = app.extensions.get("petstore.pool")
    if pool is None or pool.closed:
        return False
    flush(app)
    return True


def flush_at_exit(app_ref: weakref.ref[Flask]) -> None:
    """A stopping worker writes its last batch (SIGTERM, max_requests, a re-exec)."""
    app = app_ref()
    pool = None if app is None else app.extensions.get("petstore.pool")
    if app is None or pool is None or pool.closed:  # closed by its owner (tests): no write
        return
    flush(app, durable.write_bound(app.config) + EXIT_FLUSH_SECONDS)
    lost = app.extensions[EXTENSION].requests()
    if lost:
        log.warning("usage counts of %d requests lost: not written before the worker's exit", lost)


def init_app(app: Flask) -> None:
    """Give the app its counter, the flusher thread and the flush at exit (after metrics.init_app)."""
    app.extensions[EXTENSION] = UsageCounter()
    # Known series start at zero, so that rate() and increase() see their first increment.
    metrics.requests_by_plan(
        {(plan, outcome): 0 for plan in PLAN_LABELS for outcome in usage_sql.OUTCOMES}, app
    )
    periodic.every(
        float(app.config["USAGE_FLUSH_SECONDS"]),
        app,
        flush_while_open,
        "petstore-usage-flusher",
        "cannot write the usage counts",
        wait_first=True,
    )
    atexit.register(flush_at_exit, weakref.ref(app))
