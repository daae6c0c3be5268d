"""The OpenAPI document of the API, built by apispec from what each resource declares beside its views.

Each operation is routed and described by `@bp.operation(rule, method, operation_id, describe)`
on a `Resource`; `describe(config)` returns operation_object(summary, description, ok(...),
errors(...)), the Error codes from errors.ERRORS. This module imports no view.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from apispec import APISpec
from apispec.ext.marshmallow import MarshmallowPlugin
from flask import Blueprint
from marshmallow import Schema
from werkzeug.http import http_date

from petstore import plans, schemas
from petstore.errors import codes_of

# 3.0, not 3.1: in 3.1 (JSON Schema 2020-12) `1.0` is an integer, but this service refuses it
# for categoryId (a JSON integer literal is required); 3.0's Schema Object says the same as we do.
OPENAPI_VERSION = "3.0.3"
API_VERSION = "1.0.0"
SECURITY_SCHEME = "bearerAuth"
JSON = "application/json"

# The app's settings, which some descriptions quote, and an object of the document (an Operation,
# Response or Header Object...) as JSON.
Settings = Mapping[str, Any]
Object = dict[str, Any]

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
    """info.description, with the plans' numbers from petstore.plans."""
    numbers = ", ".join(
        f"{plan} {per_minute:,}/minute and {per_day:,}/day"
        for plan, (per_minute, per_day) in plans.PLAN_LIMITS.items()
    )
    return DESCRIPTION.format(plans=numbers)


# A response's headers: names that are their components' ids ("Location",), or header name ->
# component id where they differ ({"Link": "NextPage"}).
Headers = Iterable[str] | Mapping[str, str]

# The responses operations share, by status: their component id, description and headers. Every
# operation gives 401, 429, 500 and 503 (whoever calls, whatever is asked); 400 where it lists it.
SHARED_RESPONSES: dict[int, tuple[str, str, tuple[str, ...]]] = {
    400: (
        "BadRequest",
        "The request is invalid; `errors` names each bad field, when fields are to blame.",
        (),
    ),
    401: (
        "Unauthorized",
        "The API key is missing, malformed, unknown, revoked or expired.",
        ("WWW-Authenticate",),
    ),
    429: (
        "TooManyRequests",
        "The rate limit is spent (`rate_limited`), or the key is banned for calling on "
        "after 429s (`api_key_banned`). `Retry-After` says when to try again.",
        ("Retry-After",),
    ),
    500: ("InternalError", "The service failed; no detail is given.", ()),
    503: (
        "ServiceUnavailable",
        "The database is unavailable or too slow; retry after `Retry-After`.",
        ("Retry-After",),
    ),
}
EVERY_OPERATION = (401, 429, 500, 503)

# One error response of an operation: a status with a shared response (400), or one of its own,
# (status, description) or (status, description, headers).
Refusal = int | tuple[int, str] | tuple[int, str, Headers]


def header_ids(headers: Headers) -> dict[str, str]:
    """Header name -> component id, with the rate-limit headers every response carries first."""
    named = headers if isinstance(headers, Mapping) else {name: name for name in headers}
    return {**{name: name for name in RATE_LIMIT_HEADERS}, **named}


def error_response_object(status: int, description: str, headers: Headers = ()) -> Object:
    """A Response Object with the Error body, its codes from errors.ERRORS, and `headers`."""
    codes = ", ".join(f"`{code}`" for code in codes_of(status))
    return {
        "description": f"{description} Code: {codes}.",
        "headers": header_ids(headers),
        "content": {JSON: {"schema": "Error"}},
    }


def ok(
    status: int,
    schema: str,
    description: str,
    *,
    many: bool = False,
    headers: Headers = (),
    links: Object | None = None,
) -> dict[str, Object]:
    """An operation's success response, for its `responses`: a body of the `schema` component
    (an array of them when `many`), with the rate-limit headers and `headers`."""
    response: Object = {
        "description": description,
        "headers": header_ids(headers),
        "content": {JSON: {"schema": {"type": "array", "items": schema} if many else schema}},
    }
    if links:
        response["links"] = links
    return {str(status): response}


def errors(*refusals: Refusal, headers: Headers = ()) -> Object:
    """An operation's error responses, for its `responses`: each of `refusals` (its own ones with
    `headers` too), then the shared ones every operation gives."""
    found: Object = {}
    for refusal in (*refusals, *EVERY_OPERATION):
        if isinstance(refusal, int):
            found[str(refusal)] = SHARED_RESPONSES[refusal][0]
            continue
        status, description, *own = refusal
        found[str(status)] = error_response_object(
            status, description, {**header_ids(own[0] if own else ()), **header_ids(headers)}
        )
    return found


def lacks_scope(scope: str) -> Refusal:
    """The 403 of an operation that needs `scope`, to a key without it, for errors()."""
    other = {"read": "write", "write": "read"}[scope]
    return (
        403,
        f"The API key lacks the `{scope}` scope (a {other}-only key); "
        f'`WWW-Authenticate` says `error="insufficient_scope", scope="{scope}"`.',
        ("WWW-Authenticate",),
    )


def json_body(schema: str, description: str) -> Object:
    """A required JSON request body of the `schema` component."""
    return {"required": True, "description": description, "content": {JSON: {"schema": schema}}}


def header(description: str, schema: Object, *, required: bool = True) -> Object:
    """A header component."""
    return {"description": description, "required": required, "schema": schema}


def operation_object(
    summary: str,
    description: str,
    *responses: Object,
    parameters: list[Object] | None = None,
    request_body: Object | None = None,
    sunset: int | None = None,
) -> Object:
    """An Operation Object but for its operationId and tags, its `responses` those of ok() and
    errors(); deprecated, with its x-sunset day, when it has a `sunset` (unix seconds)."""
    found: Object = {"summary": summary, "description": description}
    if sunset is not None:
        found["deprecated"] = True
        found["x-sunset"] = time.strftime("%Y-%m-%d", time.gmtime(sunset))
    if parameters:
        found["parameters"] = parameters
    if request_body:
        found["requestBody"] = request_body
    found["responses"] = {status: each for group in responses for status, each in group.items()}
    return found


def path_parameter(name: str, description: str, schema: Object) -> Object:
    """A parameter of the path: `name` as the document writes it (petId)."""
    return {
        "name": name,
        "in": "path",
        "required": True,
        "description": description,
        "schema": schema,
    }


def idempotent_replayed() -> dict[str, Object]:
    """The header component of the replays of an operation that takes an idempotency_key()."""
    return {
        "Idempotent-Replayed": header(
            "`true` when this is the stored first response to an earlier request "
            "with the same `Idempotency-Key`, replayed.",
            {"type": "string", "enum": ["true"]},
            required=False,
        )
    }


def idempotency_key(created: str) -> Object:
    """The optional Idempotency-Key header parameter of a POST that creates a `created` (Stripe's
    semantics, petstore.idempotency)."""
    return {
        "name": "Idempotency-Key",
        "in": "header",
        "required": False,
        "description": "Makes a retried POST safe: the first response for a key (and API key) is "
        "stored for 24 hours and replayed, with `Idempotent-Replayed: true`, to every repeat with "
        f"the same body, instead of creating a second {created}. A repeat sent while the first "
        "request is still running waits for it and gets the replay. The same key with a "
        "different body answers 409 `idempotency_key_reused`. 1 to 255 printable ASCII "
        "characters (a UUID fits); a malformed key answers 400.",
        "schema": {
            "type": "string",
            "minLength": 1,
            "maxLength": 255,
            "pattern": "^[\\x21-\\x7e]([\\x20-\\x7e]*[\\x21-\\x7e])?$",
            "example": "5f0c8a52-4a3b-4d39-9d2b-1c1f0e6b7a10",
        },
    }


# The headers of each answer of a deprecated operation itself: header name -> component id.
DEPRECATION = {"Deprecation": "Deprecation", "Sunset": "Sunset", "Link": "SuccessorLink"}


def deprecation_headers(
    deprecated_at: int, sunset: int, successor: str, link: str
) -> dict[str, Object]:
    """The header components of DEPRECATION, for the resource of a deprecated operation: when it
    became deprecated and goes away (unix seconds), and the `successor` that replaces it."""
    text = {"type": "string"}
    return {
        "Deprecation": header(
            "When this operation became deprecated (RFC 9745): `@` and unix seconds.",
            {**text, "pattern": "^@-?[0-9]+$", "example": f"@{deprecated_at}"},
        ),
        "Sunset": header(
            "When this operation goes away (RFC 8594), as an HTTP date.",
            {**text, "example": http_date(sunset)},
        ),
        "SuccessorLink": header(f"The replacement: {successor}.", {**text, "example": link}),
    }


def add_components(spec: APISpec) -> None:
    """What every operation shares: the Error schema, the rate-limit and error headers, the
    shared responses and the security scheme."""
    spec.components.schema("Error", schema=schemas.ErrorSchema)
    spec.components.security_scheme(
        SECURITY_SCHEME,
        {
            "type": "http",
            "scheme": "bearer",
            "description": "The API key, as `Authorization: Bearer <key>`.",
        },
    )
    count = {"type": "integer", "minimum": 0}
    text = {"type": "string"}
    for component_id, header_object in {
        "X-RateLimit-Limit": header(
            "The number of requests of the limit in force (per minute or per day).", count
        ),
        "X-RateLimit-Remaining": header(
            "Requests left in the current window of that limit.", count
        ),
        "X-RateLimit-Reset": header(
            "When the window of that limit ends: unix time, in seconds.", count
        ),
        "RateLimit-Policy": header(
            "The key's quota policies (draft-ietf-httpapi-ratelimit-headers-10, "
            "a structured-field List): one item per limit, its quota `q` and window `w` in "
            'seconds, e.g. `"minute";q=60;w=60, "day";q=1000;w=86400`.',
            text,
        ),
        "RateLimit": header(
            "The limit in force, as in X-RateLimit-* (the same draft): its "
            "policy name, remaining requests `r` and seconds `t` until its window ends, "
            'e.g. `"minute";r=42;t=17`.',
            text,
        ),
        "Retry-After": header(
            "Seconds to wait before trying again.", {"type": "integer", "minimum": 1}
        ),
        "WWW-Authenticate": header(
            'The challenge: `Bearer realm="petstore"`, plus `error="invalid_token"` '
            'when a token was sent, or `error="insufficient_scope"` and the `scope` needed '
            "(RFC 6750).",
            text,
        ),
    }.items():
        spec.components.header(component_id, header_object)
    for status, (component_id, description, headers) in SHARED_RESPONSES.items():
        spec.components.response(component_id, error_response_object(status, description, headers))


# What the document says of one operation, from the app's settings: its Operation Object but for
# the operationId and the tags, which the decorator and the resource give.
Describe = Callable[[Settings], Object]
View = TypeVar("View", bound=Callable[..., Any])

# A variable of a Flask rule, `<pet_id>` or `<int:pet_id>` (flask-smorest's rule_to_path reads
# rules the same way): the document names it in camelCase, `{petId}`.
RULE_VARIABLE = re.compile(r"<(?:[^:<>]+:)?([^<>]+)>")


def document_path(rule: str) -> str:
    """A Flask rule as the document writes its path: `/pets/<pet_id>` -> `/pets/{petId}`."""

    def parameter(variable: re.Match[str]) -> str:
        first, *rest = variable[1].split("_")
        return "{" + first + "".join(word.capitalize() for word in rest) + "}"

    return RULE_VARIABLE.sub(parameter, rule)


@dataclass(frozen=True, slots=True)
class Operation:
    """One operation of a resource: where it is routed and what the document says of it."""

    path: str  # under /v1, as the document writes it: /pets/{petId}
    method: str  # lowercase, as the document's path item keys it
    endpoint: str  # the Flask endpoint of its view: pets.get_pet
    operation_id: str  # getPet
    describe: Describe


class Resource(Blueprint):
    """A blueprint of the API under /v1 that also declares what the OpenAPI document says of it:
    its tag, the components its operations use, and each operation beside its view."""

    def __init__(
        self,
        name: str,
        import_name: str,
        *,
        tag: str,
        tag_description: str,
        schemas: Mapping[str, type[Schema] | dict[str, Any]] | None = None,
        headers: Callable[[Settings], Mapping[str, Object]] | None = None,
    ) -> None:
        super().__init__(name, import_name)
        self.tag = {"name": tag, "description": tag_description}
        # Schema components by name (a marshmallow schema, or a Schema Object as it is), and
        # header components by id from the settings.
        self.schemas: Mapping[str, type[Schema] | dict[str, Any]] = schemas or {}
        self.headers = headers
        self.operations: list[Operation] = []

    def operation(
        self, rule: str, method: str, operation_id: str, describe: Describe
    ) -> Callable[[View], View]:
        """Route the decorated view at `rule` (under /v1) for `method`, and describe it in the
        document as `operation_id` by `describe`: the path is written here only."""

        def register(view: View) -> View:
            self.add_url_rule(rule, view_func=view, methods=[method.upper()])
            self.operations.append(
                Operation(
                    document_path(rule),
                    method.lower(),
                    f"{self.name}.{view.__name__}",
                    operation_id,
                    describe,
                )
            )
            return view

        return register

    def add_components(self, spec: APISpec, config: Settings) -> None:
        """This resource's schema and header components."""
        for name, schema in self.schemas.items():
            if isinstance(schema, dict):
                spec.components.schema(name, component=schema)
            else:
                spec.components.schema(name, schema=schema)
        if self.headers is not None:
            for component_id, header in self.headers(config).items():
                spec.components.header(component_id, header)


def operation_ids(resources: Iterable[Resource]) -> dict[str, str]:
    """Flask endpoint -> operationId of each of the resources' operations."""
    return {
        operation.endpoint: operation.operation_id
        for resource in resources
        for operation in resource.operations
    }


def servers(config: Settings) -> list[dict[str, str]]:
    """From configuration only: PETSTORE_BASE_URL or "/v1"; staging after, when it is set."""
    if config.get("PUBLIC_BASE_URL"):
        found = [{"url": config["PUBLIC_BASE_URL"], "description": "Production"}]
    else:
        # Relative: it resolves against wherever the document was fetched from (OpenAPI 3.0.3,
        # Server Object), with no Host header involved.
        found = [{"url": "/v1", "description": "This server"}]
    if config.get("STAGING_BASE_URL"):
        found.append({"url": config["STAGING_BASE_URL"], "description": "Staging"})
    return found


def build_document(config: Settings, resources: Iterable[Resource]) -> dict[str, Any]:
    """The OpenAPI document for an app with this configuration and these resources
    (petstore.views.RESOURCES): the same whoever asks."""
    resources = tuple(resources)
    spec = APISpec(
        title="Animal Store",
        version=API_VERSION,
        openapi_version=OPENAPI_VERSION,
        plugins=[MarshmallowPlugin()],
        info={"description": description()},
        servers=servers(config),
        security=[{SECURITY_SCHEME: []}],
        tags=[resource.tag for resource in resources],
    )
    add_components(spec)
    paths: dict[str, dict[str, Any]] = {}  # the resources' operations, grouped by path
    for resource in resources:
        resource.add_components(spec, config)
        for operation in resource.operations:
            paths.setdefault(operation.path, {})[operation.method] = {
                "operationId": operation.operation_id,
                "tags": [resource.tag["name"]],
                **operation.describe(config),
            }
    for path, operations in paths.items():
        spec.path(path, operations=operations)
    document = spec.to_dict()
    # The usual reading order: what it is, where, then what it offers.
    document["info"] = {key: document["info"][key] for key in ("title", "version", "description")}
    order = ("openapi", "info", "servers", "security", "tags", "paths", "components")
    return {key: document[key] for key in order}


def to_json(document: Mapping[str, Any]) -> str:
    """The document as served and printed: indented JSON, keys in the document's own stable order."""
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"
