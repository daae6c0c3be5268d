"""What an operator controls on a key, over HTTP and the CLI: expiry, scopes and rotation (issue 14)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable

import psycopg
import pytest
from click.testing import Result
from flask import Flask
from flask.testing import FlaskClient

from petstore import db
from petstore.auth import needs_scope
from tests.conftest import Cli, count_pets
from tests.support.checks import assert_error, pass_key_cache_bound

KEY = re.compile(r"ps_[A-Za-z0-9_-]{43}")
INSUFFICIENT_SCOPE = 'Bearer realm="petstore", error="insufficient_scope", scope="write"'
NEW_PET = {"name": "Rex", "categoryId": 1}


def printed_key(result: Result) -> str:
    assert result.exit_code == 0, result.output
    last = result.stdout.splitlines()[-1]
    assert KEY.fullmatch(last), last
    return last


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def key_id(conn: db.Connection, key: str) -> int:
    row = conn.execute(
        "select id from api_keys where key_hash = %s", [hashlib.sha256(key.encode()).digest()]
    ).fetchone()
    assert row is not None
    return int(row["id"])


def table(conn: db.Connection) -> list[dict[str, object]]:
    return conn.execute("select * from api_keys order by id").fetchall()


def assert_one_line_refusal(result: Result, *words: str, exit_code: int = 2) -> None:
    assert result.exit_code == exit_code, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    for word in words:
        assert word in lines[0]


# expiry


def expire_now(conn: db.Connection, key: str) -> None:
    """Move the key's life into the past (the constraint forbids creating it so)."""
    conn.execute(
        "update api_keys set created_at = now() - interval '2 days',"
        " expires_at = now() - interval '1 second' where id = %s",
        [key_id(conn, key)],
    )


def test_a_key_works_until_it_expires_then_gets_its_own_401(
    cli: Cli, conn: db.Connection, client: FlaskClient
) -> None:
    key = printed_key(cli("keys", "create", "--plan", "free", "--expires-in", "90d"))
    assert client.get("/v1/pets", headers=bearer(key)).status_code == 200

    expire_now(conn, key)
    pass_key_cache_bound(client.application)
    response = client.get("/v1/pets", headers=bearer(key))

    body = assert_error(response, 401, "unauthorized")
    assert body["message"] == "The API key has expired."
    assert response.headers["WWW-Authenticate"] == 'Bearer realm="petstore", error="invalid_token"'
    unknown = client.get("/v1/pets", headers=bearer("ps_" + "A" * 43))
    assert unknown.get_json()["message"] != body["message"]


@pytest.mark.parametrize(
    ("option", "value", "seconds"),
    [
        ("--expires-in", "90d", 90 * 86400),
        ("--expires-in", "12h", 12 * 3600),
        ("--expires-in", "30m", 30 * 60),
    ],
)
def test_expires_in_sets_the_expiry(
    cli: Cli, conn: db.Connection, option: str, value: str, seconds: int
) -> None:
    printed_key(cli("keys", "create", "--plan", "free", option, value))
    row = conn.execute(
        "select extract(epoch from expires_at - created_at) as s from api_keys"
    ).fetchone()
    assert row is not None
    assert abs(float(row["s"]) - seconds) < 60


def test_expires_at_and_keys_list_shows_it(cli: Cli, conn: db.Connection) -> None:
    printed_key(cli("keys", "create", "--plan", "pro", "--expires-at", "2099-01-31T12:00:00Z"))
    printed_key(cli("keys", "create", "--plan", "free", "--label", "forever"))
    expired = printed_key(cli("keys", "create", "--plan", "free", "--expires-in", "1h"))
    expire_now(conn, expired)

    lines = cli("keys", "list").stdout.splitlines()

    assert "expires" in lines[0].split()
    assert "2099-01-31 12:00:00+0000" in lines[1]
    assert "never" in lines[2].split() and "live" in lines[2].split()
    assert "expired" in lines[3].split()


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["--expires-in", "0d"], id="zero"),
        pytest.param(["--expires-in", "soon"], id="words"),
        pytest.param(["--expires-in", "-5d"], id="negative"),
        pytest.param(["--expires-in", "5w"], id="unknown-unit"),
        pytest.param(["--expires-at", "2001-01-01T00:00:00Z"], id="past"),
        pytest.param(["--expires-at", "tomorrow"], id="not-iso"),
        pytest.param(["--expires-in", "1d", "--expires-at", "2099-01-01"], id="both"),
        pytest.param(["--scope", "admin"], id="unknown-scope"),
        pytest.param(["--scope", "read,delete"], id="one-unknown-scope"),
    ],
)
def test_bad_key_options_are_one_line_exit_2_and_store_nothing(
    cli: Cli, conn: db.Connection, args: list[str]
) -> None:
    result = cli("keys", "create", "--plan", "free", *args)

    assert_one_line_refusal(result, args[0])
    assert table(conn) == []


def test_the_database_refuses_an_expiry_in_the_past(conn: db.Connection) -> None:
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute(
            "insert into api_keys (key_hash, prefix, plan, expires_at)"
            " values (%s, 'ps_x', 'free', now() - interval '1 minute')",
            [b"x" * 32],
        )


# scopes


def test_a_read_key_lists_and_gets_but_may_not_create(
    cli: Cli, conn: db.Connection, client: FlaskClient
) -> None:
    key = printed_key(cli("keys", "create", "--plan", "free", "--scope", "read"))
    created = client.post(
        "/v1/pets",
        json=NEW_PET,
        headers=bearer(printed_key(cli("keys", "create", "--plan", "free"))),
    )
    assert created.status_code == 201
    pets_before = count_pets(conn)

    assert client.get("/v1/pets", headers=bearer(key)).status_code == 200
    assert client.get("/v1/pets/1", headers=bearer(key)).status_code in (200, 410)
    refused = client.post("/v1/pets", json=NEW_PET, headers=bearer(key))

    body = assert_error(refused, 403, "insufficient_scope")
    assert "write" in body["message"]
    assert refused.headers.get_all("WWW-Authenticate") == [INSUFFICIENT_SCOPE]
    assert count_pets(conn) == pets_before


def test_the_403_spends_budget_like_any_answer(cli: Cli, client: FlaskClient) -> None:
    key = printed_key(cli("keys", "create", "--plan", "free", "--scope", "read"))
    first = client.post("/v1/pets", json=NEW_PET, headers=bearer(key))
    second = client.post("/v1/pets", json=NEW_PET, headers=bearer(key))

    assert first.status_code == second.status_code == 403
    assert int(first.headers["X-RateLimit-Remaining"]) == 59
    assert int(second.headers["X-RateLimit-Remaining"]) == 58


def throwaway_app(make_app: Callable[..., Flask]) -> Flask:
    """The app with views no operation has: unmarked POST and GET ones, and a POST lowered to read."""
    app = make_app()

    def unmarked() -> tuple[str, int]:
        return "", 204

    def lowered() -> tuple[str, int]:
        return "", 204

    app.add_url_rule("/v1/_throwaway", "throwaway", unmarked, methods=["GET", "POST", "DELETE"])
    app.add_url_rule(
        "/v1/_throwaway_read", "throwaway_read", needs_scope("read")(lowered), methods=["POST"]
    )
    return app


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        pytest.param("POST", "/v1/_throwaway", 403, id="unmarked-post-needs-write"),
        pytest.param("DELETE", "/v1/_throwaway", 403, id="unmarked-delete-needs-write"),
        pytest.param("GET", "/v1/_throwaway", 204, id="unmarked-get-needs-read"),
        pytest.param("HEAD", "/v1/_throwaway", 204, id="unmarked-head-needs-read"),
        pytest.param("POST", "/v1/_throwaway_read", 204, id="post-lowered-to-read"),
    ],
)
def test_a_view_without_a_mark_needs_the_scope_of_its_method(
    make_app: Callable[..., Flask], cli: Cli, method: str, path: str, status: int
) -> None:
    """A new write view that forgets needs_scope("write") still refuses read-only keys."""
    read = printed_key(cli("keys", "create", "--plan", "free", "--scope", "read"))
    both = printed_key(cli("keys", "create", "--plan", "free"))
    client = throwaway_app(make_app).test_client()

    answer = client.open(path, method=method, headers=bearer(read))
    assert client.open(path, method=method, headers=bearer(both)).status_code == 204

    assert answer.status_code == status
    if status == 403:
        assert_error(answer, 403, "insufficient_scope")
        assert answer.headers.get_all("WWW-Authenticate") == [INSUFFICIENT_SCOPE]


def test_default_scopes_are_read_and_write(cli: Cli, conn: db.Connection) -> None:
    printed_key(cli("keys", "create", "--plan", "free"))
    printed_key(cli("keys", "create", "--plan", "free", "--scope", "write", "--scope", "read"))
    assert [row["scopes"] for row in table(conn)] == [["read", "write"], ["write", "read"]]


@pytest.mark.parametrize("scopes", [["admin"], [], ["read", None]])
def test_the_database_refuses_a_scope_outside_the_set(
    conn: db.Connection, scopes: list[str | None]
) -> None:
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute(
            "insert into api_keys (key_hash, prefix, plan, scopes) values (%s, 'ps_x', 'free', %s)",
            [b"x" * 32, scopes],
        )


# rotation


def rotate(cli: Cli, key_id: int, *args: str) -> str:
    result = cli("keys", "rotate", str(key_id), *args)
    assert "the old secret works until" in result.stdout
    return printed_key(result)


def test_rotation_keeps_the_key_and_its_budget_and_the_old_secret_for_the_grace(
    cli: Cli, conn: db.Connection, client: FlaskClient
) -> None:
    old = printed_key(cli("keys", "create", "--plan", "free", "--label", "app"))
    ident = key_id(conn, old)
    for _ in range(3):
        client.get("/v1/pets", headers=bearer(old))

    new = rotate(cli, ident, "--grace", "1h")

    assert new != old and key_id(conn, new) == ident
    with_new = client.get("/v1/pets", headers=bearer(new))
    with_old = client.get("/v1/pets", headers=bearer(old))
    assert with_new.status_code == with_old.status_code == 200
    # One budget: the counts before the rotation are still spent.
    assert with_new.headers["X-RateLimit-Remaining"] == "56"
    assert with_old.headers["X-RateLimit-Remaining"] == "55"
    assert [(row["plan"], row["label"]) for row in table(conn)] == [("free", "app")]

    conn.execute("update api_keys set previous_valid_until = now() where id = %s", [ident])
    pass_key_cache_bound(client.application)
    after_grace = client.get("/v1/pets", headers=bearer(old))
    body = assert_error(after_grace, 401, "unauthorized")
    assert body["message"] == "The API key is not valid."
    assert client.get("/v1/pets", headers=bearer(new)).status_code == 200


def test_rotation_does_not_end_a_ban(
    make_app: Callable[..., Flask], cli: Cli, conn: db.Connection
) -> None:
    client = make_app(BAN_THRESHOLD=1).test_client()
    old = printed_key(
        cli("keys", "create", "--plan", "enterprise", "--per-minute", "1", "--per-day", "100")
    )
    for _ in range(2):
        client.get("/v1/pets", headers=bearer(old))

    new = rotate(cli, key_id(conn, old))

    banned = client.get("/v1/pets", headers=bearer(new))
    assert_error(banned, 429, "api_key_banned")


def test_rotating_twice_keeps_only_the_last_previous_secret(
    cli: Cli, conn: db.Connection, client: FlaskClient
) -> None:
    first = printed_key(cli("keys", "create", "--plan", "free"))
    second = rotate(cli, key_id(conn, first))
    third = rotate(cli, key_id(conn, second))

    assert client.get("/v1/pets", headers=bearer(first)).status_code == 401
    assert client.get("/v1/pets", headers=bearer(second)).status_code == 200
    assert client.get("/v1/pets", headers=bearer(third)).status_code == 200


@pytest.mark.parametrize(
    ("target", "args", "words", "exit_code"),
    [
        pytest.param("unknown", [], ["no live key"], 3, id="unknown"),
        pytest.param("revoked", [], ["no live key"], 3, id="revoked"),
        pytest.param("not-a-number", [], ["is not a key id"], 2, id="not-a-number"),
        pytest.param("live", ["--grace", "0h"], ["--grace"], 2, id="zero-grace"),
        pytest.param("live", ["--grace", "a while"], ["--grace"], 2, id="bad-grace"),
    ],
)
def test_bad_rotations_are_one_line_and_change_nothing(
    cli: Cli, conn: db.Connection, target: str, args: list[str], words: list[str], exit_code: int
) -> None:
    """A usage error exits 2, no such (live) key 3, as for every command on a key."""
    live = printed_key(cli("keys", "create", "--plan", "free"))
    revoked = printed_key(cli("keys", "create", "--plan", "free"))
    assert cli("keys", "revoke", str(key_id(conn, revoked))).exit_code == 0
    ids = {
        "unknown": "999",
        "revoked": str(key_id(conn, revoked)),
        "not-a-number": "abc",
        "live": str(key_id(conn, live)),
    }
    before = table(conn)

    result = cli("keys", "rotate", ids[target], *args)

    assert_one_line_refusal(result, *words, exit_code=exit_code)
    assert table(conn) == before
