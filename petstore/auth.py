"""Who is calling: bearer parsing, key lookup, 401s. The one place the caller is identified."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

from flask import Flask, current_app, g, request

from petstore import keycache, tracing
from petstore.caller import Caller, caller_at
from petstore.db import Connection
from petstore.errors import APIError
from petstore.keys import KEY_SHAPE, SCOPES, find_key, hash_key
from petstore.queries import keys as key_sql

REALM = 'Bearer realm="petstore"'
# RFC 6750: the scheme in any case, then one or more spaces (only spaces: a no-break space
# or a tab is no separator), then the token; ASCII only, so no Unicode case folding either.
BEARER = re.compile(r"bearer +(.+)", re.IGNORECASE | re.ASCII | re.DOTALL)

F = TypeVar("F", bound=Callable[..., Any])

# The methods that only read; any other needs write unless its view says otherwise (default deny).
READ_METHODS = frozenset(("GET", "HEAD"))


def public(view: F) -> F:
    """Mark a view as answering without a key (health, API description)."""
    view.public = True  # type: ignore[attr-defined]
    return view


def needs_scope(scope: str) -> Callable[[F], F]:
    """Mark a view as needing `scope` of the key, instead of its method's (see require_scope)."""
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}")

    def mark(view: F) -> F:
        view.scope = scope  # type: ignore[attr-defined]
        return view

    return mark


def uncounted(view: F) -> F:
    """Mark a view that a valid key calls without spending budget, even while throttled or banned.

    Requests without a valid key still spend their address's budget and get the 401.
    """
    view.uncounted = True  # type: ignore[attr-defined]
    return view


def current_view() -> Callable[..., Any] | None:
    """The view function the request is routed to, if any."""
    if request.endpoint is None:
        return None
    view: Callable[..., Any] | None = current_app.view_functions.get(request.endpoint)
    return view


def require_scope(caller: Caller | None, view: Callable[..., Any] | None) -> None:
    """403 insufficient_scope when the key lacks the scope its view needs (RFC 6750).

    A view needs the scope its mark (needs_scope) names, else its method's: read for GET and
    HEAD, write for every other, so a view that forgets the mark never lets a read key write.
    After counting: the 403 spends budget like any other answer.
    """
    if caller is None or view is None:
        return
    scope = getattr(view, "scope", None) or method_scope(request.method)
    if scope not in caller.scopes:
        raise APIError(
            403,
            f"This API key lacks the {scope!r} scope this operation needs.",
            "insufficient_scope",
            headers={"WWW-Authenticate": f'{REALM}, error="insufficient_scope", scope="{scope}"'},
        )


def method_scope(method: str) -> str:
    """The scope a request with this method needs when its view names none."""
    return "read" if method in READ_METHODS else "write"


def bearer_token(header: str) -> str | None:
    """The token of an `Authorization: Bearer <token>` header value, else None.

    The token is checked against KEY_SHAPE (a token68) by the caller: a malformed one is an
    invalid token, not a missing one.
    """
    match = BEARER.fullmatch(header)
    return match[1] if match else None


def unauthorized(message: str, token_given: bool) -> APIError:
    challenge = f'{REALM}, error="invalid_token"' if token_given else REALM
    return APIError(401, message, headers={"WWW-Authenticate": challenge})


def needs_key(view: Callable[..., Any] | None) -> bool:
    """Every /v1 path needs a key, unknown ones included, except views marked public."""
    return not getattr(view, "public", False)


def identify_caller(view: Callable[..., Any] | None) -> tuple[Caller | None, APIError | None]:
    """(the caller, None), or (None, the 401 to answer): who is calling `view` (current_view()),
    refusing nothing yet.

    The caller comes from the worker's key cache or the database (petstore.keycache). Refusing
    happens later, in
    require_caller, so that a request without a valid key spends its address's budget first.
    When the database cannot be asked, its error propagates: a 503, and no budget is spent.
    """
    if not needs_key(view):
        return None, None
    token = bearer_token(request.headers.get("Authorization", ""))
    if token is None:
        return None, unauthorized(
            "An API key is required: send 'Authorization: Bearer <key>'.", False
        )
    with tracing.span("auth.key_lookup"):
        caller = (
            keycache.current().caller(hash_key(token), find_key)
            if KEY_SHAPE.fullmatch(token)
            else None
        )
    if caller is None:
        return None, unauthorized("The API key is not valid.", True)
    if caller.expired:
        # Known, but past its expiry: a message of its own, so its holder knows to get a new one.
        return None, unauthorized("The API key has expired.", True)
    return caller, None


def current_caller() -> Caller:
    """The caller the pipeline identified for this request: views that need a key have one."""
    caller: Caller = g.caller
    return caller


def kept_key_caller(conn: Connection, key: str) -> Caller | None:
    """The caller `key` names in `conn`'s database now, past the key cache; None unless the key
    is valid and unexpired (make run asks this of the key it kept from an earlier run)."""
    key_hash = hash_key(key)
    row = key_sql.find_key_by_hash(conn, key_hash)
    caller = None if row is None else caller_at(row, key_hash, time.time())
    return None if caller is None or caller.expired else caller


def init_app(app: Flask) -> None:
    """Give the app (one per process) its cache of key rows, sized by the settings."""
    app.extensions[keycache.EXTENSION] = keycache.KeyCache(
        app.config["KEY_CACHE_SECONDS"], app.config["KEY_CACHE_SIZE"]
    )


def require_caller(refusal: APIError | None) -> None:
    """Answer the refusal identify_caller found."""
    if refusal is not None:
        raise refusal
