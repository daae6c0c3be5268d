"""Edges decided on purpose: empty path segments, OPTIONS, body framing the app refuses (docs/usage.rst)."""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from gunicorn.http import errors as http_errors

from petstore import db
from tests.conftest import count_pets
from tests.support.checks import assert_error, post_chunked

PET = b'{"name": "Rex", "categoryId": 1}'


@pytest.mark.parametrize("path", ["/v1//pets", "//v1/pets", "/v1/pets//1", "/v1/store//orders"])
def test_an_empty_path_segment_is_a_404_without_location(
    client: FlaskClient, auth_headers: dict[str, str], path: str
) -> None:
    """No HTML 308 to the merged path with a Location built from the client's Host: a 404 Error."""
    response = client.get(path, headers={**auth_headers, "Host": "evil.test"})
    assert_error(response, 404, "not_found")
    assert "Location" not in response.headers


@pytest.mark.parametrize(
    ("path", "allowed"),
    [
        ("/v1/pets", {"GET", "HEAD", "POST"}),
        ("/v1/pets/1", {"GET", "HEAD"}),
        ("/v1/store/orders", {"GET", "HEAD"}),
        ("/v1/openapi.json", {"GET", "HEAD"}),
    ],
)
def test_options_is_a_405_with_allow(
    client: FlaskClient, auth_headers: dict[str, str], path: str, allowed: set[str]
) -> None:
    """No automatic OPTIONS (it was an empty text/html 200): the 405 Error, Allow naming the rest."""
    response = client.options(path, headers=auth_headers)
    assert_error(response, 405, "method_not_allowed")
    assert {name.strip() for name in response.headers["Allow"].split(",")} == allowed


@pytest.mark.parametrize("coding", ["gzip, chunked", "chunked, chunked", "gzip", "identity"])
def test_a_transfer_coding_other_than_chunked_is_a_400(
    client: FlaskClient, auth_headers: dict[str, str], conn: db.Connection, coding: str
) -> None:
    """gunicorn hands "gzip, chunked" on as if chunked; the app refuses it as nginx does."""
    response = client.post(
        "/v1/pets",
        input_stream=io.BytesIO(PET),
        content_type="application/json",
        headers={**auth_headers, "Transfer-Encoding": coding},
        environ_overrides={"wsgi.input_terminated": True},
    )
    body = assert_error(response, 400, "invalid_request")
    assert body["message"] == "The Transfer-Encoding of the request is not supported."
    assert count_pets(conn) == 0


def test_chunked_is_accepted(
    client: FlaskClient, auth_headers: dict[str, str], conn: db.Connection
) -> None:
    """The control: plain chunked, any case, creates the pet."""
    response = post_chunked(client, PET, {**auth_headers, "Transfer-Encoding": "Chunked"})
    assert response.status_code == 201, response.get_json()
    assert count_pets(conn) == 1


class BrokenStream(io.BytesIO):
    """wsgi.input that fails as gunicorn's chunked reader does on a malformed body."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(b"")
        self.error = error

    def read(self, size: int | None = -1) -> bytes:
        raise self.error

    def readline(self, size: int | None = -1) -> bytes:
        raise self.error

    def read1(self, size: int | None = -1) -> bytes:
        raise self.error

    def readinto(self, buffer: Any) -> int:
        raise self.error


@pytest.mark.parametrize(
    "error",
    [
        http_errors.InvalidChunkSize(b"zz"),
        http_errors.ChunkMissingTerminator(b"XX"),
        http_errors.LimitRequestLine(102400, 1024),
        http_errors.NoMoreData(b""),
        OSError("Invalid chunk header"),
    ],
    ids=["chunk-size", "no-crlf", "size-line-too-long", "ended-early", "werkzeug"],
)
def test_a_body_that_cannot_be_read_is_a_400(
    client: FlaskClient,
    auth_headers: dict[str, str],
    conn: db.Connection,
    caplog: pytest.LogCaptureFixture,
    error: BaseException,
) -> None:
    """The server's reader raises while the app reads the body: 400, no traceback, no pet."""
    response = client.post(
        "/v1/pets",
        input_stream=BrokenStream(error),
        content_type="application/json",
        headers={**auth_headers, "Transfer-Encoding": "chunked"},
        environ_overrides={"wsgi.input_terminated": True},
    )
    body = assert_error(response, 400, "invalid_request")
    if not isinstance(error, OSError):
        # werkzeug's stream makes an OSError (gunicorn's NoMoreData is one) its own 400 first.
        assert "chunked encoding is broken" in body["message"]
    assert count_pets(conn) == 0
    assert not [record for record in caplog.records if record.exc_info], caplog.text


# A Host and every forwarding header a client may send, naming a host of the attacker's.
EVIL = "evil.example"
CLIENT_CHOSEN_HOST = {
    "Host": EVIL,
    "X-Forwarded-Host": EVIL,
    "X-Forwarded-Proto": "https",
    "X-Forwarded-Prefix": "/evil.example",
    "X-Forwarded-Server": EVIL,
    "Forwarded": f"host={EVIL};proto=https",
}


@pytest.mark.parametrize("proxy_count", [0, 1])
def test_a_client_chosen_host_reaches_no_answer_and_no_log(
    make_app: Callable[..., Flask],
    issue_key: Callable[..., str],
    caplog: pytest.LogCaptureFixture,
    proxy_count: int,
) -> None:
    """Location, Link, the docs page, the document, errors and log lines stay relative or configured."""
    client = make_app(PROXY_COUNT=proxy_count).test_client()
    key = {"Authorization": f"Bearer {issue_key('enterprise', per_minute=100, per_day=1000)}"}
    headers = {**key, **CLIENT_CHOSEN_HOST}
    for _ in range(2):
        client.post("/v1/pets", data=PET, content_type="application/json", headers=key)
    caplog.set_level(logging.DEBUG)

    answers = {
        "created": client.post(
            "/v1/pets", data=PET, content_type="application/json", headers=headers
        ),
        "full page": client.get("/v1/pets?limit=1", headers=headers),
        "deprecated": client.get("/v1/pets/1", headers=headers),
        "root": client.get("/", headers=headers),
        "docs": client.get("/v1/docs", headers=headers),
        "docs slash": client.get("/v1/docs/", headers=headers),
        "document": client.get("/v1/openapi.json", headers=headers),
        "unknown": client.get("/v1/nowhere", headers=headers),
        "method": client.delete("/v1/pets", headers=headers),
        "no key": client.get("/v1/pets", headers=CLIENT_CHOSEN_HOST),
    }

    assert answers["created"].status_code == 201
    assert answers["created"].headers["Location"] == "/v1/pets/3"
    assert answers["full page"].headers["Link"] == '</v1/pets?limit=1&after=1>; rel="next"'
    assert answers["deprecated"].headers["Link"] == '</v1/pets>; rel="successor-version"'
    assert answers["docs slash"].headers["Location"] == "/v1/docs"
    for name, answer in answers.items():
        shown = str(answer.headers) + answer.get_data(as_text=True)
        assert EVIL not in shown, name
    logged = [str(vars(record)) for record in caplog.records]
    assert len(logged) >= len(answers)
    assert not [line for line in logged if EVIL in line]
