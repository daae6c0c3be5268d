"""What the `petstore` command's groups share: the settings, a connection, the exit statuses, the
table printer."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import click
import psycopg

from petstore import config
from petstore.db import Connection, connect

FROM_MAKE_RUN = "petstore.cli.from_make_run"
# Under var/ (PETSTORE_VAR_DIR): the URL of make run's embedded database, which `petstore serve`
# writes for the commands run beside it.
RECORDED_URL = "database-url"
INSTANT = "%Y-%m-%d %H:%M:%S%z"

REASON = click.option("--reason", help="Why: kept in the audit trail (petstore audit).")


# Exit statuses, one per kind of outcome (docs/cli.rst, "Exit statuses"): 0 done; 1 the command
# could not run (ClickException); 2 a usage error; 3 no such key; 4 nothing to do.
class BadInput(click.ClickException):
    """Input the command refuses before changing anything."""

    exit_code = 2


class NoSuchKey(click.ClickException):
    """The key the command names does not exist (or, to rotate, is not live)."""

    exit_code = 3


class NothingToDo(click.ClickException):
    """What the command would do is done already: nothing changed."""

    exit_code = 4


def parse_key_id(ctx: click.Context, param: click.Parameter, text: str | None) -> int | None:
    """A KEY_ID (or --key ID): a whole number that a key id can be (bigint); BadInput otherwise."""
    if text is not None and (not text.isdigit() or not 0 < int(text) <= 2**63 - 1):
        raise BadInput(f"KEY_ID {text!r} is not a key id: expected a whole number such as 12")
    return None if text is None else int(text)


KEY_ID = click.argument("key_id", metavar="KEY_ID", callback=parse_key_id)


def recorded_database_url() -> tuple[str, Path] | None:
    """The URL of `make run`'s embedded database as it recorded it under var/, and the file."""
    path = Path(os.environ.get("PETSTORE_VAR_DIR") or "var") / RECORDED_URL
    with contextlib.suppress(OSError):
        if url := path.read_text(encoding="utf-8").strip():
            return url, path
    return None


def load_settings(check: bool = True) -> dict[str, Any]:
    """The settings (a bad one in one line), checked for a command that connects: without
    DATABASE_URL, the embedded database `make run` recorded (said on stderr)."""
    try:
        settings = config.from_environ()
        if check:
            if not settings["DATABASE_URL"] and (recorded := recorded_database_url()):
                settings["DATABASE_URL"], path = recorded
                settings[FROM_MAKE_RUN] = True
                click.echo(
                    f"DATABASE_URL is not set: using the embedded database of `make run`, "
                    f"{settings['DATABASE_URL']} (from {path})",
                    err=True,
                )
            config.check(settings)
    except config.ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    return settings


@contextlib.contextmanager
def database(settings: dict[str, Any] | None = None) -> Iterator[Connection]:
    """A connection for one command; PostgreSQL's complaints become a one-line error, not a traceback."""
    settings = settings or load_settings()
    try:
        conn = connect(settings)
    except psycopg.Error as exc:
        reason = " ".join(str(exc).split())
        hint = (
            "; the embedded PostgreSQL runs while `make run` serves: start it, or set DATABASE_URL"
            if settings.get(FROM_MAKE_RUN)
            else ""
        )
        raise click.ClickException(f"cannot connect to PostgreSQL: {reason}{hint}") from None
    try:
        with conn:
            yield conn
    except psycopg.Error as exc:
        raise click.ClickException(f"PostgreSQL: {exc}") from None


def emit(rows: list[dict[str, Any]], columns: dict[str, str], output: str = "table") -> None:
    """Rows as an aligned table, CSV or JSON (a list of objects); `columns`: key -> heading."""
    rows = [
        {c: f"{row[c]:{INSTANT}}" if isinstance(row[c], datetime) else row[c] for c in columns}
        for row in rows
    ]
    if output == "json":
        click.echo(json.dumps(rows, default=str, indent=2))
        return
    if output == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows([["" if row[c] is None else row[c] for c in columns] for row in rows])
        click.echo(buffer.getvalue(), nl=False)
        return
    cells = [[("-" if row[c] is None else str(row[c])) for c in columns] for row in rows]
    lines = [list(columns.values()), *cells]
    widths = [max(map(len, column)) for column in zip(*lines, strict=True)]
    for line in lines:
        click.echo(
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        )
