"""Answers and the checks on them, for every HTTP test: one Answer, one Error check.

The Error JSON every failure must answer (assert_error, Answer.is_json_error); clients that
return an Answer: timed GETs through the test client or requests, http.client (call), raw
bytes (raw); bursts; chunked POSTs.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import math
import re
import socket
import ssl
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests
from flask import Flask
from flask.testing import FlaskClient
from requests.structures import CaseInsensitiveDict
from werkzeug.test import TestResponse

ERROR_FIELDS = {"code", "message", "status"}


@dataclass
class Answer:
    """What one request got back, and how long it took.

    The same for every client here (the Flask test client, requests, http.client, raw bytes):
    `headers` is looked up in any case, and iterates its names in lower case.
    """

    method: str
    path: str
    status: int
    body: Any
    headers: CaseInsensitiveDict[str]
    elapsed: float
    started: float = 0.0
    raw: bytes = field(default=b"", repr=False)
    # Wall-clock time of the answer, for checks of a moment it names (a ban's end).
    received: float = field(default_factory=time.time)

    @classmethod
    def of(
        cls,
        method: str,
        path: str,
        status: int,
        body: Any,
        headers: Iterable[tuple[str, str]],
        **more: Any,
    ) -> Answer:
        """An Answer with its header names in lower case."""
        lowered = CaseInsensitiveDict({name.lower(): value for name, value in headers})
        return cls(method, path, status, body, lowered, **more)

    def header(self, name: str) -> str | None:
        """A response header by name, any case."""
        return self.headers.get(name)

    @property
    def is_json_error(self) -> bool:
        """Exactly the Error JSON of its own status, as application/json."""
        return not error_problems(self.status, self.header("content-type"), self.body)


def error_problems(status: int, content_type: str | None, body: Any) -> list[str]:
    """What keeps an answer of this status from being exactly the Error JSON ([] when nothing does).

    Exactly {code, message, status} (+ a non-empty `errors` on a 400), `status` its own status,
    a non-empty message, as application/json.
    """
    if content_type != "application/json":
        return [f"content type {content_type!r}, not application/json"]
    if not isinstance(body, dict):
        return [f"a body that is not a JSON object: {body!r}"]
    problems = []
    if not ERROR_FIELDS <= set(body):
        problems.append(f"fields {sorted(ERROR_FIELDS - set(body))} missing")
    if not set(body) - ERROR_FIELDS <= ({"errors"} if status == 400 else set()):
        problems.append(f"fields {sorted(set(body) - ERROR_FIELDS)} beyond the Error's")
    if body.get("status") != status:
        problems.append(f"status {body.get('status')!r} in the body of a {status}")
    if not isinstance(body.get("code"), str):
        problems.append("no code")
    if not (isinstance(body.get("message"), str) and body["message"]):
        problems.append("no message")
    if "errors" in body and not (isinstance(body["errors"], dict) and body["errors"]):
        problems.append("an empty `errors`")
    return problems


def assert_error(answer: TestResponse | Answer, status: int, code: str) -> dict[str, Any]:
    """The answer is the Error JSON of this status and code, exactly {code, message, status} (+ errors on 400).

    For the Flask test client's response and for an Answer alike; the body, for further checks.
    """
    if isinstance(answer, Answer):
        got, content_type, body = answer.status, answer.header("content-type"), answer.body
        method, data = answer.method, answer.raw
    else:
        got, content_type = answer.status_code, answer.headers.get("Content-Type")
        body = answer.get_json(silent=True)
        method, data = answer.request.method, answer.get_data()
    assert got == status, answer
    # Whichever layer wrote it (app, gunicorn, nginx), the body ends with a newline, as Flask's
    # jsonify ends its bodies.
    assert method == "HEAD" or data == b"" or data.endswith(b"\n"), answer
    assert error_problems(status, content_type, body) == [], (
        error_problems(status, content_type, body),
        answer,
    )
    assert body["code"] == code, answer
    result: dict[str, Any] = body
    return result


def rate_limit_numbers(answer: Answer, limit: int) -> tuple[int, int]:
    """X-RateLimit-Limit/-Remaining/-Reset are whole numbers, the limit this one; (remaining, reset)."""
    for name in ("X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset"):
        assert re.fullmatch(r"\d+", answer.header(name) or ""), (name, answer)
    assert int(answer.headers["X-RateLimit-Limit"]) == limit, answer
    return int(answer.headers["X-RateLimit-Remaining"]), int(answer.headers["X-RateLimit-Reset"])


def retry_after(answer: Answer) -> int:
    """Retry-After as whole seconds, at least 1."""
    value = answer.header("Retry-After") or ""
    assert re.fullmatch(r"\d+", value) and int(value) >= 1, answer
    return int(value)


def assert_banned(answer: Answer, limit: int, banned_until: float) -> None:
    """429 api_key_banned: Remaining 0, Reset the ban's end, Retry-After the seconds until then."""
    assert_error(answer, 429, "api_key_banned")
    remaining, reset = rate_limit_numbers(answer, limit)
    assert remaining == 0, answer
    assert reset == math.ceil(banned_until), answer
    # Against the moment the answer came, not now: answers of a burst are checked afterwards.
    assert 1 <= retry_after(answer) <= math.ceil(banned_until - answer.received) + 1, answer


def pass_key_cache_bound(app: Flask) -> None:
    """Move `app` past its key cache's bound (KEY_CACHE_SECONDS), as if that long had passed
    since a change to a key: every row it holds is then read again (petstore.keycache)."""
    cache = app.extensions["petstore.key_cache"]
    clock, seconds = cache.clock, cache.seconds
    cache.clock = lambda: clock() + seconds


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
        body = response.get_json(silent=True)
        return Answer.of(
            "GET", "/v1/pets", response.status_code, body, response.headers.items(), elapsed=elapsed
        )

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
        return Answer.of(
            "GET", "/v1/pets", response.status_code, body, response.headers.items(), elapsed=elapsed
        )

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


def call(
    base_url: str,
    method: str,
    path: str,
    *,
    headers: Mapping[str, str] | None = None,
    body: bytes | None = None,
    json_body: Any = None,
    timeout: float = 10.0,
    source: str | None = None,
    connection: http.client.HTTPConnection | None = None,
) -> Answer:
    """One request with http.client (from `source` as client address if given), timed.

    A timeout or a broken connection raises OSError, which callers that count outcomes catch: an
    answer cut short (its server killed between the headers and the body) is a ConnectionError too.
    """
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    own = connection is None
    if connection is None:
        connection = http.client.HTTPConnection(
            host, int(port), timeout=timeout, source_address=(source, 0) if source else None
        )
    sent_headers = dict(headers or {})
    if json_body is not None:
        body = json.dumps(json_body).encode()
        sent_headers.setdefault("Content-Type", "application/json")
    started = time.monotonic()
    try:
        connection.request(method, path, body=body, headers=sent_headers)
        response = connection.getresponse()
        raw = response.read()
    except http.client.HTTPException as exc:
        connection.close()
        raise ConnectionError(f"the answer was cut short: {exc!r}") from exc
    except BaseException:
        connection.close()
        raise
    finally:
        if own:
            connection.close()
    elapsed = time.monotonic() - started
    try:
        parsed: Any = json.loads(raw) if raw else None
    except ValueError:
        parsed = raw.decode("utf-8", errors="replace")
    return Answer.of(
        method,
        path,
        response.status,
        parsed,
        response.getheaders(),
        elapsed=elapsed,
        started=started,
        raw=raw,
    )


def raw(base_url: str, data: bytes, timeout: float = 10.0) -> Answer:
    """Send bytes exactly as they are (no client library to tidy them up); the answer, read to EOF.

    For requests no HTTP client would send: malformed lines, odd headers, broken chunked bodies.
    Send `Connection: close` (or a request the server refuses, which closes) so that EOF comes.
    An https:// URL sends them over TLS (HTTP/1.1), trusting any certificate: the tests' own
    servers make theirs, and what is checked here is the answer.
    """
    tls = base_url.startswith("https://")
    host, port = base_url.removeprefix("https://").removeprefix("http://").rsplit(":", 1)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        sock = stack.enter_context(socket.create_connection((host, int(port)), timeout=timeout))
        if tls:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            context.set_alpn_protocols(["http/1.1"])
            sock = stack.enter_context(context.wrap_socket(sock, server_hostname=host))
        sock.sendall(data)
        received = b""
        # A TLS server may close without close_notify once it answered: that is the end too.
        with contextlib.suppress(ssl.SSLEOFError):
            while chunk := sock.recv(65536):
                received += chunk
    elapsed = time.monotonic() - started
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = []
    for line in header_lines:
        name, _, value = line.partition(":")
        headers.append((name.strip(), value.strip()))
    try:
        parsed: Any = json.loads(body) if body else None
    except ValueError:
        parsed = body.decode("utf-8", errors="replace")
    method, _, rest = data.partition(b" ")
    path = rest.partition(b" ")[0]
    return Answer.of(
        method.decode("latin-1"),
        path.decode("latin-1"),
        int(status_line.split()[1]),
        parsed,
        headers,
        elapsed=elapsed,
        started=started,
        raw=received,
    )


def every_status(app: Flask, key: str) -> dict[int, TestResponse]:
    """One answer of each status a /v1 request can get from `app` with this key (and without one).

    Adds GET /v1/boom, a view that fails, for the 500.
    """

    def boom() -> str:
        raise RuntimeError("boom")

    app.add_url_rule("/v1/boom", "boom", boom)
    client = app.test_client()
    auth = {"Authorization": f"Bearer {key}"}
    return {
        200: client.get("/v1/pets", headers=auth),
        201: client.post("/v1/pets", json={"name": "Rex", "categoryId": 1}, headers=auth),
        400: client.get("/v1/pets?limit=0", headers=auth),
        401: client.get("/v1/pets"),
        404: client.get("/v1/no/such/path", headers=auth),
        405: client.delete("/v1/pets", headers=auth),
        413: client.post(
            "/v1/pets",
            data=b"{" + b" " * 20000 + b"}",
            content_type="application/json",
            headers=auth,
        ),
        415: client.post("/v1/pets", data="x", content_type="text/plain", headers=auth),
        500: client.get("/v1/boom", headers=auth),
        501: client.get("/v1/store/orders", headers=auth),
    }
