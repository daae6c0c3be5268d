"""GET /: a 404 in the Error shape that points to the docs, with or without a key."""

from __future__ import annotations

from flask.testing import FlaskClient

from tests.support.checks import assert_error


def test_root_points_to_the_docs_and_the_document(client: FlaskClient) -> None:
    response = client.get("/")

    body = assert_error(response, 404, "not_found")
    assert "/v1/docs" in body["message"]
    assert "/v1/openapi.json" in body["message"]
    assert response.headers["Link"] == (
        '</v1/docs>; rel="service-doc", </v1/openapi.json>; rel="service-desc"'
    )


def test_root_answers_the_same_with_a_key(
    client: FlaskClient, auth_headers: dict[str, str]
) -> None:
    assert_error(client.get("/", headers=auth_headers), 404, "not_found")
