"""Scale-out with the real programs: two gunicorn instances behind nginx on one PostgreSQL and one Redis."""

from __future__ import annotations

import http.client
import itertools
import json
import os
import re
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from petstore import db
from tests.conftest import TEST_REDIS_URL, count_pets
from tests.support.checks import (
    assert_banned,
    assert_error,
    call,
    rate_limit_numbers,
    raw,
    retry_after,
)
from tests.support.nginx import Deployment, Nginx, deploy
from tests.support.servers import LOOPBACK, SilentServer, free_port, poll_until

FREE_PER_MINUTE = 60
IP_PER_MINUTE = 5
BAN_THRESHOLD = 3
BAN_SECONDS = 60
# Settings of both instances. The IP budget is small so that the per-IP test spends it quickly;
# every other test sends a key, which has a budget of its own.
ENVIRON = {
    "PETSTORE_PROXY_COUNT": "1",
    "PETSTORE_IP_LIMITS": f"{IP_PER_MINUTE}/minute;1000/day",
    "PETSTORE_BAN_THRESHOLD": str(BAN_THRESHOLD),
    "PETSTORE_BAN_SECONDS": str(BAN_SECONDS),
}
MAX_BODY_BYTES = 16384
# Loopback addresses other than nginx's own, to be a client nginx can tell apart.
CLIENT_A = "127.0.0.2"
CLIENT_B = "127.0.0.3"
PROXY_UNAVAILABLE = {
    "code": "service_unavailable",
    "message": "No instance of the service answered; retry later.",
    "status": 503,
}


@pytest.fixture(scope="module")
def deployment(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """Two instances on the test database and the test Redis, behind one nginx, for the whole module."""
    environ = {
        "DATABASE_URL": database_url,
        "RATELIMIT_STORAGE_URI": os.environ.get("PETSTORE_TEST_REDIS_URL", TEST_REDIS_URL),
        **ENVIRON,
    }
    with deploy(environ, tmp_path_factory.mktemp("deploy")) as running:
        yield running


# The deployment's workers outlive a test and know a key by its id (petstore.ratelimit.leases):
# its rate, which makes it hot (X-RateLimit-Remaining then shows what the worker's lease holds),
# its lease, its refused window. In production ids never repeat; emptying the tables restarts
# them at 1. So each test's keys start past the ids every earlier test of the module gave out:
# CI saw the 2nd request of a new key id 1 answered from a lease (Remaining 14, not 58), hot from
# the 200 requests an earlier test's key id 1 had made in that worker 1.2 s before.
KEY_IDS_PER_TEST = 1000
TESTS_SO_FAR = itertools.count(1)


@pytest.fixture
def stack(deployment: Deployment, redis_url: str, conn: db.Connection) -> Deployment:
    """The deployment, with empty tables and an empty Redis database (fresh counters), and key
    ids that no earlier test of the module used."""
    assert deployment.instances[0].environ["RATELIMIT_STORAGE_URI"] == redis_url
    first = next(TESTS_SO_FAR) * KEY_IDS_PER_TEST
    conn.execute("select setval(pg_get_serial_sequence('api_keys', 'id'), %s)", [first])
    return deployment


def bearer(key: str) -> dict[str, str]:
    """The Authorization header of a key."""
    return {"Authorization": f"Bearer {key}"}


def ban_rows(conn: db.Connection) -> list[dict[str, Any]]:
    """Every ban, oldest first."""
    return conn.execute("select key_id, banned_until, seconds from bans order by id").fetchall()


# 1. One budget across both instances ---------------------------------------------------------


@pytest.mark.parametrize("route", ["nginx", "direct"])
def test_free_key_gets_exactly_60_across_instances(
    stack: Deployment, issue_key: Callable[..., str], conn: db.Connection, route: str
) -> None:
    """100 requests of a free key, alternating over the instances: 60 x 200, then 429s, then a ban."""
    key = issue_key("free")
    a, b = stack.instances
    if route == "nginx":
        answers = [call(stack.url, "GET", "/v1/pets", headers=bearer(key)) for _ in range(100)]
        ids = [answer.headers["x-request-id"] for answer in answers]
        served = stack.served_by(ids)
        upstreams = [served[request_id] for request_id in ids]
    else:
        upstreams = [(a, b)[number % 2].address for number in range(100)]
        answers = [
            call(f"http://{address}", "GET", "/v1/pets", headers=bearer(key))
            for address in upstreams
        ]

    assert [answer.status for answer in answers] == [200] * 60 + [429] * 40, answers
    # nginx round-robins: both instances served about half, and both served 200s.
    per_instance = Counter(upstreams)
    assert set(per_instance) == {a.address, b.address}, per_instance
    assert min(per_instance.values()) >= 40, per_instance
    ok_by = Counter(
        up for up, answer in zip(upstreams, answers, strict=True) if answer.status == 200
    )
    assert len(ok_by) == 2, ok_by

    now = time.time()
    for expected, answer in zip(range(59, -1, -1), answers[:60], strict=True):
        remaining, reset = rate_limit_numbers(answer, FREE_PER_MINUTE)
        assert remaining == expected, answer
        assert now - 61 <= reset <= now + 61, answer
        assert "retry-after" not in answer.headers, answer
    # Each 429 is a strike; the third bans the key (stored in PostgreSQL, seen by both).
    limited, banned = answers[60:63], answers[63:]
    for answer in limited:
        assert_error(answer, 429, "rate_limited")
        assert rate_limit_numbers(answer, FREE_PER_MINUTE)[0] == 0
        assert retry_after(answer) <= 61
    (ban,) = ban_rows(conn)
    assert ban["seconds"] == BAN_SECONDS, ban
    for answer in banned:
        assert_banned(answer, FREE_PER_MINUTE, ban["banned_until"].timestamp())
    print(f"{route}: requests per instance {dict(per_instance)}; 200s per instance {dict(ok_by)}")


def test_ban_through_one_instance_holds_on_the_other(
    stack: Deployment, issue_key: Callable[..., str], conn: db.Connection
) -> None:
    """Strikes through instance A ban the key; instance B and nginx refuse it at once."""
    key = issue_key("enterprise", per_minute=2, per_day=1000)
    a, b = stack.instances
    first = [call(a.url, "GET", "/v1/pets", headers=bearer(key)) for _ in range(2 + BAN_THRESHOLD)]
    assert [answer.status for answer in first] == [200, 200] + [429] * BAN_THRESHOLD
    for answer in first[2:]:
        assert_error(answer, 429, "rate_limited")
    (ban,) = ban_rows(conn)
    banned_until = ban["banned_until"].timestamp()
    assert ban["seconds"] == BAN_SECONDS, ban

    on_b = call(b.url, "GET", "/v1/pets", headers=bearer(key))
    assert_banned(on_b, 2, banned_until)
    assert retry_after(on_b) >= BAN_SECONDS - 5, on_b
    through_nginx = [call(stack.url, "GET", "/v1/pets", headers=bearer(key)) for _ in range(4)]
    for answer in through_nginx:
        assert_banned(answer, 2, banned_until)
    served = stack.served_by([answer.headers["x-request-id"] for answer in through_nginx])
    assert set(served.values()) == {a.address, b.address}, served
    assert len(ban_rows(conn)) == 1, "banned requests must not add bans"


# 2. What the app sends survives nginx ----------------------------------------------------------


def test_app_headers_pass_through_nginx(stack: Deployment, issue_key: Callable[..., str]) -> None:
    """Location, Link, Deprecation, Sunset, Idempotent-Replayed, WWW-Authenticate, Allow, X-RateLimit-*."""
    key = issue_key("pro")
    pet = {"name": "Rex", "categoryId": 1, "status": "available"}
    idempotent = {**bearer(key), "Idempotency-Key": "deploy-test-1"}

    created = call(stack.url, "POST", "/v1/pets", headers=idempotent, json_body=pet)
    assert created.status == 201, created
    pet_id = created.body["id"]
    assert created.headers["location"] == f"/v1/pets/{pet_id}"
    assert rate_limit_numbers(created, 300)[0] == 299
    assert "idempotent-replayed" not in created.headers
    replayed = call(stack.url, "POST", "/v1/pets", headers=idempotent, json_body=pet)
    assert replayed.status == 201 and replayed.body == created.body, replayed
    assert replayed.headers["idempotent-replayed"] == "true", replayed
    assert replayed.headers["location"] == created.headers["location"]
    other = call(stack.url, "POST", "/v1/pets", headers=bearer(key), json_body=pet)
    assert other.status == 201, other

    page = call(stack.url, "GET", "/v1/pets?limit=1", headers=bearer(key))
    assert page.status == 200, page
    assert page.headers["link"] == f'</v1/pets?limit=1&after={pet_id}>; rel="next"'

    one = call(stack.url, "GET", f"/v1/pets/{pet_id}", headers=bearer(key))
    assert one.status == 200, one
    assert one.headers["deprecation"] == "@1795651200"
    assert one.headers["sunset"] == "Thu, 05 Dec 2030 00:00:00 GMT"
    assert one.headers["link"] == '</v1/pets>; rel="successor-version"'

    not_allowed = call(stack.url, "DELETE", "/v1/pets", headers=bearer(key))
    assert_error(not_allowed, 405, "method_not_allowed")
    assert set(not_allowed.headers["allow"].replace(" ", "").split(",")) >= {"GET", "POST"}

    bad_key = call(stack.url, "GET", "/v1/pets", headers={"Authorization": "Bearer nope"})
    assert_error(bad_key, 401, "unauthorized")
    assert bad_key.headers["www-authenticate"] == 'Bearer realm="petstore", error="invalid_token"'
    assert rate_limit_numbers(bad_key, IP_PER_MINUTE)[0] == IP_PER_MINUTE - 1

    for answer in (created, replayed, other, page, one, not_allowed, bad_key):
        assert re.fullmatch(r"[0-9a-f]{32}", answer.headers["x-request-id"]), answer
        rate_limit_numbers(answer, IP_PER_MINUTE if answer is bad_key else 300)


# 3. The client IP behind nginx ------------------------------------------------------------------


def test_client_ip_is_the_real_client_not_a_forged_header(stack: Deployment) -> None:
    """PETSTORE_PROXY_COUNT=1: the IP budget is the real client's; a forged X-Forwarded-For buys nothing."""
    forged = ["10.0.0.1", CLIENT_B, "10.0.0.3, 10.0.0.4", "203.0.113.9", "10.0.0.5"]
    answers = [
        call(stack.url, "GET", "/v1/pets", headers={"X-Forwarded-For": ip}, source=CLIENT_A)
        for ip in forged
    ]
    for expected, answer in zip(range(IP_PER_MINUTE - 1, -1, -1), answers, strict=True):
        assert_error(answer, 401, "unauthorized")
        assert rate_limit_numbers(answer, IP_PER_MINUTE)[0] == expected, answer
    # The budget of CLIENT_A is spent, whatever it claims to be.
    for headers in ({}, {"X-Forwarded-For": "10.9.9.9"}, {"X-Forwarded-For": CLIENT_B}):
        refused = call(stack.url, "GET", "/v1/pets", headers=headers, source=CLIENT_A)
        assert_error(refused, 429, "rate_limited")
        assert rate_limit_numbers(refused, IP_PER_MINUTE)[0] == 0
        answers.append(refused)
    # Another real client behind the same nginx has a budget of its own: the app does not see
    # nginx's address for everyone.
    other = call(stack.url, "GET", "/v1/pets", source=CLIENT_B)
    assert_error(other, 401, "unauthorized")
    assert rate_limit_numbers(other, IP_PER_MINUTE)[0] == IP_PER_MINUTE - 1

    seen = client_ips(stack, [a.headers["x-request-id"] for a in [*answers, other]])
    for answer in answers:
        assert seen[answer.headers["x-request-id"]] == CLIENT_A, answer
    assert seen[other.headers["x-request-id"]] == CLIENT_B


def client_ips(stack: Deployment, request_ids: list[str]) -> dict[str, str]:
    """request id -> client_ip, from the app's log lines of both instances (waiting, bounded)."""
    wanted = set(request_ids)

    def found() -> dict[str, str]:
        return {
            record["request_id"]: record["client_ip"]
            for server in stack.instances
            for record in server.records()
            if record.get("logger") == "petstore.access" and record["request_id"] in wanted
        }

    return poll_until(found, lambda seen: len(seen) == len(wanted), 5.0)


# 4. Errors nginx makes itself are JSON ---------------------------------------------------------


def padded_pet(size: int) -> bytes:
    """A valid NewPet padded with spaces to exactly `size` bytes."""
    body = json.dumps({"name": "Big", "categoryId": 1}).encode()
    return body[:-1] + b" " * (size - len(body)) + b"}"


def test_body_cap_matches_the_app(stack: Deployment, issue_key: Callable[..., str]) -> None:
    """16384 bytes reach the app (201); 16385, or more sent chunked, are nginx's 413 Error JSON."""
    key = issue_key("free")
    headers = {**bearer(key), "Content-Type": "application/json"}
    fits = call(stack.url, "POST", "/v1/pets", headers=headers, body=padded_pet(MAX_BODY_BYTES))
    assert fits.status == 201, fits
    too_big = call(
        stack.url, "POST", "/v1/pets", headers=headers, body=padded_pet(MAX_BODY_BYTES + 1)
    )
    assert too_big.body == {
        "code": "payload_too_large",
        "message": "The request body is larger than the service accepts.",
        "status": 413,
    }
    assert_error(too_big, 413, "payload_too_large")
    # nginx answered: the app never saw it, so no budget was spent.
    assert "x-ratelimit-limit" not in too_big.headers
    assert re.fullmatch(r"[0-9a-f]{32}", too_big.headers["x-request-id"])

    connection = http.client.HTTPConnection(LOOPBACK, stack.nginx.port, timeout=10)
    try:
        chunks = (b" " * 4096 for _ in range(8))
        connection.request("POST", "/v1/pets", body=chunks, headers=headers, encode_chunked=True)
        response = connection.getresponse()
        chunked = json.loads(response.read())
        assert response.status == 413, chunked
        assert response.getheader("Content-Type") == "application/json"
        assert chunked["code"] == "payload_too_large" and chunked["status"] == 413
    finally:
        connection.close()
    after = call(stack.url, "GET", "/v1/pets", headers=bearer(key))
    assert rate_limit_numbers(after, FREE_PER_MINUTE)[0] == FREE_PER_MINUTE - 2, after


@pytest.mark.parametrize(
    ("request_bytes", "status", "code"),
    [
        (b"GET /v1/pets?" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "uri_too_long"),
        (
            b"GET /v1/pets HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
            431,
            "headers_too_large",
        ),
        (b"NONSENSE\r\n\r\n", 400, "invalid_request"),
        (b"GET /_nginx/503 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 404, "not_found"),
    ],
    ids=["uri-too-long", "header-too-large", "malformed", "error-page-asked-directly"],
)
def test_nginx_refusals_are_json(
    stack: Deployment, request_bytes: bytes, status: int, code: str
) -> None:
    """What nginx refuses before any instance sees it is the Error JSON too, never its HTML pages."""
    answer = raw(stack.url, request_bytes)
    assert_error(answer, status, code)
    assert set(answer.body) == {"code", "message", "status"}, answer
    assert re.fullmatch(r"[0-9a-f]{32}", answer.headers["x-request-id"]), answer.headers


# 5. Failover, and no second try of a POST ----------------------------------------------------


def test_no_instance_answers_is_a_503_json(
    stack: Deployment, issue_key: Callable[..., str], tmp_path: Path
) -> None:
    """Every instance refuses: a prompt 503 Error JSON with Retry-After, for reads and writes."""
    key = issue_key("free")
    dead = [f"{LOOPBACK}:{free_port()}", f"{LOOPBACK}:{free_port()}"]
    with Nginx(dead, tmp_path / "nginx") as proxy:
        answers = [
            call(proxy.url, "GET", "/v1/pets", headers=bearer(key)),
            call(
                proxy.url,
                "POST",
                "/v1/pets",
                headers=bearer(key),
                json_body={"name": "x", "categoryId": 1},
            ),
        ]
    for answer in answers:
        assert answer.status == 503 and answer.body == PROXY_UNAVAILABLE, answer
        assert answer.headers["content-type"] == "application/json"
        assert answer.headers["retry-after"] == "2"
        assert answer.elapsed < 2.0, answer


def test_refused_connection_goes_to_the_other_instance(
    stack: Deployment, issue_key: Callable[..., str], conn: db.Connection, tmp_path: Path
) -> None:
    """One instance down (connection refused): every GET and POST is answered by the other, once."""
    key = issue_key("pro")
    alive = stack.instances[0].address
    with Nginx([f"{LOOPBACK}:{free_port()}", alive], tmp_path / "nginx") as proxy:
        answers = []
        for number in range(10):
            pet = {"name": f"failover {number}", "categoryId": number}
            answers.append(call(proxy.url, "POST", "/v1/pets", headers=bearer(key), json_body=pet))
            answers.append(call(proxy.url, "GET", "/v1/pets", headers=bearer(key)))
        refused = proxy.error_log().count("Connection refused")
    assert [answer.status for answer in answers] == [201, 200] * 10, answers
    assert count_pets(conn) == 10
    assert refused >= 1, "nginx never tried the dead instance: the test proves nothing"


class HangUpServer(SilentServer):
    """Reads each request in full, then closes the connection unanswered: an instance dying mid-request."""

    def __init__(self) -> None:
        super().__init__()
        self.address = f"{LOOPBACK}:{self.port}"
        self.request_lines: list[str] = []

    def handle(self, connection: socket.socket) -> None:
        """Read the request and hang up; one connection at a time is plenty here."""
        with connection:
            connection.settimeout(5)
            self.request_lines.append(read_request(connection))


class HalfAnswerServer(HangUpServer):
    """Answers the head of a 200 and hangs up before its body: an instance killed mid-answer."""

    def handle(self, connection: socket.socket) -> None:
        """Read the request, send a status line and headers promising a body, close."""
        with connection:
            connection.settimeout(5)
            self.request_lines.append(read_request(connection))
            connection.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 81\r\n\r\n"
            )


def test_answer_cut_short_reaches_the_client_as_a_broken_connection(tmp_path: Path) -> None:
    """nginx cannot take back a status line it has passed on: the client sees a cut connection.

    So a client (and the fault tests' load) must treat it like no answer at all and retry,
    with an Idempotency-Key for a POST; `call` raises ConnectionError for it.
    """
    with (
        HalfAnswerServer() as dying,
        Nginx([dying.address], tmp_path / "nginx", workers=1) as proxy,
    ):
        with pytest.raises(ConnectionError, match="cut short"):
            call(proxy.url, "GET", "/v1/pets", headers=bearer("ps_x"))
        assert dying.request_lines == ["GET /v1/pets HTTP/1.1"]
        assert "upstream prematurely closed connection" in proxy.error_log()


def read_request(connection: socket.socket) -> str:
    """Read one HTTP request (head and Content-Length body) from a socket; its request line."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = connection.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    while length and len(body) < int(length.group(1)):
        chunk = connection.recv(65536)
        if not chunk:
            break
        body += chunk
    return head.split(b"\r\n", 1)[0].decode("latin-1")


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_request_that_reached_an_instance_is_retried_only_if_idempotent(
    stack: Deployment,
    issue_key: Callable[..., str],
    conn: db.Connection,
    tmp_path: Path,
    method: str,
) -> None:
    """An instance takes the request and hangs up: nginx retries a GET elsewhere, never a POST."""
    key = issue_key("pro")
    with (
        HangUpServer() as dying,
        Nginx([dying.address, stack.instances[0].address], tmp_path / "nginx", workers=1) as proxy,
    ):
        answers = [
            call(
                proxy.url,
                method,
                "/v1/pets",
                headers=bearer(key),
                json_body={"name": f"once {n}", "categoryId": n} if method == "POST" else None,
            )
            for n in range(3)
        ]
        reached = [line for line in dying.request_lines if line.startswith(method)]
    assert reached, "no request reached the dying instance: the test proves nothing"
    statuses = Counter(answer.status for answer in answers)
    if method == "GET":
        assert statuses == {200: 3}, answers
        return
    # The POST the dying instance took is not sent again: the client sees a 503 and may retry
    # with an Idempotency-Key; the others were created once each.
    assert statuses == {503: len(reached), 201: 3 - len(reached)}, answers
    for answer in answers:
        if answer.status == 503:
            assert answer.body == PROXY_UNAVAILABLE, answer
    assert count_pets(conn) == statuses[201]
