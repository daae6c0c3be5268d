"""GET /v1/usage: the calling key's own requests per UTC day or hour, by outcome (petstore.usage)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from flask import Response

from petstore import openapi, schemas, usage
from petstore.auth import current_caller
from petstore.db import get_conn
from petstore.errors import APIError
from petstore.queries import usage as usage_sql
from petstore.web import json_response, validate_query

bp = openapi.Resource(
    "usage",
    __name__,
    tag="usage",
    tag_description="The calling key's own requests, per UTC day or hour, by outcome.",
    schemas={"Usage": schemas.UsageSchema},
)

# The longest range of one answer, by granularity: 90 days of days, 7 days of hours.
LONGEST = {"day": 90, "hour": 7}


def get_usage_operation(config: openapi.Settings) -> openapi.Object:
    """getUsage's Operation Object."""
    return openapi.operation_object(
        "The calling key's own requests per UTC day or hour, by outcome",
        "Counts of the calling key only, never another key's; the `read` scope is enough. "
        "`from` and `to` are UTC dates, both included, today by default; at most "
        f"{LONGEST['day']} days of days or {LONGEST['hour']} days of hours. One bucket per "
        "period that has requests, oldest first. A request is in its bucket within 10 seconds "
        "of its answer. Counted and rate-limited like any other request.",
        openapi.ok(200, "Usage", "The key's requests per period."),
        openapi.errors(400, openapi.lacks_scope("read")),
        parameters=[{"in": "query", "schema": schemas.UsageQuery}],
    )


def requested_range(query: Mapping[str, Any], today: date) -> tuple[date, date]:
    """(from, to) of the query, both included; a 400 when reversed or too long."""
    since, until = query.get("since", today), query.get("until", today)
    if until < since:
        raise APIError(400, f"The range is reversed: from {since} is after to {until}.")
    longest = LONGEST[query["granularity"]]
    if (until - since).days + 1 > longest:
        raise APIError(
            400,
            f"The range is too long: at most {longest} days with granularity "
            f"{query['granularity']}.",
        )
    return since, until


def bucket(row: Mapping[str, Any]) -> dict[str, Any]:
    """One period's counts, as UsageBucketSchema shows them."""
    outcomes = {
        "ok": row["requests_2xx"],
        "client_error": row["requests_4xx"],
        "too_many": row["requests_429"],
        "server_error": row["requests_5xx"],
    }
    return {
        "start": row["start"].astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "requests": sum(outcomes.values()),
        "outcomes": outcomes,
    }


@bp.operation("/usage", "get", "getUsage", get_usage_operation)
def get_usage() -> Response:
    """getUsage: the caller's requests per day or hour between two UTC dates."""
    query = validate_query(schemas.usage_query)
    since, until = requested_range(query, datetime.now(UTC).date())
    key_id, _plan = usage.caller_key(current_caller())
    rows = usage_sql.usage_of_key(
        get_conn(),
        key_id,
        datetime.combine(since, time(), UTC),
        datetime.combine(until + timedelta(days=1), time(), UTC),
        query["granularity"],
    )
    body = schemas.usage.dumps(
        {
            "key_id": key_id,
            "granularity": query["granularity"],
            "since": since.isoformat(),
            "until": until.isoformat(),
            "usage": [bucket(row) for row in rows],
        }
    )
    return json_response(body)
