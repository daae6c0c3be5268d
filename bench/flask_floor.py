"""The bare-Flask floor: what Flask itself allows for the service's essential work, written plainly.

The same bearer key and key query (petstore.keys.hash_key, keys.find_key_by_hash), the same SQL
(petstore.queries.pets), the same JSON bodies and headers, a per-key fixed-window counter per
minute and per day with X-RateLimit-Limit/-Remaining/-Reset (the limit nearest to running out),
errors in the service's Error shape, a pool made by petstore.db.open_pool. No marshmallow, no
flask-limiter, no request log. The counter is in-process for memory://; with
RATELIMIT_STORAGE_URI=redis://... it counts in Redis, one Lua call (INCR, EXPIRE, PTTL) per window.
Served by the same gunicorn config as the service:

    gunicorn -c deploy/gunicorn.conf.py 'bench.flask_floor:create_flask_floor()'
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

import redis
from flask import Flask, Response, current_app, g, json, request
from werkzeug.exceptions import HTTPException
from werkzeug.http import http_date

from petstore import config, db
from petstore.keys import hash_key
from petstore.plans import PLAN_LIMITS
from petstore.queries import keys, pets
from petstore.schemas import DIGITS, INT64_MAX, PET_STATUSES

WINDOWS = (("minute", 60), ("day", 86_400))
INCR_EXPIRE_PTTL = """
local count = redis.call("incr", KEYS[1])
if count == 1 then
    redis.call("expire", KEYS[1], ARGV[1])
end
return {count, redis.call("pttl", KEYS[1])}
"""


class Refused(Exception):
    """An answer in the Error shape: status, code, message, extra headers."""

    def __init__(
        self, status: int, code: str, message: str, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers = dict(headers or {})


class MemoryCounter:
    """Fixed windows in a dict: a window starts at its first hit and ends `seconds` later."""

    def __init__(self) -> None:
        self.windows: dict[str, list[float]] = {}  # key -> [ends at, count]
        self.lock = threading.Lock()

    def hit(self, key: str, seconds: int) -> tuple[int, float]:
        """Count one request; (count in the window, when the window ends)."""
        now = time.time()
        with self.lock:
            window = self.windows.get(key)
            if window is None or window[0] <= now:
                window = self.windows[key] = [now + seconds, 0]
            window[1] += 1
            return int(window[1]), window[0]


class RedisCounter:
    """Fixed windows in Redis: one Lua call per window counts, starts the expiry, reads it."""

    def __init__(self, uri: str, timeout: float) -> None:
        client = redis.Redis.from_url(uri, socket_timeout=timeout, socket_connect_timeout=timeout)
        self.script = client.register_script(INCR_EXPIRE_PTTL)

    def hit(self, key: str, seconds: int) -> tuple[int, float]:
        """Count one request; (count in the window, when the window ends)."""
        count, ttl_ms = self.script(keys=[f"flask-floor/{key}"], args=[seconds])
        return int(count), time.time() + max(int(ttl_ms), 0) / 1000


def error(
    status: int, code: str, message: str, headers: Mapping[str, str] | None = None
) -> Response:
    """An Error JSON response."""
    body = json.dumps({"code": code, "message": message, "status": status})
    return Response(body + "\n", status, headers=dict(headers or {}), mimetype="application/json")


def count(caller: dict[str, Any]) -> None:
    """Spend one request of the key's minute and day budgets; 429 when one is spent."""
    minute, day = PLAN_LIMITS.get(caller["plan"], (0, 0))
    amounts = (caller["per_minute"] or minute, caller["per_day"] or day)
    counter: MemoryCounter | RedisCounter = current_app.extensions["counter"]
    shown: tuple[int, int, float] | None = None
    for (name, seconds), amount in zip(WINDOWS, amounts, strict=True):
        hits, ends = counter.hit(f"{caller['id']}/{name}", seconds)
        remaining = max(0, amount - hits)
        if hits > amount:
            g.rate_limit = (amount, 0, ends)
            raise Refused(
                429,
                "rate_limited",
                f"Rate limit exceeded: {amount} per {name}.",
                {"Retry-After": str(max(1, math.ceil(ends - time.time())))},
            )
        if shown is None or remaining < shown[1]:
            shown = (amount, remaining, ends)
    g.rate_limit = shown


def identify_and_count() -> None:
    """Every /v1 request needs a live, unbanned key with budget left."""
    g.conn = None
    g.rate_limit = None
    if not request.path.startswith("/v1/"):
        return
    parts = request.headers.get("Authorization", "").split()
    if len(parts) != 2 or parts[0].lower() != "bearer":
        raise Refused(401, "unauthorized", "An API key is required.")
    g.conn = current_app.extensions["pool"].getconn()
    caller = keys.find_key_by_hash(g.conn, hash_key(parts[1]))
    if caller is None:
        raise Refused(401, "unauthorized", "The API key is not valid.")
    if caller["banned_until"] is not None:
        raise Refused(429, "api_key_banned", "This API key is banned.")
    count(caller)


def rate_limit_headers(response: Response) -> Response:
    """X-RateLimit-* of the limit nearest to running out (or the one spent)."""
    if g.get("rate_limit") is not None:
        limit, remaining, ends = g.rate_limit
        response.headers["X-RateLimit-Limit"] = str(limit)
        response.headers["X-RateLimit-Remaining"] = str(remaining)
        response.headers["X-RateLimit-Reset"] = str(math.ceil(ends))
    return response


def release_connection(exc: BaseException | None) -> None:
    """Give the request's connection back to the pool."""
    conn = g.pop("conn", None)
    if conn is not None:
        current_app.extensions["pool"].putconn(conn)


def query_integer(text: str | None, default: int, low: int, high: int) -> int | None:
    """An integer query parameter in range, its default when absent, None when invalid."""
    if text is None:
        return default
    if not DIGITS.fullmatch(text) or not low <= int(text) <= high:
        return None
    return int(text)


def list_pets() -> Response:
    """One page by id ascending; a Link rel=next when the page is full."""
    args = request.args
    limit = query_integer(args.get("limit"), 20, 1, 100)
    after = query_integer(args.get("after"), 0, 0, INT64_MAX)
    status = args.get("status")
    unknown = set(args) - {"limit", "after", "status"}
    if limit is None or after is None or status not in (None, *PET_STATUSES) or unknown:
        raise Refused(400, "invalid_request", "Invalid query.")
    if status is None:
        page = pets.list_pets(g.conn, after=after, limit=limit)
    else:
        page = pets.list_pets_by_status(g.conn, status=status, after=after, limit=limit)
    headers = {}
    if page["count"] == limit:
        params: dict[str, Any] = {"limit": limit, "after": page["last_id"]}
        if status is not None:
            params["status"] = status
        headers["Link"] = f'</v1/pets?{urlencode(params)}>; rel="next"'
    return Response(page["pets"] + "\n", headers=headers, mimetype="application/json")


def create_pet() -> Response:
    """Store a new pet; 201 with its JSON and Location."""
    new_pet = request.get_json(silent=True)
    if (
        not isinstance(new_pet, dict)
        or not isinstance(new_pet.get("name"), str)
        or type(new_pet.get("categoryId")) is not int
        or new_pet.get("status") not in (None, *PET_STATUSES)
    ):
        raise Refused(400, "invalid_request", "Invalid pet.")
    row = pets.insert_pet(
        g.conn,
        name=new_pet["name"],
        category_id=new_pet["categoryId"],
        status=new_pet.get("status"),
    )
    headers = {"Location": f"/v1/pets/{row['id']}"}
    return Response(row["pet"] + "\n", 201, headers=headers, mimetype="application/json")


def get_pet(pet_id: str) -> Response:
    """One pet (deprecated), with Deprecation, Sunset and its successor's Link."""
    settings = current_app.config
    headers = {
        "Deprecation": f"@{settings['DEPRECATED_AT']}",
        "Sunset": http_date(settings["SUNSET"]),
        "Link": '</v1/pets>; rel="successor-version"',
    }
    pet = None
    if DIGITS.fullmatch(pet_id) and int(pet_id) <= INT64_MAX:
        pet = pets.find_pet(g.conn, int(pet_id))
    if pet is None:
        raise Refused(404, "not_found", "No pet with this id.", headers)
    return Response(pet + "\n", headers=headers, mimetype="application/json")


def healthz() -> Response:
    """Up."""
    return Response('{"status": "ok"}\n', mimetype="application/json")


def refused(exc: Refused) -> Response:
    """Refused -> its Error JSON."""
    return error(exc.status, exc.code, exc.message, exc.headers)


def http_error(exc: HTTPException) -> Response:
    """werkzeug's 404, 405 ... -> Error JSON."""
    status = exc.code or 500
    return error(status, exc.name.lower().replace(" ", "_"), exc.description or exc.name)


def create_flask_floor(settings: Mapping[str, Any] | None = None) -> Flask:
    """The app, its pool and its counter; settings from the environment, then `settings`.

    gunicorn calls it in each worker (`bench.flask_floor:create_flask_floor()`), after the fork.
    """
    app = Flask(__name__)
    app.config.update(config.from_environ())
    app.config.update(settings or {})
    config.check(app.config)
    app.extensions["pool"] = db.open_pool(app.config, name="flask-floor")
    storage = app.config["RATELIMIT_STORAGE_URI"]
    app.extensions["counter"] = (
        RedisCounter(storage, app.config["REDIS_TIMEOUT"])
        if storage.startswith(("redis://", "rediss://"))
        else MemoryCounter()
    )
    app.before_request(identify_and_count)
    app.after_request(rate_limit_headers)
    app.teardown_request(release_connection)
    app.register_error_handler(Refused, refused)
    app.register_error_handler(HTTPException, http_error)
    app.add_url_rule("/healthz", view_func=healthz)
    app.add_url_rule("/v1/pets", view_func=list_pets, methods=["GET"])
    app.add_url_rule("/v1/pets", view_func=create_pet, methods=["POST"])
    app.add_url_rule("/v1/pets/<pet_id>", view_func=get_pet, methods=["GET"])
    return app
