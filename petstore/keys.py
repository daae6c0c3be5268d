"""Issuing keys: making, hashing and rotating their secrets (auth.py asks who is calling)."""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from petstore.db import Connection, get_conn
from petstore.queries import keys as key_sql

KEY_PREFIX = "ps_"
# "ps_" + 43 characters of base64url: 256 random bits.
KEY_SHAPE = re.compile(r"ps_[A-Za-z0-9_-]{43}")

# What a key may do (sql/0005): GET operations need read, POST ones write. New keys get both.
SCOPES = ("read", "write")


def new_key() -> str:
    """A fresh random API key, to be shown once and stored only as its hash."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def find_key(key_hash: bytes) -> dict[str, Any] | None:
    """The row of the key with this secret's hash, on the request's connection (what the key
    cache asks on a miss)."""
    return key_sql.find_key_by_hash(get_conn(), key_hash)


def hash_key(key: str) -> bytes:
    """The stored form of a key (sha256: keys are random, so no slow hash is needed)."""
    return hashlib.sha256(key.encode()).digest()


def display_prefix(key: str) -> str:
    """The start of a key, shown in listings so people can tell keys apart."""
    return key[: len(KEY_PREFIX) + 8]


def issue_key(
    conn: Connection,
    plan: str,
    label: str = "",
    per_minute: int | None = None,
    per_day: int | None = None,
    expires_at: datetime | None = None,
    scopes: Sequence[str] = SCOPES,
) -> tuple[str, dict[str, Any]]:
    """Make a key and store its hash; return (key, row): the only time the key exists in clear."""
    key = new_key()
    row = key_sql.insert_key(
        conn,
        key_hash=hash_key(key),
        prefix=display_prefix(key),
        label=label,
        plan=plan,
        per_minute=per_minute,
        per_day=per_day,
        expires_at=expires_at,
        scopes=scopes,
    )
    return key, row


def rotate_key(
    conn: Connection, key_id: int, grace_seconds: int
) -> tuple[str, dict[str, Any]] | None:
    """A new secret for the key `key_id`, its old one valid `grace_seconds` more; None: no such key.

    Same row, same id: budgets, strikes and bans are keyed by the id, so they carry over.
    """
    key = new_key()
    row = key_sql.rotate_key(
        conn,
        key_id,
        key_hash=hash_key(key),
        prefix=display_prefix(key),
        grace_seconds=grace_seconds,
    )
    return None if row is None else (key, row)
