"""The OpenAPI document of the API, built by apispec from the marshmallow schemas that validate requests."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from apispec import APISpec
from apispec.ext.marshmallow import MarshmallowPlugin
from werkzeug.http import http_date

from petstore import errors, schemas
from petstore.ratelimit import plans

# 3.0, not 3.1: in 3.1 (JSON Schema 2020-12) `1.0` is an integer, but this service refuses it
# for categoryId (a JSON integer literal is required); 3.0's Schema Object says the same as we do.
OPENAPI_VERSION = "3.0.3"
API_VERSION = "1.0.0"
SECURITY_SCHEME = "bearerAuth"
JSON = "application/json"

RATE_LIMIT_HEADERS = (
    "X-RateLimit-Limit",
    "X-RateLimit-Remaining",
    "X-RateLimit-Reset",
    "RateLimit-Policy",
    "RateLimit",
)

DESCRIPTION = """\
The Animal Store: list, add and fetch the animals ("pets") of a store's catalogue.

**Authentication.** Every operation needs an API key sent as a bearer token:
`Authorization: Bearer <key>`. A missing, malformed, unknown, revoked or expired key
gets 401. A key may be read-only: creating with it gets 403 `insufficient_scope`.

**Rate limits.** Each key spends one budget across the whole API, per minute and per day:
{plans}, enterprise as agreed. Requests without a valid key are counted per client IP. Every
response carries
`X-RateLimit-Limit`, `X-RateLimit-Remaining` and `X-RateLimit-Reset` (unix seconds) of the
limit in force: the breached one on a 429, else the one with the fewest requests left, and
the same as `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers-10). A 429
(`rate_limited`) says in `Retry-After` when to try again; wait that long and back off
exponentially. Each 429 is a strike, and its message says how many more refused requests in
the window ban the key and for how long: a key that keeps calling is banned for a while and every
request then gets 429 `api_key_banned`, with `Retry-After` until the ban ends. `GET /rate_limit`
shows a key its standing without spending budget, also while throttled or banned.

**Errors.** Every error of every status is `application/json` with the Error shape
(`code`, `message`, `status`); a validation 400 adds `errors`, naming each bad field.
Besides the statuses listed for each operation: an unknown path answers 404 `not_found`, and a
method an operation does not list answers 405 `method_not_allowed` with an `Allow` header.
"""


def description() -> str:
    """info.description, with the plans' numbers from petstore.ratelimit.plans."""
    numbers = ", ".join(
        f"{plan} {per_minute:,}/minute and {per_day:,}/day"
        for plan, (per_minute, per_day) in plans.PLAN_LIMITS.items()
    )
    return DESCRIPTION.format(plans=numbers)


def error_response_object(
    status: int, description: str, headers: tuple[str, ...] = ()
) -> dict[str, Any]:
    """A response object with the Error body, the rate-limit headers and `headers` (component ids)."""
    codes = ", ".join(f"`{code}`" for code in errors.codes_of(status))
    return {
        "description": f"{description} Code: {codes}.",
        "headers": {**rate_limit_headers(), **{name: name for name in headers}},
        "content": {JSON: {"schema": "Error"}},
    }


def rate_limit_headers() -> dict[str, str]:
    """The X-RateLimit-* headers every response carries, as references to their components."""
    return {name: name for name in RATE_LIMIT_HEADERS}


def deprecation_headers() -> dict[str, str]:
    """getPet's Deprecation, Sunset and successor Link headers (the response header name -> component id)."""
    return {"Deprecation": "Deprecation", "Sunset": "Sunset", "Link": "SuccessorLink"}


def add_components(spec: APISpec, config: Mapping[str, Any]) -> None:
    """Schemas, headers, shared responses and the security scheme."""
    spec.components.schema("NewPet", schema=schemas.NewPetSchema)
    spec.components.schema("Pet", schema=schemas.PetSchema)
    spec.components.schema("Error", schema=schemas.ErrorSchema)
    spec.components.schema("RateLimit", schema=schemas.RateLimitSchema)
    spec.components.schema("Usage", schema=schemas.UsageSchema)
    spec.components.security_scheme(
        SECURITY_SCHEME,
        {
            "type": "http",
            "scheme": "bearer",
            "description": "The API key, as `Authorization: Bearer <key>`.",
        },
    )
    integer_header = {"type": "integer", "minimum": 0}
    spec.components.header(
        "X-RateLimit-Limit",
        {
            "description": "The number of requests of the limit in force (per minute or per day).",
            "required": True,
            "schema": integer_header,
        },
    )
    spec.components.header(
        "X-RateLimit-Remaining",
        {
            "description": "Requests left in the current window of that limit.",
            "required": True,
            "schema": integer_header,
        },
    )
    spec.components.header(
        "X-RateLimit-Reset",
        {
            "description": "When the window of that limit ends: unix time, in seconds.",
            "required": True,
            "schema": integer_header,
        },
    )
    spec.components.header(
        "RateLimit-Policy",
        {
            "description": "The key's quota policies (draft-ietf-httpapi-ratelimit-headers-10, "
            "a structured-field List): one item per limit, its quota `q` and window `w` in "
            'seconds, e.g. `"minute";q=60;w=60, "day";q=1000;w=86400`.',
            "required": True,
            "schema": {"type": "string"},
        },
    )
    spec.components.header(
        "RateLimit",
        {
            "description": "The limit in force, as in X-RateLimit-* (the same draft): its "
            "policy name, remaining requests `r` and seconds `t` until its window ends, "
            'e.g. `"minute";r=42;t=17`.',
            "required": True,
            "schema": {"type": "string"},
        },
    )
    spec.components.header(
        "Retry-After",
        {
            "description": "Seconds to wait before trying again.",
            "required": True,
            "schema": {"type": "integer", "minimum": 1},
        },
    )
    spec.components.header(
        "WWW-Authenticate",
        {
            "description": 'The challenge: `Bearer realm="petstore"`, plus `error="invalid_token"` '
            'when a token was sent, or `error="insufficient_scope"` and the `scope` needed '
            "(RFC 6750).",
            "required": True,
            "schema": {"type": "string"},
        },
    )
    spec.components.header(
        "Location",
        {
            "description": "The path of the new pet.",
            "required": True,
            "schema": {"type": "string", "example": "/v1/pets/1"},
        },
    )
    spec.components.header(
        "Idempotent-Replayed",
        {
            "description": "`true` when this is the stored first response to an earlier request "
            "with the same `Idempotency-Key`, replayed.",
            "required": False,
            "schema": {"type": "string", "enum": ["true"]},
        },
    )
    spec.components.header(
        "NextPage",
        {
            "description": 'The next page, on full pages only: `<url>; rel="next"` (RFC 8288); its '
            "`after` parameter is the id of the last pet of this page.",
            "required": False,
            "schema": {"type": "string", "example": '</v1/pets?limit=20&after=20>; rel="next"'},
        },
    )
    spec.components.header(
        "Deprecation",
        {
            "description": "When this operation became deprecated (RFC 9745): `@` and unix seconds.",
            "required": True,
            "schema": {
                "type": "string",
                "pattern": "^@-?[0-9]+$",
                "example": f"@{config['DEPRECATED_AT']}",
            },
        },
    )
    spec.components.header(
        "Sunset",
        {
            "description": "When this operation goes away (RFC 8594), as an HTTP date.",
            "required": True,
            "schema": {"type": "string", "example": http_date(config["SUNSET"])},
        },
    )
    spec.components.header(
        "SuccessorLink",
        {
            "description": "The replacement: `GET /v1/pets` (with the `status` filter).",
            "required": True,
            "schema": {"type": "string", "example": '</v1/pets>; rel="successor-version"'},
        },
    )
    spec.components.response(
        "BadRequest",
        error_response_object(
            400, "The request is invalid; `errors` names each bad field, when fields are to blame."
        ),
    )
    spec.components.response(
        "Unauthorized",
        error_response_object(
            401,
            "The API key is missing, malformed, unknown, revoked or expired.",
            ("WWW-Authenticate",),
        ),
    )
    spec.components.response(
        "TooManyRequests",
        error_response_object(
            429,
            "The rate limit is spent (`rate_limited`), or the key is banned for calling on "
            "after 429s (`api_key_banned`). `Retry-After` says when to try again.",
            ("Retry-After",),
        ),
    )
    spec.components.response(
        "InternalError", error_response_object(500, "The service failed; no detail is given.")
    )
    spec.components.response(
        "ServiceUnavailable",
        error_response_object(
            503,
            "The database is unavailable or too slow; retry after `Retry-After`.",
            ("Retry-After",),
        ),
    )


def common_responses() -> dict[str, str]:
    """Responses every operation may give, whoever calls and whatever is asked."""
    return {
        "401": "Unauthorized",
        "429": "TooManyRequests",
        "500": "InternalError",
        "503": "ServiceUnavailable",
    }


# An operation's OpenAPI description, from the app's settings: the Operation Object.
Describe = Callable[[Mapping[str, Any]], dict[str, Any]]
# (path under /v1, method, its description): what build_document is given for each operation.
Described = tuple[str, str, Describe]


class Operations:
    """The OpenAPI descriptions of one views module's operations, each written beside its view.

    `@OPERATIONS.describe("/pets", "get")` on a function (settings -> Operation Object) next to
    the view it describes; petstore.views.described() gathers every resource's, in the order
    written, for build_document.
    """

    def __init__(self) -> None:
        self.described: list[Described] = []

    def describe(self, path: str, method: str) -> Callable[[Describe], Describe]:
        """Register the decorated function as the description of `method` on `path` (under /v1)."""

        def register(describe: Describe) -> Describe:
            self.described.append((path, method, describe))
            return describe

        return register


def add_paths(spec: APISpec, config: Mapping[str, Any], descriptions: Iterable[Described]) -> None:
    """The operations, as the views describe them (petstore.views.described)."""
    paths: dict[str, dict[str, Any]] = {}
    for path, method, describe in descriptions:
        paths.setdefault(path, {})[method] = describe(config)
    for path, described in paths.items():
        spec.path(path, operations=described)


def deprecated_error(status: int, description: str) -> dict[str, Any]:
    """An Error response of getPet itself, with its deprecation headers."""
    response = error_response_object(status, description)
    response["headers"].update(deprecation_headers())
    return response


# The first server without PETSTORE_BASE_URL: relative, so it resolves against wherever the
# document was fetched from (OpenAPI 3.0.3, Server Object), with no Host header involved.
RELATIVE_BASE_URL = "/v1"


def servers(config: Mapping[str, Any]) -> list[dict[str, str]]:
    """From configuration only: PETSTORE_BASE_URL or "/v1"; staging after, when it is set."""
    if config.get("PUBLIC_BASE_URL"):
        found = [{"url": config["PUBLIC_BASE_URL"], "description": "Production"}]
    else:
        found = [{"url": RELATIVE_BASE_URL, "description": "This server"}]
    if config.get("STAGING_BASE_URL"):
        found.append({"url": config["STAGING_BASE_URL"], "description": "Staging"})
    return found


def build_document(config: Mapping[str, Any], descriptions: Iterable[Described]) -> dict[str, Any]:
    """The OpenAPI document for an app with this configuration and these operations
    (petstore.views.described()): the same whoever asks."""
    spec = APISpec(
        title="Animal Store",
        version=API_VERSION,
        openapi_version=OPENAPI_VERSION,
        plugins=[MarshmallowPlugin()],
        info={"description": description()},
        servers=servers(config),
        security=[{SECURITY_SCHEME: []}],
        tags=[
            {"name": "pets", "description": "The animals of the catalogue."},
            {"name": "store", "description": "Store orders (named by the specification only)."},
            {"name": "rate limits", "description": "The caller's own budget and standing."},
        ],
    )
    add_components(spec, config)
    add_paths(spec, config, descriptions)
    document = spec.to_dict()
    # The usual reading order: what it is, where, then what it offers.
    document["info"] = {key: document["info"][key] for key in ("title", "version", "description")}
    order = ("openapi", "info", "servers", "security", "tags", "paths", "components")
    return {key: document[key] for key in order}


def to_json(document: Mapping[str, Any]) -> str:
    """The document as served and printed: indented JSON, keys in the document's own stable order."""
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"
