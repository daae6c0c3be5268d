"""Idempotency-Key on POST: the first response for (API key, idempotency key) is replayed for 24 hours."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from typing import Any

import psycopg
from flask import Response, current_app, request

from petstore import metrics
from petstore.db import Connection
from petstore.errors import APIError
from petstore.queries import idempotency as idempotency_sql

HEADER = "Idempotency-Key"
# Printable ASCII, 1 to 255 characters: what Stripe accepts (a UUID fits comfortably).
KEY_SHAPE = re.compile(r"[\x20-\x7e]{1,255}")


def requested_key() -> str | None:
    """The request's Idempotency-Key, None when it has none; 400 when it is malformed."""
    value = request.headers.get(HEADER)
    if value is None:
        return None
    value = value.strip()
    if not KEY_SHAPE.fullmatch(value):
        raise APIError(400, f"{HEADER} must be 1 to 255 printable ASCII characters.")
    return value


def fingerprint(payload: Any) -> bytes:
    """sha256 of the validated payload, independent of the body's spacing and key order."""
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).digest()


def replay(
    conn: Connection, key_id: int, key: str, stored: dict[str, Any], digest: bytes
) -> Response:
    """The recorded response again, or 409 Conflict when the key came with a different request.

    Only once the record is on the synchronous standby: the first answer may have been a 503
    because its commit's wait for the standby was cancelled (durable.durable_write), the record then
    on this server alone. Writing it again waits for the standby (within durable_write's bound).
    """
    if bytes(stored["fingerprint"]) != digest:
        raise APIError(
            409,
            f"This {HEADER} was already used with a different request body; "
            "use a new key for a new request.",
            "idempotency_key_reused",
        )
    idempotency_sql.rewrite_record(conn, key_id=key_id, idempotency_key=key)
    response = current_app.response_class(
        stored["body"], status=stored["status"], mimetype="application/json"
    )
    if stored["location"]:
        response.headers["Location"] = stored["location"]
    response.headers["Idempotent-Replayed"] = "true"
    metrics.idempotent_replayed()
    return response


def once(
    conn: Connection, key_id: int, key: str, payload: Any, work: Callable[[Connection], Response]
) -> Response:
    """Run `work` for the first request of the API key `key_id` with the Idempotency-Key `key`;
    replay its response to the others.

    The work and the record of its response share one transaction. A request racing the first
    one waits on the record's primary key, then rolls its own work back and replays.
    """
    digest = fingerprint(payload)
    stored = idempotency_sql.find_response(conn, key_id=key_id, idempotency_key=key)
    if stored is not None:
        return replay(conn, key_id, key, stored, digest)
    response: Response | None = None
    with conn.transaction():
        response = work(conn)
        claimed = idempotency_sql.claim(
            conn,
            key_id=key_id,
            idempotency_key=key,
            fingerprint=digest,
            status=response.status_code,
            body=response.get_data(as_text=True),
            location=response.headers.get("Location"),
        )
        if not claimed:
            response = None
            raise psycopg.Rollback()
    if response is not None:
        return response
    stored = idempotency_sql.find_response(conn, key_id=key_id, idempotency_key=key)
    assert stored is not None, "a claim lost to a committed record"
    return replay(conn, key_id, key, stored, digest)
