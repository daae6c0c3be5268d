"""Who is calling: bearer parsing, key lookup, 401s. The one place the caller is identified."""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Callable
from typing import Any, TypeVar

from flask import current_app, g, request

from petstore.db import Connection, first_query
from petstore.errors import DATABASE_UNAVAILABLE, APIError
from petstore.queries import keys
from petstore.web import in_api

KEY_PREFIX = "ps_"
# "ps_" + 43 characters of base64url: 256 random bits.
KEY_SHAPE = re.compile(r"ps_[A-Za-z0-9_-]{43}")
REALM = 'Bearer realm="petstore"'

F = TypeVar("F", bound=Callable[..., Any])


def new_key() -> str:
    """A fresh random API key, to be shown once and stored only as its hash."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


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
) -> tuple[str, dict[str, Any]]:
    """Make a key and store its hash; return (key, row): the only time the key exists in clear."""
    key = new_key()
    row = keys.insert_key(
        conn,
        key_hash=hash_key(key),
        prefix=display_prefix(key),
        label=label,
        plan=plan,
        per_minute=per_minute,
        per_day=per_day,
    )
    return key, row


def public(view: F) -> F:
    """Mark a view as answering without a key (health, API description)."""
    view.public = True  # type: ignore[attr-defined]
    return view


def bearer_token() -> str | None:
    """The token of an `Authorization: Bearer <token>` header (scheme case-insensitive)."""
    parts = request.headers.get("Authorization", "").split()
    if len(parts) == 2 and parts[0].lower() == "bearer":
        return parts[1]
    return None


def unauthorized(message: str, token_given: bool) -> APIError:
    challenge = f'{REALM}, error="invalid_token"' if token_given else REALM
    return APIError(401, message, headers={"WWW-Authenticate": challenge})


def needs_key() -> bool:
    """Every /v1 path needs a key, unknown ones included, except views marked public."""
    if request.endpoint is not None:
        view = current_app.view_functions.get(request.endpoint)
        return not getattr(view, "public", False)
    return in_api()


def identify_caller() -> None:
    """Find the key of the request; refuse nothing yet.

    Sets g.caller to the key's row (id, plan, per_minute, per_day, banned_until),
    or to None and g.refusal to the error to answer. Refusing happens later, in
    require_caller, so that the rate limiter can count refused requests per IP.
    """
    g.caller = None
    g.refusal = None
    if not needs_key():
        return
    token = bearer_token()
    if token is None:
        g.refusal = unauthorized(
            "An API key is required: send 'Authorization: Bearer <key>'.", False
        )
        return
    try:
        row = (
            first_query(keys.find_key_by_hash, hash_key(token))
            if KEY_SHAPE.fullmatch(token)
            else None
        )
    except DATABASE_UNAVAILABLE as exc:
        g.refusal = exc
        return
    if row is None:
        g.refusal = unauthorized("The API key is not valid.", True)
        return
    g.caller = row


def require_caller() -> None:
    """Answer the refusal identify_caller found (401, or 503 when the database is down)."""
    if g.refusal is not None:
        raise g.refusal
