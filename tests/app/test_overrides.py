"""petstore.overrides against the installed libraries: each override still does its job, or fails here loudly."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from typing import Any

import gunicorn.util
import pytest
from gunicorn.config import Config
from gunicorn.glogging import Logger
from gunicorn.http import errors as http_errors
from gunicorn.workers.gthread import ThreadWorker
from gunicorn.workers.sync import SyncWorker

from petstore import overrides


@pytest.fixture
def json_refusals(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """use_json_refusals() for one test; gunicorn's own write_error is put back afterwards."""
    monkeypatch.setattr(gunicorn.util, "write_error", gunicorn.util.write_error)
    overrides.use_json_refusals()
    yield


def refuse(worker_class: type[Any], exc: BaseException) -> tuple[str, dict[str, str], Any]:
    """What a real worker of this class writes to its client for `exc`: status line, headers, body."""
    cfg = Config()
    worker = worker_class(0, 0, [], None, 30, cfg, Logger(cfg))
    server, client = socket.socketpair()
    with server, client:
        worker.handle_error(None, server, ("127.0.0.1", 5000), exc)
        server.close()
        received = b""
        while chunk := client.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (h.partition(":") for h in lines)}
    return status_line, headers, json.loads(body)


# Each refusal gunicorn makes, as its parser raises it -> the status line and code the client gets.
REFUSALS: dict[str, tuple[Callable[[], BaseException], str, str]] = {
    "request-line": (
        lambda: http_errors.InvalidRequestLine("GET /v1/pets/\u0661"),
        "HTTP/1.1 400",
        "invalid_request",
    ),
    "header-value": (
        lambda: http_errors.InvalidHeader("X-Odd"),
        "HTTP/1.1 400",
        "invalid_request",
    ),
    "http-version": (
        lambda: http_errors.InvalidHTTPVersion("HTTP/2.0"),
        "HTTP/1.1 400",
        "invalid_request",
    ),
    "request-line-too-long": (
        lambda: http_errors.LimitRequestLine(9000, 8190),
        "HTTP/1.1 414",
        "uri_too_long",
    ),
    "too-many-headers": (
        lambda: http_errors.LimitRequestHeaders("limit request headers fields"),
        "HTTP/1.1 431",
        "headers_too_large",
    ),
    "transfer-coding": (
        lambda: http_errors.UnsupportedTransferCoding("gzip"),
        "HTTP/1.1 400",
        "invalid_request",
    ),
    "chunk-size": (
        lambda: http_errors.InvalidChunkSize(b"zz"),
        "HTTP/1.1 400",
        "invalid_request",
    ),
    "expectation": (
        lambda: http_errors.ExpectationFailed("bananas"),
        "HTTP/1.1 417",
        "expectation_failed",
    ),
    "gunicorn-itself": (
        lambda: RuntimeError("a bug"),
        "HTTP/1.1 500",
        "internal_error",
    ),
}


@pytest.mark.parametrize("worker_class", [ThreadWorker, SyncWorker], ids=["gthread", "sync"])
@pytest.mark.parametrize(
    ("make_error", "status_line", "code"), REFUSALS.values(), ids=REFUSALS.keys()
)
def test_gunicorn_refusals_are_the_error_json(
    json_refusals: None,
    worker_class: type[Any],
    make_error: Callable[[], BaseException],
    status_line: str,
    code: str,
) -> None:
    """Every refusal of the worker classes the config may choose is the Error JSON, never HTML."""
    got_line, headers, body = refuse(worker_class, make_error())
    status = int(status_line.split()[1])
    # The reason phrase is Python's (http.HTTPStatus), which differs between versions.
    assert got_line.split()[:2] == status_line.split()[:2]
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    assert len(headers["x-request-id"]) == 32
    assert set(body) == {"code", "message", "status"}
    assert (body["code"], body["status"]) == (code, status)
    # The client's bytes are never echoed back.
    assert "\u0661" not in body["message"] and "bananas" not in body["message"]


def test_without_the_override_gunicorn_answers_html(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: gunicorn's own answer, the one the override replaces, is an HTML page."""
    monkeypatch.setattr(gunicorn.util, "write_error", overrides.GUNICORN_WRITE_ERROR)
    cfg = Config()
    worker = ThreadWorker(0, 0, [], None, 30, cfg, Logger(cfg))
    server, client = socket.socketpair()
    with server, client:
        worker.handle_error(None, server, ("127.0.0.1", 5000), http_errors.InvalidHeader("X"))
        server.close()
        received = client.recv(65536)
    assert b"Content-Type: text/html" in received


def test_a_changed_write_error_stops_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another signature of gunicorn.util.write_error: use_json_refusals refuses to guess."""

    def write_error(sock: Any, status_int: int, reason: str, mesg: str, extra: Any) -> None:
        raise AssertionError("never called")

    monkeypatch.setattr(gunicorn.util, "write_error", gunicorn.util.write_error)
    monkeypatch.setattr(overrides, "GUNICORN_WRITE_ERROR", write_error)
    with pytest.raises(overrides.InternalsChanged, match="write_error takes"):
        overrides.use_json_refusals()
    assert gunicorn.util.write_error is not overrides.write_error_json


def test_a_handle_error_that_no_longer_calls_write_error_stops_the_override(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """If Worker.handle_error stops calling util.write_error, the override would do nothing: stop."""
    monkeypatch.setattr(gunicorn.util, "write_error", gunicorn.util.write_error)
    monkeypatch.setattr(overrides, "WRITE_ERROR_CALL", "util.write_html(client)")
    with pytest.raises(overrides.InternalsChanged, match="no longer calls"):
        overrides.use_json_refusals()
