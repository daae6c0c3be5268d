"""WSGI entry point: `gunicorn wsgi:app`, configured from the environment alone, read once here.

A bad or missing setting prints one line naming it and exits with status 4, gunicorn's "app failed
to load", so that its master stops instead of booting workers that fail the same way forever.
An unreachable database is one error line at start; the service runs and answers 503 until the
database answers.
"""

from __future__ import annotations

import logging
import sys

import psycopg
from flask import Flask

from petstore import config, create_app, db, logs

APP_LOAD_ERROR = 4

log = logging.getLogger("petstore.wsgi")


def load() -> Flask:
    """The app, or exit with one line on stderr when a setting is bad."""
    try:
        settings = config.from_environ()
        config.check(settings)
    except config.ConfigError as exc:
        print(f"petstore: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(APP_LOAD_ERROR) from None
    logs.configure(settings["LOG_LEVEL"])
    # Before the pool opens, so that this line comes before the pool's own retries.
    check_database(settings)
    return create_app(settings=settings)


def check_database(settings: dict[str, object]) -> None:
    """Say once, clearly, when the database does not answer at start (the pool keeps retrying).

    One connection attempt, bounded by PETSTORE_DB_CONNECT_TIMEOUT.
    """
    try:
        with db.connect(dict(settings)) as conn:
            conn.execute("select 1")
    except psycopg.Error as exc:
        reason = " ".join(str(exc).split())
        log.error(
            "PostgreSQL at DATABASE_URL does not answer (%s); serving 503 until it does",
            reason,
        )


app = load()
