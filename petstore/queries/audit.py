"""SQL over audit_log: the operators' actions, appended by the `petstore` command, never changed."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from petstore import tracing
from petstore.db import Connection


@tracing.statement
def insert_audit(
    conn: Connection, command: str, key_id: int | None, os_user: str, reason: str | None
) -> None:
    """Append one operator action to the audit trail."""
    conn.execute(
        """
        insert into audit_log (command, key_id, os_user, reason)
        values (%(command)s, %(key_id)s, %(os_user)s, %(reason)s)
        """,
        {"command": command, "key_id": key_id, "os_user": os_user, "reason": reason},
    )


@tracing.statement
def list_audit(
    conn: Connection, key_id: int | None = None, since: datetime | None = None
) -> list[dict[str, Any]]:
    """The audit trail, oldest first; one key's, or since an instant, when given."""
    return conn.execute(
        """
        select id,
               at,
               command,
               key_id,
               os_user,
               reason
          from audit_log
         where (%(key_id)s::bigint is null or key_id = %(key_id)s)
           and (%(since)s::timestamptz is null or at >= %(since)s)
         order by at, id
        """,
        {"key_id": key_id, "since": since},
    ).fetchall()
