"""The API description: GET /v1/openapi.json, its content, `petstore openapi`, and the /v1/docs page."""

from __future__ import annotations

import calendar
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from openapi_spec_validator import validate
from openapi_spec_validator.readers import read_from_filename

from petstore import openapi, schemas
from tests.support.checks import assert_error

PETSTORE = Path(sys.executable).parent / "petstore"
RATE_LIMIT_HEADERS = {"X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset"}
# (path, method) -> operationId: the spec's operation names, and ours for orders.
OPERATIONS = {
    ("/pets", "get"): "listPets",
    ("/pets", "post"): "createPet",
    ("/pets/{petId}", "get"): "getPet",
    ("/store/orders", "get"): "listOrders",
    ("/rate_limit", "get"): "getRateLimit",
    ("/usage", "get"): "getUsage",
}
# Every status each operation really answers (see petstore.errors, petstore.ratelimit, auth and the views).
STATUSES = {
    "listPets": {"200", "400", "401", "429", "500", "503"},
    "createPet": {"201", "400", "401", "403", "409", "413", "415", "429", "500", "503"},
    "getPet": {"200", "401", "404", "410", "429", "500", "503"},
    "listOrders": {"401", "429", "500", "501", "503"},
    "getRateLimit": {"200", "401", "429", "500", "503"},
    "getUsage": {"200", "400", "401", "403", "429", "500", "503"},
}


def resolve(document: dict[str, Any], node: Any) -> Any:
    """Follow a local $ref (#/components/...) until a node that is not a reference."""
    while isinstance(node, dict) and "$ref" in node:
        target: Any = document
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        node = target
    return node


def operations(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """operationId -> operation object, for every operation of the document."""
    return {
        operation["operationId"]: operation
        for path_item in document["paths"].values()
        for operation in path_item.values()
    }


def responses(document: dict[str, Any], operation_id: str) -> dict[str, dict[str, Any]]:
    """status -> resolved response object of one operation."""
    found = operations(document)[operation_id]["responses"]
    return {status: resolve(document, response) for status, response in found.items()}


def headers_of(document: dict[str, Any], response: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """header name -> resolved header object of one response."""
    return {name: resolve(document, h) for name, h in response.get("headers", {}).items()}


@pytest.fixture
def document(client: FlaskClient) -> dict[str, Any]:
    """The document the app serves, fetched without a key."""
    response = client.get("/v1/openapi.json")
    assert response.status_code == 200, response.get_data(as_text=True)
    assert response.mimetype == "application/json"
    body: dict[str, Any] = response.get_json()
    return body


def test_served_without_a_key_and_rate_limited_per_ip(client: FlaskClient) -> None:
    response = client.get("/v1/openapi.json")
    assert response.status_code == 200
    assert RATE_LIMIT_HEADERS <= set(response.headers.keys())
    assert response.headers["X-RateLimit-Limit"] == "60"
    again = client.get("/v1/openapi.json")
    assert (
        int(again.headers["X-RateLimit-Remaining"])
        == int(response.headers["X-RateLimit-Remaining"]) - 1
    )


def descriptions(node: Any) -> list[str]:
    """Every `description` string anywhere in the document."""
    if isinstance(node, dict):
        found = [node["description"]] if isinstance(node.get("description"), str) else []
        return found + [text for value in node.values() for text in descriptions(value)]
    if isinstance(node, list):
        return [text for value in node for text in descriptions(value)]
    return []


def test_no_description_line_reads_as_a_numbered_list_item(document: dict[str, Any]) -> None:
    """Markdown (the /v1/docs page) makes a line starting "401." an item of a numbered list."""
    texts = descriptions(document)
    assert len(texts) > 10
    item = re.compile(r"^\s*\d+[.)](\s|$)", re.M)
    assert [text for text in texts if item.search(text)] == []


def test_validates(document: dict[str, Any], tmp_path: Path) -> None:
    """openapi-spec-validator accepts it, as served and as a file a client would download."""
    validate(document)
    saved = tmp_path / "openapi.json"
    saved.write_text(json.dumps(document), encoding="utf-8")
    spec_dict, base_uri = read_from_filename(str(saved))
    validate(spec_dict, base_uri=base_uri)


def test_every_operation_by_its_name(document: dict[str, Any]) -> None:
    found = {
        (path, method): operation["operationId"]
        for path, path_item in document["paths"].items()
        for method, operation in path_item.items()
    }
    assert found == OPERATIONS
    assert document["openapi"].startswith("3.")
    assert document["info"]["version"] == "1.0.0"


@pytest.mark.parametrize("operation_id", sorted(STATUSES))
def test_every_status_with_the_error_schema_and_rate_limit_headers(
    document: dict[str, Any], operation_id: str
) -> None:
    found = responses(document, operation_id)
    assert set(found) == STATUSES[operation_id]
    for status, response in found.items():
        headers = headers_of(document, response)
        assert RATE_LIMIT_HEADERS <= set(headers), (status, headers)
        assert all(headers[name]["required"] for name in RATE_LIMIT_HEADERS)
        assert response["content"]["application/json"]["schema"]
        if int(status) >= 400:
            assert response["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/Error"
            }
        assert ("Retry-After" in headers) == (status in ("429", "503")), status
        if status in ("429", "503"):
            assert headers["Retry-After"]["required"] is True


def test_list_pets_parameters_and_bounds(document: dict[str, Any]) -> None:
    operation = operations(document)["listPets"]
    parameters = {p["name"]: p for p in operation["parameters"]}
    assert set(parameters) == {"limit", "status", "after"}
    assert all(p["in"] == "query" and not p["required"] for p in parameters.values())
    limit = parameters["limit"]["schema"]
    assert (limit["type"], limit["minimum"], limit["maximum"], limit["default"]) == (
        "integer",
        1,
        100,
        20,
    )
    assert parameters["status"]["schema"]["enum"] == list(schemas.PET_STATUSES)
    after = parameters["after"]["schema"]
    assert (after["type"], after["minimum"], after["maximum"]) == ("integer", 0, 2**63 - 1)
    assert "last pet of the previous page" in parameters["after"]["description"]
    page = responses(document, "listPets")["200"]
    assert page["content"]["application/json"]["schema"] == {
        "type": "array",
        "items": {"$ref": "#/components/schemas/Pet"},
    }
    link = headers_of(document, page)["Link"]
    assert link["required"] is False  # only full pages have a next one
    assert 'rel="next"' in link["schema"]["example"]


def test_create_pet_body_location_and_idempotency_key(document: dict[str, Any]) -> None:
    operation = operations(document)["createPet"]
    body = operation["requestBody"]
    assert body["required"] is True
    assert body["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/NewPet"}
    (key,) = operation["parameters"]
    assert (key["name"], key["in"], key["required"]) == ("Idempotency-Key", "header", False)
    assert (key["schema"]["minLength"], key["schema"]["maxLength"]) == (1, 255)
    created = responses(document, "createPet")["201"]
    assert headers_of(document, created)["Location"]["required"] is True
    assert created["links"]["GetPetById"] == {
        "operationId": "getPet",
        "parameters": {"petId": "$response.body#/id"},
        "description": "The new pet, by its `id`.",
    }
    assert "idempotency_key_reused" in responses(document, "createPet")["409"]["description"]


def test_get_pet_is_deprecated_with_its_sunset(document: dict[str, Any]) -> None:
    operation = operations(document)["getPet"]
    assert operation["deprecated"] is True
    assert operation["x-sunset"] == "2030-12-05"
    assert "Thu, 05 Dec 2030 00:00:00 GMT" in operation["description"]
    (pet_id,) = operation["parameters"]
    assert pet_id["in"] == "path" and pet_id["required"] is True
    assert pet_id["schema"] == {"type": "integer", "format": "int64"}
    for status in ("200", "404", "410"):
        headers = headers_of(document, responses(document, "getPet")[status])
        assert {"Deprecation", "Sunset", "Link"} <= set(headers), status
    assert headers_of(document, responses(document, "getPet")["200"])["Sunset"]["schema"][
        "example"
    ] == ("Thu, 05 Dec 2030 00:00:00 GMT")


def test_sunset_comes_from_configuration(make_app: Callable[..., Flask]) -> None:
    app = make_app(SUNSET=calendar.timegm((2031, 1, 2, 0, 0, 0)))
    document = app.test_client().get("/v1/openapi.json").get_json()
    operation = operations(document)["getPet"]
    assert operation["x-sunset"] == "2031-01-02"
    assert "Thu, 02 Jan 2031 00:00:00 GMT" in operation["description"]


def test_list_orders_says_why_501(document: dict[str, Any]) -> None:
    answer = responses(document, "listOrders")["501"]
    assert "not specified" in answer["description"]
    assert "not_implemented" in answer["description"]


def test_bearer_security_everywhere(document: dict[str, Any]) -> None:
    assert document["security"] == [{"bearerAuth": []}]
    assert document["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "The API key, as `Authorization: Bearer <key>`.",
    }
    for operation in operations(document).values():
        assert "security" not in operation  # none opts out
        unauthorized = resolve(document, operation["responses"]["401"])
        assert headers_of(document, unauthorized)["WWW-Authenticate"]["required"] is True


def test_schemas_are_the_marshmallow_ones(document: dict[str, Any]) -> None:
    """Field names, required fields and bounds come from petstore.schemas, not a second copy."""
    components = document["components"]["schemas"]
    for name, schema in (
        ("NewPet", schemas.NewPetSchema()),
        ("Pet", schemas.PetSchema()),
        ("Error", schemas.ErrorSchema()),
    ):
        fields = schema.fields.values()
        assert set(components[name]["properties"]) == {f.data_key or f.name for f in fields}
        assert set(components[name]["required"]) == {
            f.data_key or f.name for f in fields if f.required
        }
    new_pet = components["NewPet"]
    assert new_pet["additionalProperties"] is False
    assert new_pet["properties"]["name"]["minLength"] == 1
    assert new_pet["properties"]["categoryId"]["format"] == "int64"
    assert new_pet["properties"]["categoryId"]["maximum"] == 2**63 - 1
    assert new_pet["properties"]["status"]["enum"] == list(schemas.PET_STATUSES)
    assert components["Pet"]["properties"]["status"]["enum"] == list(schemas.PET_STATUSES)


# A Host and forwarding headers an attacker may send; none of them may reach the document.
CLIENT_CHOSEN = {
    "Host": "evil.example",
    "X-Forwarded-Host": "evil.example",
    "X-Forwarded-Proto": "https",
    "X-Forwarded-For": "203.0.113.9",
    "Forwarded": "host=evil.example;proto=https",
}


@pytest.mark.parametrize("proxy_count", [0, 1])
@pytest.mark.parametrize(
    ("settings", "servers"),
    [
        pytest.param(
            {"PUBLIC_BASE_URL": None, "STAGING_BASE_URL": None},
            [{"url": "/v1", "description": "This server"}],
            id="relative",
        ),
        pytest.param(
            {"PUBLIC_BASE_URL": None, "STAGING_BASE_URL": "https://staging.example.test/v1"},
            [
                {"url": "/v1", "description": "This server"},
                {"url": "https://staging.example.test/v1", "description": "Staging"},
            ],
            id="relative-and-staging",
        ),
        pytest.param(
            {"PUBLIC_BASE_URL": "https://api.example.test/v1", "STAGING_BASE_URL": None},
            [{"url": "https://api.example.test/v1", "description": "Production"}],
            id="configured",
        ),
        pytest.param(
            {
                "PUBLIC_BASE_URL": "https://api.example.test/v1",
                "STAGING_BASE_URL": "https://staging.example.test/v1",
            },
            [
                {"url": "https://api.example.test/v1", "description": "Production"},
                {"url": "https://staging.example.test/v1", "description": "Staging"},
            ],
            id="configured-and-staging",
        ),
    ],
)
def test_servers_come_from_the_settings_never_from_the_request(
    make_app: Callable[..., Flask],
    settings: dict[str, Any],
    servers: list[dict[str, str]],
    proxy_count: int,
) -> None:
    """A client-chosen Host is never reflected: a cache in front would keep the poisoned document."""
    client = make_app(PROXY_COUNT=proxy_count, **settings).test_client()
    plain = client.get("/v1/openapi.json")
    chosen = client.get("/v1/openapi.json", headers=CLIENT_CHOSEN, base_url="http://evil.example")

    assert plain.get_json()["servers"] == servers
    assert chosen.get_data() == plain.get_data()
    assert b"evil.example" not in chosen.get_data()


def test_built_once_per_app(app: Flask, monkeypatch: pytest.MonkeyPatch) -> None:
    client = app.test_client()
    first = client.get("/v1/openapi.json").get_data()

    def refuse(config: Any, descriptions: Any) -> dict[str, Any]:
        raise AssertionError("the document is built again")

    monkeypatch.setattr(openapi, "build_document", refuse)
    assert client.get("/v1/openapi.json").get_data() == first


@pytest.mark.parametrize(
    "environ",
    [
        pytest.param({}, id="defaults"),
        pytest.param(
            {
                "PETSTORE_BASE_URL": "https://api.example.test/v1",
                "PETSTORE_STAGING_BASE_URL": "https://staging.example.test/v1",
            },
            id="configured",
        ),
    ],
)
def test_petstore_openapi_prints_the_served_document(
    make_app: Callable[..., Flask], environ: dict[str, str]
) -> None:
    """The console script, with no database configured, prints the very bytes the app serves."""
    names = ("DATABASE_URL", "PETSTORE_BASE_URL", "PETSTORE_STAGING_BASE_URL")
    printed = subprocess.run(
        [str(PETSTORE), "openapi"],
        env={**{k: v for k, v in os.environ.items() if k not in names}, **environ},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert printed.returncode == 0, printed.stderr
    app = make_app(
        PUBLIC_BASE_URL=environ.get("PETSTORE_BASE_URL"),
        STAGING_BASE_URL=environ.get("PETSTORE_STAGING_BASE_URL"),
    )
    served = app.test_client().get("/v1/openapi.json", headers=CLIENT_CHOSEN)

    assert printed.stdout == served.get_data(as_text=True)


def test_docs_page_and_its_assets_need_no_key(client: FlaskClient) -> None:
    page = client.get("/v1/docs")
    assert page.status_code == 200
    assert page.mimetype == "text/html"
    assert RATE_LIMIT_HEADERS <= set(page.headers.keys())
    html = page.get_data(as_text=True)
    assert 'url: "/v1/openapi.json"' in html
    assert "http://" not in html and "https://" not in html  # nothing from another host
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css", "favicon-32x32.png"):
        assert f"/v1/docs/assets/{asset}?v=" in html
        response = client.get(f"/v1/docs/assets/{asset}")
        assert response.status_code == 200, asset
        assert len(response.get_data()) > 500
        assert response.cache_control.max_age == 86400
        response.close()


def test_docs_with_a_trailing_slash_redirects_to_the_page(client: FlaskClient) -> None:
    response = client.get("/v1/docs/")
    assert response.status_code == 308
    assert response.headers["Location"] == "/v1/docs"
    assert client.get("/v1/docs/", follow_redirects=True).status_code == 200


@pytest.mark.parametrize("name", ["index.css", "swagger-ui.js", "LICENSE", "nothing.js"])
def test_docs_serves_no_other_file(client: FlaskClient, name: str) -> None:
    assert_error(client.get(f"/v1/docs/assets/{name}"), 404, "not_found")


@pytest.mark.parametrize(
    ("rule", "path"),
    [
        ("/pets", "/pets"),
        ("/pets/<pet_id>", "/pets/{petId}"),
        ("/store/<int:order_id>/lines/<line>", "/store/{orderId}/lines/{line}"),
    ],
)
def test_a_rule_is_written_once_and_the_document_path_follows(rule: str, path: str) -> None:
    assert openapi.document_path(rule) == path


def test_a_resource_routes_and_describes_each_operation_with_its_tag_and_components() -> None:
    """One decorator routes a view and describes it; the document takes the resource's tag,
    schemas and headers without openapi.py naming them."""
    bp = openapi.Resource(
        "things",
        __name__,
        tag="things",
        tag_description="Things of a test.",
        schemas={"Thing": schemas.PetSchema, "Count": {"type": "integer"}},
        headers=lambda config: {"ThingCount": {"schema": {"type": "integer"}}},
    )

    def get_thing_operation(config: Any) -> dict[str, Any]:
        return {"responses": {"200": {"description": "A thing."}}}

    @bp.operation("/things/<thing_id>", "get", "getThing", get_thing_operation)
    def get_thing(thing_id: str) -> str:
        return thing_id

    app = Flask(__name__)
    app.register_blueprint(bp, url_prefix="/v1")
    assert app.test_client().get("/v1/things/7").get_data(as_text=True) == "7"
    assert app.test_client().post("/v1/things/7").status_code == 405
    assert openapi.operation_ids([bp]) == {"things.get_thing": "getThing"}
    document = openapi.build_document({}, [bp])
    assert document["tags"] == [{"name": "things", "description": "Things of a test."}]
    assert document["paths"] == {
        "/things/{thingId}": {
            "get": {
                "operationId": "getThing",
                "tags": ["things"],
                "responses": {"200": {"description": "A thing."}},
            }
        }
    }
    assert set(document["components"]["schemas"]) == {"Error", "Thing", "Count"}
    assert document["components"]["schemas"]["Count"] == {"type": "integer"}
    assert "ThingCount" in document["components"]["headers"]
