"""SQL over the idempotency_requests table."""

from __future__ import annotations

from typing import Any

from petstore import tracing
from petstore.db import Connection


@tracing.statement
def claim(
    conn: Connection,
    *,
    key_id: int,
    idempotency_key: str,
    fingerprint: bytes,
    status: int,
    body: str,
    location: str | None,
) -> bool:
    """Record the response to a first request with this key; False if one is already recorded.

    Run inside the transaction that does the request's work: a concurrent request with the same
    key waits on the primary key until that transaction ends, then finds the recorded response
    (or, if it rolled back, records its own). A record older than 24 hours is replaced.
    """
    row = conn.execute(
        """
        insert into idempotency_requests
               (key_id, idempotency_key, fingerprint, status, body, location)
        values (%(key_id)s, %(idempotency_key)s, %(fingerprint)s, %(status)s, %(body)s,
                %(location)s)
            on conflict (key_id, idempotency_key) do update
           set fingerprint = excluded.fingerprint,
               status = excluded.status,
               body = excluded.body,
               location = excluded.location,
               created_at = now()
         where idempotency_requests.created_at < now() - interval '24 hours'
        returning 1 as claimed
        """,
        {
            "key_id": key_id,
            "idempotency_key": idempotency_key,
            "fingerprint": fingerprint,
            "status": status,
            "body": body,
            "location": location,
        },
    ).fetchone()
    return row is not None


@tracing.statement
def find_response(conn: Connection, *, key_id: int, idempotency_key: str) -> dict[str, Any] | None:
    """The recorded response of this key's request, if younger than 24 hours."""
    return conn.execute(
        """
        select fingerprint,
               status,
               body,
               location
          from idempotency_requests
         where key_id = %(key_id)s
           and idempotency_key = %(idempotency_key)s
           and created_at >= now() - interval '24 hours'
        """,
        {"key_id": key_id, "idempotency_key": idempotency_key},
    ).fetchone()


@tracing.statement
def rewrite_record(conn: Connection, *, key_id: int, idempotency_key: str) -> None:
    """Write the record again, unchanged: its commit waits until the synchronous standby has it.

    A commit waits for the standby only when its transaction wrote something (PostgreSQL's
    RecordTransactionCommit): a read, or a bare transaction id, would not wait.
    """
    conn.execute(
        """
        update idempotency_requests
           set created_at = created_at
         where key_id = %(key_id)s
           and idempotency_key = %(idempotency_key)s
        """,
        {"key_id": key_id, "idempotency_key": idempotency_key},
    )


@tracing.statement
def delete_expired(conn: Connection) -> int:
    """Delete records older than 24 hours; return how many."""
    return conn.execute(
        "delete from idempotency_requests where created_at < now() - interval '24 hours'"
    ).rowcount
