"""The OpenAPI document of the API, built by apispec from what each resource declares beside its views.

A views module's blueprint is a `Resource`: its tag, the schema and header components its
operations use, and each operation, routed and described by one decorator,
`@bp.operation(rule, method, operation_id, describe)`. build_document collects them; this module
imports no view.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from apispec import APISpec
from apispec.ext.marshmallow import MarshmallowPlugin
from flask import Blueprint
from marshmallow import Schema

from petstore import errors, plans, schemas

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
    """info.description, with the plans' numbers from petstore.plans."""
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


# What the document says of one operation, from the app's settings: its Operation Object but for
# the operationId and the tags, which the decorator and the resource give.
Describe = Callable[[Mapping[str, Any]], dict[str, Any]]
# A view function, kept as it is by the decorator that routes it.
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
        headers: Callable[[Mapping[str, Any]], Mapping[str, dict[str, Any]]] | None = None,
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

    def add_components(self, spec: APISpec, config: Mapping[str, Any]) -> None:
        """This resource's schema and header components."""
        for name, schema in self.schemas.items():
            if isinstance(schema, dict):
                spec.components.schema(name, component=schema)
            else:
                spec.components.schema(name, schema=schema)
        if self.headers is not None:
            for component_id, header in self.headers(config).items():
                spec.components.header(component_id, header)


def add_paths(spec: APISpec, config: Mapping[str, Any], resources: Iterable[Resource]) -> None:
    """The resources' operations, grouped by path."""
    paths: dict[str, dict[str, Any]] = {}
    for resource in resources:
        for operation in resource.operations:
            # The resource's tag, in the place the Operation Object's fields usually take.
            paths.setdefault(operation.path, {})[operation.method] = {
                "operationId": operation.operation_id,
                "tags": [resource.tag["name"]],
                **operation.describe(config),
            }
    for path, operations in paths.items():
        spec.path(path, operations=operations)


def operation_ids(resources: Iterable[Resource]) -> dict[str, str]:
    """Flask endpoint -> operationId of each of the resources' operations."""
    return {
        operation.endpoint: operation.operation_id
        for resource in resources
        for operation in resource.operations
    }


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


def build_document(config: Mapping[str, Any], resources: Iterable[Resource]) -> dict[str, Any]:
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
    for resource in resources:
        resource.add_components(spec, config)
    add_paths(spec, config, resources)
    document = spec.to_dict()
    # The usual reading order: what it is, where, then what it offers.
    document["info"] = {key: document["info"][key] for key in ("title", "version", "description")}
    order = ("openapi", "info", "servers", "security", "tags", "paths", "components")
    return {key: document[key] for key in order}


def to_json(document: Mapping[str, Any]) -> str:
    """The document as served and printed: indented JSON, keys in the document's own stable order."""
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"
