"""Scratch databases on the test server: created empty, dropped afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import conninfo, sql

from petstore import config
from petstore.ratelimit import bans


@contextmanager
def empty_database(database_url: str, suffix: str) -> Iterator[str]:
    """A new, empty database named after the test database plus `suffix`; its URL. Dropped on exit."""
    dbname = f"{conninfo.conninfo_to_dict(database_url)['dbname']}{suffix}"
    admin_url = conninfo.make_conninfo(database_url, dbname="postgres")
    drop = sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(dbname))
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(drop)
        admin.execute(sql.SQL("create database {}").format(sql.Identifier(dbname)))
    try:
        yield conninfo.make_conninfo(database_url, dbname=dbname)
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(drop)


def store_ban(conn: psycopg.Connection[Any], key_id: int, seconds: int) -> dict[str, Any] | None:
    """A ban of `seconds` for key `key_id`, stored as the service stores one, with the default
    escalation settings (petstore.config); None when the key is banned already."""
    defaults = config.from_environ({"DATABASE_URL": "postgresql://"})
    return bans.ban_key(conn, {**defaults, "BAN_SECONDS": seconds}, key_id, strikes=10)
