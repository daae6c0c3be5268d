"""Durable writes: no 201 for a commit the synchronous standby may not have. Each worker's commit
watch cancels a write still running past its bound, and durable_write turns such a commit into
CommitNotReplicated (a 503)."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from flask import Flask, current_app
from psycopg.errors import Diagnostic

from petstore import tracing
from petstore.db import Connection

log = logging.getLogger(__name__)

# A write still unanswered this long after its statement timeout is cancelled (seconds): the
# statement timeout does not cover a commit's wait for the synchronous standby.
COMMIT_WAIT_MARGIN = 1.0
# How often the commit watch looks for writes past their bound (seconds).
COMMIT_WATCH_INTERVAL = 0.2


def init_app(app: Flask) -> None:
    """Give the app (one per process) its commit watch; its thread starts on the first write."""
    app.extensions["petstore.commit_watch"] = CommitWatch()


class CommitNotReplicated(psycopg.OperationalError):
    """A commit whose wait for the synchronous standby was cancelled: it is on this server only."""


def replication_wait_cancelled(diagnostic: Diagnostic) -> bool:
    """Whether a notice is PostgreSQL's WARNING that a commit stopped waiting for the standby.

    "canceling wait for synchronous replication due to user request" (a cancel), or "canceling
    the wait for synchronous replication and terminating connection ..." (a shutdown), both with
    "The transaction has already committed locally, but might not have been replicated to the
    standby.". Its SQLSTATE is the generic 01000 (or 57P01), so only the English text tells it;
    durable_write does not depend on it (a write the watch cancelled that then returns is one).
    """
    return "wait for synchronous replication" in (diagnostic.message_primary or "")


class CommitWatch:
    """One thread per process that cancels the writes still running past their deadline.

    Cancelling a commit that waits for the synchronous standby ends the wait: PostgreSQL keeps
    the commit locally and says so in a WARNING, which durable_write turns into a 503. The thread
    looks every COMMIT_WATCH_INTERVAL rather than being woken: a write pays a lock and two dict
    operations, never a thread switch.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._due: dict[int, tuple[float, Connection]] = {}
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, conn: Connection, seconds: float) -> int:
        """Cancel `conn`'s statement in `seconds` (give or take the interval) unless unwatch(token)."""
        token = next(self._tokens)
        with self._lock:
            self._due[token] = (time.monotonic() + seconds, conn)
            # Started on first use, in the worker: a thread of gunicorn's master is not forked.
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="petstore-commit-watch", daemon=True
                )
                self._thread.start()
        return token

    def unwatch(self, token: int) -> bool:
        """The write ended: no cancel. Whether it was cancelled meanwhile (the watch took it)."""
        with self._lock:
            return self._due.pop(token, None) is None

    def _run(self) -> None:
        while True:
            time.sleep(COMMIT_WATCH_INTERVAL)
            now = time.monotonic()
            with self._lock:
                expired = [token for token, (due, _) in self._due.items() if due <= now]
                conns = [self._due.pop(token)[1] for token in expired]
            for conn in conns:
                # psycopg's cancel may come from another thread; it connects to the server, so
                # each in a thread of its own: a silent server holds up no other cancel.
                threading.Thread(target=_cancel, args=(conn,), daemon=True).start()


def _cancel(conn: Connection) -> None:
    try:
        conn.cancel()
    except psycopg.Error as exc:  # closed meanwhile, or the server unreachable: nothing to end
        log.warning("could not cancel a write past its bound: %s", exc)


@contextmanager
def durable_write(conn: Connection) -> Iterator[None]:
    """Around a write and its commit: past the block, the commit is on the synchronous standby.

    A commit waits for the synchronous standby, and the statement timeout does not bound that
    wait: PostgreSQL disables it before committing (finish_xact_command in postgres.c). A primary
    whose standby was promoted behind its back (its Patroni dead) makes that wait endless. So a
    write still running DB_STATEMENT_TIMEOUT_MS + COMMIT_WAIT_MARGIN after it began is cancelled.
    A cancelled wait leaves the commit on this server only, which a failover may throw away:
    PostgreSQL says so in a WARNING, and the block raises CommitNotReplicated (a 503 with
    Retry-After; the client's retry with its Idempotency-Key finds the record only where the
    commit is, and idempotency.replay waits for it to be replicated before answering). A block
    that returns after the watch cancelled it raises the same, WARNING or not: in another
    lc_messages the WARNING's text is not recognised, and a cancel that came too late to end
    anything cannot be told from one that ended the wait.
    """
    cancelled: list[str] = []

    def notice(diagnostic: Diagnostic) -> None:
        # Read now: the diagnostic's fields are gone once the callback returns.
        if replication_wait_cancelled(diagnostic):
            cancelled.append(f"{diagnostic.message_primary} ({diagnostic.message_detail})")

    bound = current_app.config["DB_STATEMENT_TIMEOUT_MS"] / 1000 + COMMIT_WAIT_MARGIN
    watch: CommitWatch = current_app.extensions["petstore.commit_watch"]
    # Its statements' spans include their commits' waits for the synchronous standby
    # (autocommit); a transaction's commit, and its wait, is the time past them.
    with tracing.span("durable.write"):
        conn.add_notice_handler(notice)
        token = watch.watch(conn, bound)
        try:
            yield
        finally:
            watched_out = watch.unwatch(token)
            conn.remove_notice_handler(notice)
            if watched_out:
                # The watch's cancel may still be on its way: no later statement may meet it.
                # The pool replaces a connection that comes back closed.
                conn.close()
        if cancelled:
            raise CommitNotReplicated(cancelled[0])
        if watched_out:
            raise CommitNotReplicated(f"the write was cancelled after {bound:g} s")
