"""The audit trail of operator actions: each `petstore` command that changes a key appends a row."""

from __future__ import annotations

import getpass
import os

from petstore.db import Connection
from petstore.queries import audit as audit_sql


def os_user() -> str:
    """Who runs the command: the login name (getpass), else the numeric uid."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no LOGNAME/USER and no passwd entry (a bare container)
        return str(os.getuid())


def record(conn: Connection, command: str, key_id: int | None, reason: str | None) -> None:
    """Append the action to audit_log, in the caller's transaction (with the change it records)."""
    audit_sql.insert_audit(conn, command, key_id, os_user(), reason or None)
