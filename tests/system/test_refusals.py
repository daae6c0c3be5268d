"""Refusals at every layer are the Error JSON: the shipped nginx site, and gunicorn alone (as `make run` serves).

Each request here is one a client can send on purpose or by mistake; whichever layer refuses it,
the answer is the Error JSON of a 4xx (never HTML or text, never a 5xx), and nothing is stored.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from petstore import db
from tests.conftest import count_pets
from tests.support.checks import assert_error, call, raw
from tests.support.nginx import Deployment, Nginx, deploy
from tests.support.servers import LOOPBACK, SilentServer

ENVIRON = {"PETSTORE_PROXY_COUNT": "1", "RATELIMIT_STORAGE_URI": "memory://"}
# The limits both layers share (docs/deploying.rst).
MAX_REQUEST_LINE = 8190
MAX_HEADER_FIELDS = 100
# nginx over plain HTTP and over HTTPS (HTTP/1.1 in TLS; HTTP/2 is tests/system/test_tls.py's).
LAYERS = ["nginx", "nginx-https", "gunicorn"]


@pytest.fixture(scope="module")
def deployment(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """One instance (one worker: memory:// counts in one process) behind nginx, for the module."""
    environ = {"DATABASE_URL": database_url, **ENVIRON}
    with deploy(
        environ, tmp_path_factory.mktemp("edges"), instances=1, workers=1, nginx_workers=1
    ) as running:
        yield running


@pytest.fixture(params=LAYERS)
def layer(request: pytest.FixtureRequest, deployment: Deployment, conn: db.Connection) -> str:
    """The base URL of the layer the client talks to: nginx, or gunicorn straight (empty tables)."""
    if request.param == "nginx":
        return deployment.url
    if request.param == "nginx-https":
        return deployment.nginx.tls_url
    return f"http://{deployment.instances[0].address}"


@pytest.fixture
def key(issue_key: Callable[..., str]) -> str:
    return issue_key("enterprise", per_minute=1000, per_day=10000)


def head(request_line: str, key: str, *extra: bytes) -> bytes:
    """A request head with a key and `Connection: close`, then `extra` header lines."""
    lines = [
        request_line.encode("utf-8"),
        b"Host: petstore.test",
        f"Authorization: Bearer {key}".encode(),
        b"Connection: close",
        *extra,
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def assert_no_traceback(deployment: Deployment) -> None:
    """gunicorn's log has no traceback and no 'Error handling request' (an app or worker crash)."""
    log = "\n".join(deployment.instances[0].log_lines())
    assert "Traceback" not in log and "Error handling request" not in log, log[-3000:]


# 2. gunicorn's refusals ------------------------------------------------------------------------


def test_too_many_header_fields_is_a_431(deployment: Deployment, layer: str, key: str) -> None:
    """200 small headers: gunicorn counts them (nginx has no such limit) and answers the Error JSON."""
    fields = [f"X-Field-{n}: {n}".encode() for n in range(200)]
    answer = raw(layer, head("GET /v1/pets HTTP/1.1", key, *fields))
    assert_error(answer, 431, "headers_too_large")
    assert_no_traceback(deployment)


def test_header_fields_up_to_the_limit_pass(layer: str, key: str) -> None:
    """90 fields (nginx adds a few of its own) are answered by the app."""
    fields = [f"X-Field-{n}: {n}".encode() for n in range(90)]
    answer = raw(layer, head("GET /v1/pets HTTP/1.1", key, *fields))
    assert answer.status == 200, answer


def test_a_long_header_line_is_a_431(layer: str, key: str) -> None:
    """One header line longer than 8 KB: nginx and gunicorn both answer 431 Error JSON."""
    answer = raw(layer, head("GET /v1/pets HTTP/1.1", key, b"X-Big: " + b"a" * 9000))
    assert_error(answer, 431, "headers_too_large")


def test_a_5000_byte_query_string_reaches_the_app(layer: str, key: str) -> None:
    """Below both layers' request-line limit: the app answers it (its own 400 for the bad value)."""
    answer = raw(layer, head("GET /v1/pets?status=" + "a" * 5000 + " HTTP/1.1", key))
    assert_error(answer, 400, "invalid_request")
    assert "errors" in answer.body, answer


def test_a_request_line_over_the_limit_is_a_414(
    deployment: Deployment, layer: str, key: str
) -> None:
    """Above 8190 bytes: the same 414 Error JSON from nginx and from gunicorn."""
    answer = raw(layer, head("GET /v1/pets?status=" + "a" * 9000 + " HTTP/1.1", key))
    assert_error(answer, 414, "uri_too_long")
    assert_no_traceback(deployment)


def test_a_vertical_tab_in_a_header_value_is_a_400(
    deployment: Deployment, layer: str, key: str
) -> None:
    """nginx passes it on; gunicorn refuses it with the Error JSON."""
    answer = raw(layer, head("GET /v1/pets HTTP/1.1", key, b"X-Odd: a\x0bb"))
    assert_error(answer, 400, "invalid_request")
    assert_no_traceback(deployment)


def test_raw_utf8_in_the_path_is_a_400(deployment: Deployment, layer: str, key: str) -> None:
    """`/v1/pets/١` (Arabic-Indic one, not percent-encoded): the Error JSON, not HTML."""
    answer = raw(layer, head("GET /v1/pets/\u0661 HTTP/1.1", key))
    assert_error(answer, 400, "invalid_request")
    assert_no_traceback(deployment)


def test_gunicorn_refusals_name_a_request_id(layer: str, key: str) -> None:
    """Like every other answer, a refusal carries an X-Request-ID (32 hex digits)."""
    answer = raw(layer, head("GET /v1/pets HTTP/1.1", key, b"X-Odd: a\x0bb"))
    assert len(answer.headers["x-request-id"]) == 32, answer.headers


# 3. Only the proxy's own forwarding headers reach the app --------------------------------------

CLIENT_FORWARDING = [
    b"X-Forwarded-Ssl: on",
    b"X-Forwarded-Protocol: ssl",
    b"X-Forwarded-Scheme: https",
    b"X-Url-Scheme: https",
    b"Front-End-Https: on",
    b"Forwarded: for=1.2.3.4;proto=https;host=evil.test",
    b"X-Forwarded-Host: evil.test",
    b"X-Forwarded-Port: 443",
    b"X-Forwarded-Prefix: /evil",
    b"X-Forwarded-Proto: https",
    b"X-Real-IP: 1.2.3.4",
]


@pytest.mark.parametrize("header", CLIENT_FORWARDING, ids=lambda h: h.split(b":")[0].decode())
def test_a_client_scheme_header_breaks_no_request(layer: str, key: str, header: bytes) -> None:
    """Each forwarding header a client may send, alone: the request is answered as usual."""
    answer = raw(layer, head("GET /v1/pets HTTP/1.1", key, header))
    assert answer.status == 200, answer


@pytest.mark.parametrize("header", [b"SCRIPT_NAME: /v1", b"PATH_INFO: /v1/store/orders"])
def test_a_client_cannot_move_the_app_with_wsgi_headers(
    layer: str, key: str, header: bytes
) -> None:
    """gunicorn takes SCRIPT_NAME and PATH_INFO headers from a loopback peer unless told not to."""
    answer = raw(layer, head("GET /v1/pets HTTP/1.1", key, header))
    assert answer.status == 200 and answer.body == [], answer


class RecordingServer(SilentServer):
    """An upstream that records each request head and answers 200 with an empty JSON object."""

    def __init__(self) -> None:
        super().__init__()
        self.address = f"{LOOPBACK}:{self.port}"
        self.heads: list[bytes] = []
        self.lock = threading.Lock()

    def handle(self, connection: socket.socket) -> None:
        """Read one head, record it, answer and close."""
        with connection:
            connection.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data and (chunk := connection.recv(65536)):
                data += chunk
            with self.lock:
                self.heads.append(data.partition(b"\r\n\r\n")[0])
            connection.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: 2\r\nConnection: close\r\n\r\n{}"
            )


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_nginx_passes_only_its_own_forwarding_headers(tmp_path: Path, scheme: str) -> None:
    """What the app receives: nginx's X-Forwarded-For/-Proto/-Host, none of the client's others.

    Over HTTPS the app is told "https", whatever the client claims.
    """
    with (
        RecordingServer() as upstream,
        Nginx([upstream.address], tmp_path / "nginx", workers=1) as proxy,
    ):
        url = proxy.tls_url if scheme == "https" else proxy.url
        answer = raw(url, head("GET /v1/pets HTTP/1.1", "ps_x", *CLIENT_FORWARDING))
        assert answer.status == 200, answer
        [received] = upstream.heads
    lines = received.decode("latin-1").split("\r\n")[1:]
    headers = {name.lower(): value.strip() for name, _, value in (h.partition(":") for h in lines)}
    forwarding = {
        name: value
        for name, value in headers.items()
        if name.startswith(("x-forwarded", "forwarded", "x-real", "x-url", "front-end"))
    }
    assert forwarding == {
        "x-forwarded-for": "127.0.0.1",
        "x-forwarded-proto": scheme,
        "x-forwarded-host": "petstore.test",
    }, received


# 4. nginx's own refusals -----------------------------------------------------------------------


def test_trace_is_a_405(layer: str, key: str) -> None:
    """TRACE: nginx refuses it itself, the app answers it; both with the 405 Error JSON."""
    answer = raw(layer, head("TRACE /v1/pets HTTP/1.1", key))
    assert_error(answer, 405, "method_not_allowed")


@pytest.mark.parametrize("coding", [b"gzip, chunked", b"chunked, chunked", b"gzip"])
def test_an_unsupported_transfer_coding_is_a_400(
    deployment: Deployment, layer: str, key: str, conn: db.Connection, coding: bytes
) -> None:
    """Not a 501 (a client's mistake is never a 5xx): the 400 Error JSON, and nothing stored."""
    request = head(
        "POST /v1/pets HTTP/1.1",
        key,
        b"Content-Type: application/json",
        b"Transfer-Encoding: " + coding,
    )
    answer = raw(layer, request + b'1d\r\n{"name":"Rex","categoryId":1}\r\n0\r\n\r\n')
    assert_error(answer, 400, "invalid_request")
    assert count_pets(conn) == 0
    assert_no_traceback(deployment)


@pytest.mark.parametrize("version", ["HTTP/2.0", "HTTP/3.0", "HTTP/2"])
def test_an_unsupported_http_version_is_a_400(layer: str, key: str, version: str) -> None:
    """`GET /v1/pets HTTP/2.0` as text: not a 505 (the client's mistake), the 400 Error JSON."""
    answer = raw(layer, head(f"GET /v1/pets {version}", key))
    assert_error(answer, 400, "invalid_request")


# 5. A malformed chunked body -------------------------------------------------------------------

BROKEN_CHUNKS = {
    "size-zz": b"zz\r\nhello\r\n0\r\n\r\n",
    "size-minus-one": b"-1\r\nhello\r\n0\r\n\r\n",
    "size-line-100kb": b"1" * 102_400 + b"\r\nhello\r\n0\r\n\r\n",
    "no-crlf-after-data": b'1d\r\n{"name":"Rex","categoryId":1}XX0\r\n\r\n',
}


@pytest.mark.parametrize("body", BROKEN_CHUNKS.values(), ids=BROKEN_CHUNKS.keys())
def test_a_malformed_chunked_body_is_a_400(
    deployment: Deployment, layer: str, key: str, conn: db.Connection, body: bytes
) -> None:
    """A chunk size of zz, -1 or 100 KB, or no CRLF after the data: 400, no traceback, no pet."""
    request = head(
        "POST /v1/pets HTTP/1.1",
        key,
        b"Content-Type: application/json",
        b"Transfer-Encoding: chunked",
    )
    answer = raw(layer, request + body)
    assert_error(answer, 400, "invalid_request")
    assert count_pets(conn) == 0
    assert_no_traceback(deployment)


def test_a_wellformed_chunked_body_is_stored(layer: str, key: str, conn: db.Connection) -> None:
    """The control: the same request with a correct chunked body creates the pet."""
    request = head(
        "POST /v1/pets HTTP/1.1",
        key,
        b"Content-Type: application/json",
        b"Transfer-Encoding: chunked",
    )
    answer = raw(layer, request + b'1d\r\n{"name":"Rex","categoryId":1}\r\n0\r\n\r\n')
    assert answer.status == 201, answer
    assert count_pets(conn) == 1


# 7. Edges: an empty path segment, OPTIONS ------------------------------------------------------


def test_an_empty_path_segment_is_a_404(layer: str, key: str) -> None:
    """`/v1//pets` names no resource: the 404 Error JSON, no redirect built from the client's Host."""
    answer = raw(layer, head("GET /v1//pets HTTP/1.1", key))
    assert_error(answer, 404, "not_found")
    assert "location" not in answer.headers, answer.headers


@pytest.mark.parametrize("path", ["/v1/pets", "/v1/pets/1", "/v1/store/orders"])
def test_options_is_a_405(layer: str, key: str, path: str) -> None:
    """No CORS, no automatic OPTIONS: the 405 Error JSON with the methods the resource has."""
    answer = raw(layer, head(f"OPTIONS {path} HTTP/1.1", key))
    assert_error(answer, 405, "method_not_allowed")
    assert "OPTIONS" not in answer.headers["allow"], answer.headers
    assert "GET" in answer.headers["allow"], answer.headers


# Issue 13, 8: nginx's access log -----------------------------------------------------------------


def test_a_refused_post_is_logged_as_a_post(deployment: Deployment, key: str) -> None:
    """nginx answers a too-big POST from its 413 error page (an internal GET): the log says POST."""
    answer = call(
        deployment.url,
        "POST",
        "/v1/pets",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        body=b"{" + b" " * 20000 + b"}",
    )
    assert_error(answer, 413, "payload_too_large")
    request_id = answer.headers["x-request-id"]
    entry = deployment.nginx.logged([request_id])[request_id]
    assert (entry["method"], entry["uri"], entry["status"]) == ("POST", "/v1/pets", 413), entry


def test_a_body_too_slow_gets_no_answer_rather_than_html(deployment: Deployment, key: str) -> None:
    """nginx's 408 (client_body_timeout, 10 s) sends nothing: the connection closes, no page at all."""
    request_id = "slow-body-408"
    request = head(
        "POST /v1/pets HTTP/1.1",
        key,
        b"Content-Type: application/json",
        b"Content-Length: 100",
        f"X-Request-ID: {request_id}".encode(),
    )
    with socket.create_connection((LOOPBACK, deployment.nginx.port), timeout=30) as sock:
        sock.sendall(request + b"{")
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    assert received == b""
    entry = deployment.nginx.logged([request_id])[request_id]
    assert (entry["method"], entry["status"], entry["upstream"]) == ("POST", 408, ""), entry
