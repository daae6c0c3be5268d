"""Shared by the HTTP tests: the Error body every failure must answer; timed GETs, bursts, chunked POSTs."""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
import requests
from flask import Flask
from flask.testing import FlaskClient
from werkzeug.test import TestResponse

ERROR_FIELDS = {"code", "message", "status"}


def assert_error(response: TestResponse, status: int, code: str) -> dict[str, Any]:
    """The response is an Error JSON of this status and code, exactly {code, message, status} (+ errors on 400)."""
    assert response.status_code == status, response.get_data(as_text=True)
    assert response.mimetype == "application/json"
    body = response.get_json()
    assert isinstance(body, dict)
    extra = set(body) - ERROR_FIELDS
    assert ERROR_FIELDS <= set(body)
    assert extra <= ({"errors"} if status == 400 else set()), body
    assert body["code"] == code
    assert body["status"] == status
    assert isinstance(body["message"], str) and body["message"]
    if "errors" in body:
        assert isinstance(body["errors"], dict) and body["errors"]
    return body


@dataclass
class Answer:
    """What one request got back, and how long it took (headers looked up in any case)."""

    status: int
    body: Any
    headers: Mapping[str, str]
    elapsed: float
    received: float = field(default_factory=time.time)


def flask_getter(app: Flask, key: str, within: float) -> Callable[[], Answer]:
    """GET /v1/pets through the Flask test client, timed, in a thread so that a hang fails the test."""
    client = app.test_client()

    def get() -> Answer:
        executor = ThreadPoolExecutor(max_workers=1)
        started = time.monotonic()
        future = executor.submit(client.get, "/v1/pets", headers={"Authorization": f"Bearer {key}"})
        try:
            response = future.result(timeout=within)
        except TimeoutError:
            pytest.fail(f"GET /v1/pets did not answer within {within} s")
        finally:
            # A hung request's thread ends when the test's servers close its connections.
            executor.shutdown(wait=False)
        elapsed = time.monotonic() - started
        headers = cast(Mapping[str, str], response.headers)
        return Answer(response.status_code, response.get_json(silent=True), headers, elapsed)

    return get


def http_getter(base_url: str, key: str, timeout: float) -> Callable[[], Answer]:
    """GET /v1/pets over HTTP on a new connection each time (so any worker may serve it), timed."""

    def get() -> Answer:
        started = time.monotonic()
        response = requests.get(
            f"{base_url}/v1/pets",
            headers={"Authorization": f"Bearer {key}", "Connection": "close"},
            timeout=timeout,
        )
        elapsed = time.monotonic() - started
        try:
            body = response.json()
        except ValueError:
            body = response.text
        return Answer(response.status_code, body, response.headers, elapsed)

    return get


def burst(get: Callable[[], Answer], count: int = 32, at_once: int = 8) -> list[Answer]:
    """`count` requests from `at_once` threads (by default enough to busy every worker and pooled connection)."""
    with ThreadPoolExecutor(max_workers=at_once) as executor:
        return list(executor.map(lambda _: get(), range(count)))


def post_chunked(client: FlaskClient, data: bytes, headers: Mapping[str, str]) -> TestResponse:
    """POST /v1/pets as JSON without Content-Length, as gunicorn passes a chunked body on."""
    return client.post(
        "/v1/pets",
        input_stream=io.BytesIO(data),
        content_type="application/json",
        headers={**headers, "Transfer-Encoding": "chunked"},
        environ_overrides={"wsgi.input_terminated": True},
    )
