"""Request ids, JSON log lines and the health probes, through the shipped nginx and gunicorn configs."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis

from petstore import db
from tests.support.checks import Answer, call
from tests.support.nginx import DeployedGunicorn, Nginx, parse_lines
from tests.support.redis_servers import RedisServer
from tests.support.servers import LOOPBACK, free_port

READY_TIMEOUT = 0.5
# A probe answers within its own bound plus slack for the rest of the request.
PROBE_WITHIN = READY_TIMEOUT + 1.0
IP_PER_MINUTE = 5
CLIENT = "127.0.0.2"
NGINX_ID = re.compile(r"[0-9a-f]{32}")
ENVIRON = {
    "PETSTORE_PROXY_COUNT": "1",
    "PETSTORE_READY_TIMEOUT": str(READY_TIMEOUT),
    # Small, so that a probe counted against it would soon be refused.
    "PETSTORE_IP_LIMITS": f"{IP_PER_MINUTE}/minute;1000/day",
}


@dataclass
class Observed:
    """Our own Redis; `ready` on the test database, `no_db` where nothing listens; nginx before `ready`."""

    redis: RedisServer
    ready: DeployedGunicorn
    no_db: DeployedGunicorn
    nginx: Nginx


@pytest.fixture(scope="module")
def observed(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    """The module's servers, stopped at the end."""
    workdir = tmp_path_factory.mktemp("observability")
    with RedisServer(workdir / "redis") as redis_server:
        environ = {"RATELIMIT_STORAGE_URI": redis_server.url(), **ENVIRON}
        nowhere = f"postgresql://postgres@{LOOPBACK}:{free_port()}/petstore"
        with (
            DeployedGunicorn(
                {"DATABASE_URL": database_url, **environ}, workdir / "ready.log"
            ) as ready,
            DeployedGunicorn({"DATABASE_URL": nowhere, **environ}, workdir / "no-db.log") as no_db,
            Nginx([ready.address], workdir / "nginx", workers=1) as proxy,
        ):
            yield Observed(redis_server, ready, no_db, proxy)


@pytest.fixture
def servers(observed: Observed, conn: db.Connection) -> Observed:
    """The servers, Redis running and empty (fresh counters), tables empty."""
    if observed.redis.process is None:
        observed.redis.start()
    client = redis.Redis.from_url(observed.redis.url(), socket_timeout=5)
    try:
        client.flushdb()
    finally:
        client.close()
    return observed


def nginx_records(proxy: Nginx, request_ids: list[str]) -> dict[str, dict[str, Any]]:
    """request id -> nginx's access log record of these requests (waiting for them, bounded)."""
    return proxy.logged(request_ids)


# 1. Request ids ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sent", "kept"),
    [
        (None, False),
        ("req-42.abc:def/ghi+jkl=mno@x_y", True),
        ("x" * 128, True),
        ("x" * 129, False),
        ("two words", False),
        ("semi;colon", False),
        ("", False),
    ],
    ids=["absent", "sane", "longest", "too-long", "space", "semicolon", "empty"],
)
def test_request_id_through_nginx(
    servers: Observed, issue_key: Callable[..., str], sent: str | None, kept: bool
) -> None:
    """A sane id is kept end to end; otherwise nginx makes one; response, app log and nginx log agree."""
    key = issue_key("free")
    headers = {"Authorization": f"Bearer {key}"}
    if sent is not None:
        headers["X-Request-ID"] = sent
    answer = call(servers.nginx.url, "GET", "/v1/pets", headers=headers)
    assert answer.status == 200, answer
    request_id = answer.headers["x-request-id"]
    if kept:
        assert request_id == sent
    else:
        assert NGINX_ID.fullmatch(request_id), request_id
    assert servers.ready.logged([request_id])[request_id]["path"] == "/v1/pets"
    assert nginx_records(servers.nginx, [request_id])[request_id]["uri"] == "/v1/pets"


def test_request_id_on_every_answer_and_unique(
    servers: Observed, issue_key: Callable[..., str]
) -> None:
    """Every status carries an id, a new one each time; straight to gunicorn too (the app makes it)."""
    key = issue_key("free")
    auth = {"Authorization": f"Bearer {key}"}
    answers = [
        call(servers.nginx.url, "GET", "/v1/pets", headers=auth),
        call(
            servers.nginx.url,
            "POST",
            "/v1/pets",
            headers=auth,
            json_body={"name": "Rex", "categoryId": 1},
        ),
        call(servers.nginx.url, "GET", "/v1/pets/999999", headers=auth),
        call(servers.nginx.url, "DELETE", "/v1/pets", headers=auth),
        call(servers.nginx.url, "GET", "/v1/pets", headers={"Authorization": "Bearer nope"}),
        call(servers.nginx.url, "GET", "/healthz"),
        call(servers.ready.url, "GET", "/v1/pets", headers=auth),
        call(servers.ready.url, "GET", "/v1/pets", headers={**auth, "X-Request-ID": "bad id"}),
        call(servers.ready.url, "GET", "/v1/pets", headers={**auth, "X-Request-ID": "direct-1"}),
    ]
    assert [answer.status for answer in answers] == [200, 201, 404, 405, 401, 200, 200, 200, 200]
    ids = [answer.headers["x-request-id"] for answer in answers]
    assert len(set(ids)) == len(ids), ids
    assert all(NGINX_ID.fullmatch(request_id) for request_id in ids[:-1]), ids
    assert ids[-1] == "direct-1"


# 2. One JSON object per log line ----------------------------------------------------------------


def test_log_lines_are_json_with_the_request_fields(
    servers: Observed, issue_key: Callable[..., str], conn: db.Connection
) -> None:
    """Each line of gunicorn's output is JSON; each request has its fields; the key never appears."""
    key = issue_key("free")
    (key_row,) = conn.execute("select id from api_keys").fetchall()
    auth = {"Authorization": f"Bearer {key}"}
    url = servers.nginx.url
    # From another loopback address, with a forged X-Forwarded-For: the log names the real client.
    sent = {
        "listed": call(url, "GET", "/v1/pets?limit=5", headers=auth, source=CLIENT),
        "created": call(
            url,
            "POST",
            "/v1/pets",
            headers={**auth, "X-Forwarded-For": "10.1.1.1"},
            json_body={"name": "Rex", "categoryId": 1},
            source=CLIENT,
        ),
        "missing": call(url, "GET", "/v1/pets/424242", headers=auth, source=CLIENT),
        "refused": call(
            url, "GET", "/v1/pets", headers={"Authorization": "Bearer ps_wrong"}, source=CLIENT
        ),
    }
    assert {name: answer.status for name, answer in sent.items()} == {
        "listed": 200,
        "created": 201,
        "missing": 404,
        "refused": 401,
    }

    # gunicorn's own lines and the pool's complaints about a missing database too.
    for server in (servers.ready, servers.no_db):
        lines = server.log_lines()
        parsed = parse_lines(lines)
        not_json = [line for line, record in zip(lines, parsed, strict=True) if record is None]
        assert not not_json, not_json[:5]
        for record in parsed:
            assert record is not None
            assert {"time", "level", "logger", "message"} <= set(record), record

    records = servers.ready.logged([answer.headers["x-request-id"] for answer in sent.values()])
    for answer in sent.values():
        record = records[answer.headers["x-request-id"]]
        assert record["level"] == "info"
        assert record["method"] == answer.method
        assert record["path"] == answer.path.split("?")[0]
        assert record["status"] == answer.status
        assert isinstance(record["duration_ms"], int | float) and record["duration_ms"] >= 0
        assert record["client_ip"] == CLIENT
        expected_key = None if answer is sent["refused"] else key_row["id"]
        assert record["key_id"] == expected_key, record

    nginx_log = nginx_records(servers.nginx, [a.headers["x-request-id"] for a in sent.values()])
    for answer in sent.values():
        entry = nginx_log[answer.headers["x-request-id"]]
        assert (entry["status"], entry["client_ip"]) == (answer.status, CLIENT), entry
    for text in (
        servers.ready.log_path.read_text(),
        servers.nginx.access_log_path.read_text(),
        servers.nginx.error_log_path.read_text() if servers.nginx.error_log_path.exists() else "",
    ):
        assert key not in text and key[3:20] not in text, "a key reached a log"
        assert "ps_wrong" not in text, "a presented token reached a log"


# 3. Probes --------------------------------------------------------------------------------------


def probe(base_url: str, path: str = "/readyz") -> Answer:
    """GET a probe, no key, timed."""
    return call(base_url, "GET", path, timeout=10)


def assert_ready(answer: Answer) -> None:
    """200 and both checks ok."""
    assert answer.status == 200, answer
    assert answer.body["status"] == "ready", answer  # its version and schema: test_versions.py
    assert answer.body["checks"] == {"postgres": "ok", "ratelimit_storage": "ok"}, answer
    assert answer.elapsed < PROBE_WITHIN, answer


def assert_not_ready(answer: Answer, failed: list[str]) -> None:
    """A prompt 503 Error JSON with Retry-After, naming exactly the failed checks."""
    assert answer.status == 503 and answer.is_json_error, answer
    assert answer.body["code"] == "service_unavailable", answer
    assert answer.body["message"] == (
        f"Not ready: {', '.join(failed)} did not answer within {READY_TIMEOUT} s."
    ), answer
    assert (answer.header("retry-after") or "").isdigit(), answer
    assert answer.elapsed < PROBE_WITHIN, answer


def test_readyz_names_what_failed(servers: Observed) -> None:
    """/readyz: 200 with both up; 503 naming postgres, the limiter storage, or both; 200 again."""
    assert_ready(probe(servers.ready.url))
    assert_ready(probe(servers.nginx.url))
    assert_not_ready(probe(servers.no_db.url), ["postgres"])

    servers.redis.stop()
    assert_not_ready(probe(servers.ready.url), ["ratelimit_storage"])
    assert_not_ready(probe(servers.no_db.url), ["postgres", "ratelimit_storage"])
    # nginx passes the app's 503 on as it is: it is an answer, not a failed instance.
    through_nginx = probe(servers.nginx.url)
    assert_not_ready(through_nginx, ["ratelimit_storage"])
    # Liveness does not depend on either.
    for base_url in (servers.ready.url, servers.no_db.url, servers.nginx.url):
        assert probe(base_url, "/healthz").status == 200

    servers.redis.start()
    deadline = time.monotonic() + 10
    while (answer := probe(servers.ready.url)).status != 200:
        assert time.monotonic() < deadline, f"not ready 10 s after Redis came back: {answer}"
        time.sleep(0.1)
    assert_ready(answer)


def test_probes_need_no_key_are_not_limited_nor_logged_at_info(
    servers: Observed, issue_key: Callable[..., str]
) -> None:
    """Many probes, no key: all 200 without rate-limit headers; no info line for them, here or in nginx."""
    answers = [
        probe(base_url, path)
        for _ in range(3 * IP_PER_MINUTE)
        for base_url in (servers.ready.url, servers.nginx.url)
        for path in ("/healthz", "/readyz")
    ]
    for answer in answers:
        assert answer.status == 200, answer
        assert not any(name.startswith("x-ratelimit") for name in answer.headers), answer
    # A request that is logged, as a marker that the log is written up to here.
    marker = call(servers.nginx.url, "GET", "/v1/pets", headers={"Authorization": "Bearer x"})
    assert servers.ready.logged([marker.headers["x-request-id"]]), "the app did not log the marker"
    records = servers.ready.records()
    probes = [
        record
        for record in records
        if record.get("path") in ("/healthz", "/readyz") and record["level"] != "debug"
    ]
    assert not probes, probes[:3]
    assert servers.nginx.logged([marker.headers["x-request-id"]]), "nginx did not log the marker"
    assert not [
        entry for entry in servers.nginx.access_log() if entry["uri"] in ("/healthz", "/readyz")
    ]
