"""Scratch databases on the test server: created empty, dropped afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg import conninfo, sql


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
