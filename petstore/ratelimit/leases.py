"""Leased budgets: a key that one worker sees often is counted from a lease, not request by request.

A cold key costs one Redis call per request (storages.INCR_WINDOWS), which bounds one busy key
by one Redis core. A key turns hot in a worker once the worker has seen it for a second without
a pause and the last whole second brought at least RATELIMIT_HOT_RATE of its requests, and stays
hot there until a second passes without one. After such a pause, while the window it last
leased from goes on, its next request is counted in the storage (one call) and, if that count
is in the same window, the key is hot again at once: a worker that gets a busy key in bursts
does not count it request by request for a second after each gap. (A window that changed, for
example a storage emptied by a test, means a second's exact count again.) A hot key
reserves a lease (storages.RESERVE_WINDOWS): requests counted in each of its windows before they
are spent, at most LEASE_SECONDS of the worker's own rate and at most what is left unreserved
divided by the workers that share the limits, but one while anything is left. So near
the end of a window a lease is one request, and counting is exact: the limit is never passed,
and a window refuses early by at most the requests held, unspent, by other workers.

- The worker admits from its lease with no round trip until the lease runs out or its first
  window ends. X-RateLimit-Remaining then shows the requests the worker holds: never more than
  remains in the window.
- A lease refused (a window is spent) is remembered until that window's end: the key's further
  requests are refused in the worker with no round trip (their strikes go in batches,
  petstore.ratelimit.bans).
- Unspent requests go back (storages.RELEASE_WINDOWS) once the worker has not used its lease
  for LEASE_IDLE_SECONDS, when its first window ends (to the longer windows), and at the
  worker's exit. A worker killed with SIGKILL loses one lease per key: its window refuses early
  by at most that many requests.
- Each worker beats every BEAT_SECONDS into a sorted set of the workers (storages.WORKERS), so
  every worker knows how many share the limits: the lease size divides by them, and while
  Redis is down each worker counts a share of each limit in memory (petstore.ratelimit.limiter).
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import socket
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from limits import RateLimitItem

from petstore import periodic
from petstore.ratelimit.storages import Counted, StorageWindow, storage_windows

log = logging.getLogger(__name__)

# A lease holds at most this many seconds of the worker's own rate of the key.
LEASE_SECONDS = 2.0
# The keeper gives back idle and ended leases this often.
SWEEP_SECONDS = 0.25
# A worker's heartbeat, and how long the others count it after its last one.
BEAT_SECONDS = 10.0
BEAT_HORIZON = 30
# A budget not seen for this long is forgotten (it holds nothing by then).
FORGET_SECONDS = 10.0
# What a worker's exit waits, at most, to give its leases back.
EXIT_SECONDS = 1.0
# Two ends of a window on the storage's clock, as answered by two calls, within this: one window.
SAME_END = 0.2

# (within the limit, remaining, reset) of one window: what PlanLimiter.count answers.
Result = tuple[bool, int, float]
Budgets = tuple[tuple[RateLimitItem, ...], tuple[str, ...]]


class Rate:
    """A budget's requests in this worker, per whole second, how long they came without a pause
    of a second, and whether they made the key hot."""

    __slots__ = ("current", "heated", "last", "paused_hot", "second", "seen", "since")

    def __init__(self, now: float) -> None:
        self.second = int(now)
        self.current = 0  # requests in `second`
        self.last = 0  # requests in the second before it
        self.since = self.seen = now
        self.heated = False
        self.paused_hot = False  # hot until the pause this request ended

    def add(self, now: float) -> None:
        """Count a request at `now`."""
        if now - self.seen > 1.0:
            self.since = now
            self.paused_hot, self.heated = self.heated, False
        self.seen = now
        second = int(now)
        if second != self.second:
            self.last = self.current if second == self.second + 1 else 0
            self.second, self.current = second, 0
        self.current += 1

    def hot(self, threshold: int, now: float) -> bool:
        """Seen for a second without a pause, at least `threshold` requests in the last whole one;
        then hot until the next pause (a worker near the threshold does not flip each second)."""
        if not self.heated:
            self.heated = now - self.since >= 1.0 and self.last >= threshold
        return self.heated

    def resume(self, hot: bool) -> None:
        """After a pause: hot again at once if `hot` and the key was hot before it."""
        self.heated = self.heated or (hot and self.paused_hot)
        self.paused_hot = False


@dataclass(slots=True)
class Budget:
    """One budget's state in this worker: its rate, its lease, its remembered refusal."""

    rate: Rate
    windows: Sequence[StorageWindow]
    tokens: int = 0  # requests leased and not spent
    ends: tuple[float, ...] = ()  # the lease's windows' ends, on the storage's clock
    until: float = 0.0  # the lease's first window's end, on this host's clock
    used_at: float = 0.0
    refused: list[Result] = field(default_factory=list)
    refused_until: float = 0.0

    def lease_answer(self) -> list[Result]:
        """A request admitted from the lease: each window shows the requests still held."""
        return [(True, self.tokens, end) for end in self.ends]


class Leases:
    """The leases of one worker's limiter, on a storage with RESERVE_WINDOWS (Redis, fixed window)."""

    def __init__(
        self,
        storage: Any,
        hot_rate: int,
        idle_seconds: float,
        workers_key: str,
        name: str = "",
    ) -> None:
        self.storage = storage
        self.hot_rate = hot_rate
        self.idle_seconds = idle_seconds
        self.workers_key = workers_key
        self.budgets: dict[Budgets, Budget] = {}
        self.giving_back: list[tuple[Sequence[StorageWindow], int, tuple[float, ...]]] = []
        self.lock = threading.Lock()
        # The workers that share the limits, this one included: known from their heartbeats.
        self.sharers = 1
        # This worker in the set of workers: its host and pid, and `name` when one process plays
        # several workers (tests).
        self.name = name
        self.member = ""
        self.pid = 0
        self.next_beat = 0.0

    def count(self, items: tuple[RateLimitItem, ...], identifiers: tuple[str, ...]) -> list[Result]:
        """Count one request against `items`: from the budget's lease or remembered refusal when
        it has one, else with a new lease when the key is hot, else in the storage (one call).
        (within the limit, remaining, reset) of each item, up to the first one spent. Raises
        what the storage raises."""
        now = time.time()
        if self.pid != os.getpid():
            self.start()
        with self.lock:
            budget = self.budgets.get((items, identifiers))
            if budget is None:
                windows = storage_windows(items, identifiers)
                budget = self.budgets[(items, identifiers)] = Budget(Rate(now), windows)
            rate = budget.rate
            rate.add(now)
            if budget.refused:
                if now < budget.refused_until:
                    rate.resume(True)  # its window goes on, refused: a pause does not cool it
                    return budget.refused
                budget.refused = []
            if budget.tokens:
                if now < budget.until and now - budget.used_at < self.idle_seconds:
                    budget.tokens -= 1
                    budget.used_at = now
                    return budget.lease_answer()
                self.give_back_later(budget)
            hot = bool(self.hot_rate) and rate.hot(self.hot_rate, now)
            resuming = rate.paused_hot and now < budget.until
            rate.paused_hot = resuming
        if not hot:
            counts = self.storage.incr_windows(budget.windows)
            if resuming:  # hot again if this count is in the window it leased from
                with self.lock:
                    rate.resume(bool(counts) and abs(counts[0][1] - budget.ends[0]) <= SAME_END)
            return counted(items, counts)
        most = max(1, math.ceil(LEASE_SECONDS * max(rate.last, rate.current)))
        reserved = self.storage.reserve_windows(budget.windows, most, self.sharers)
        now = time.time()
        # The storage's clock, on this host's: leases and refusals end with their windows.
        offset = now - reserved.now
        with self.lock:
            if not reserved.granted:
                budget.refused = spent(items, reserved.counted)
                budget.refused_until = budget.refused[-1][2] + offset
                return budget.refused
            ends = tuple(end for _count, end in reserved.counted)
            if budget.tokens and budget.ends and abs(budget.ends[0] - ends[0]) > SAME_END:
                self.give_back_later(budget)  # another thread's lease, of the window before
            budget.tokens += reserved.granted - 1
            budget.ends = ends
            budget.until = ends[0] + offset
            budget.used_at = now
            return budget.lease_answer()

    def refusing(self, items: tuple[RateLimitItem, ...], identifiers: tuple[str, ...]) -> bool:
        """Whether the budget's requests are refused here, from a remembered refusal."""
        budget = self.budgets.get((items, identifiers))
        return budget is not None and bool(budget.refused)

    def give_back_later(self, budget: Budget) -> None:
        """Queue the budget's unspent lease for the keeper, emptied here (hold the lock)."""
        if budget.tokens:
            self.giving_back.append((budget.windows, budget.tokens, budget.ends))
            budget.tokens = 0

    def start(self) -> None:
        """In a new process (a forked worker): no leases of the parent's, a heartbeat, a keeper."""
        with self.lock:
            if self.pid == os.getpid():
                return
            self.pid = os.getpid()
            self.member = f"{socket.gethostname()}/{self.pid}{self.name}"
            self.budgets.clear()
            self.giving_back.clear()
        periodic.every(
            SWEEP_SECONDS,
            self,
            sweep_in_this_process,
            "petstore-leases",
            "cannot sweep the rate limit leases",
        )
        atexit.register(give_back_at_exit, weakref.ref(self))

    def sweep(self) -> None:
        """Give back the leases idle for LEASE_IDLE_SECONDS or past their window, forget quiet
        budgets, and beat when due."""
        now = time.time()
        with self.lock:
            for key, budget in list(self.budgets.items()):
                if budget.tokens and (
                    now >= budget.until or now - budget.used_at >= self.idle_seconds
                ):
                    self.give_back_later(budget)
                if budget.refused and now >= budget.refused_until:
                    budget.refused = []
                if not budget.refused and now - budget.rate.seen >= FORGET_SECONDS:
                    del self.budgets[key]
            giving_back, self.giving_back = self.giving_back, []
        for windows, unspent, ends in giving_back:
            try:
                self.storage.release_windows(windows, unspent, ends)
            except Exception as error:  # the requests stay counted: the window refuses early
                log.warning("cannot give back %d leased requests: %s", unspent, error)
        if now >= self.next_beat:
            self.beat(now)

    def beat(self, now: float, leave: bool = False) -> None:
        """Note this worker in the storage's set of workers; learn how many share the limits."""
        self.next_beat = now + BEAT_SECONDS
        try:
            sharers = self.storage.workers(self.workers_key, self.member, BEAT_HORIZON, leave)
        except Exception as error:  # the last number known stands
            log.debug("cannot note this worker's heartbeat: %s", error)
            return
        if not leave:
            self.sharers = max(1, sharers)

    def give_back_all(self) -> None:
        """At exit: every unspent lease back, and this worker off the set of workers."""
        with self.lock:
            for budget in self.budgets.values():
                self.give_back_later(budget)
                budget.refused = []
        self.next_beat = math.inf
        self.sweep()
        self.beat(time.time(), leave=True)


def counted(items: tuple[RateLimitItem, ...], counts: list[Counted]) -> list[Result]:
    """(within the limit, remaining, reset) of each item from its window's count after a request."""
    return [
        (count <= item.amount, max(0, item.amount - count), reset)
        for item, (count, reset) in zip(items, counts, strict=False)
    ]


def spent(items: tuple[RateLimitItem, ...], counts: list[Counted]) -> list[Result]:
    """A refused lease's answer: each item up to the first one spent (at its limit), nothing left."""
    results: list[Result] = []
    for item, (count, reset) in zip(items, counts, strict=False):
        results.append((count < item.amount, 0, reset))
        if count >= item.amount:
            break
    return results


def sweep_in_this_process(leases: Leases) -> bool:
    """The keeper's step, every SWEEP_SECONDS until the limiter is gone or the process is not
    the one that started it: `Leases.sweep`."""
    if leases.pid != os.getpid():
        return False
    leases.sweep()
    return True


def give_back_at_exit(leases_ref: weakref.ref[Leases]) -> None:
    """A stopping worker gives its leases back, within EXIT_SECONDS (the storage's timeout)."""
    leases = leases_ref()
    if leases is None or leases.pid != os.getpid():
        return
    done = threading.Thread(target=leases.give_back_all, name="petstore-leases-exit", daemon=True)
    done.start()
    done.join(EXIT_SECONDS)
