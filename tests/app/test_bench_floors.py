"""The benchmark's floors (bench/floor.py, bench/flask_floor.py) answer its requests as the service does.

`make bench` compares answers before it measures; these catch a floor drifting from the service
without running the benchmark: status, body bytes and Link, and the bare-Flask floor's counter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from flask import Flask
from werkzeug.test import Client

from bench.flask_floor import create_flask_floor
from bench.floor import create_floor
from petstore import config, db
from petstore.queries import pets

PATHS = (
    "/v1/pets?limit=2",
    "/v1/pets?limit=2&status=available",
    "/v1/pets?limit=2&after=2",
    "/v1/pets?limit=100",
    "/v1/pets/1",
    "/v1/pets/999",
)


@pytest.fixture
def seeded(conn: db.Connection) -> None:
    for number, status in enumerate(("available", None, "sold", "available", "pending")):
        pets.insert_pet(conn, name=f"pet {number}", category_id=number + 1, status=status)


@pytest.fixture(params=["memory", "redis"])
def storage(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return "memory://"
    url: str = request.getfixturevalue("redis_url")
    return url


@pytest.fixture
def floors(database_url: str, storage: str) -> Iterator[dict[str, Client]]:
    """The bare-Flask floor on the storage, and the raw floor; their pools closed after the test."""
    settings: dict[str, Any] = {
        **config.from_environ({"DATABASE_URL": database_url}),
        "RATELIMIT_STORAGE_URI": storage,
    }
    flask_floor = create_flask_floor(settings)
    pool = db.open_pool(settings, name="floor-test")
    try:
        yield {
            "bare-Flask floor": flask_floor.test_client(),
            "raw floor": Client(create_floor(settings, pool)),
        }
    finally:
        flask_floor.extensions["pool"].close()
        pool.close()


def test_the_floors_answer_as_the_service(
    seeded: None,
    make_app: Callable[..., Flask],
    storage: str,
    floors: dict[str, Client],
    auth_headers: dict[str, str],
) -> None:
    service = make_app(RATELIMIT_STORAGE_URI=storage).test_client()
    for path in PATHS:
        want = service.get(path, headers=auth_headers)
        for name, floor in floors.items():
            got = floor.get(path, headers=auth_headers)
            assert got.status_code == want.status_code, (name, path)
            if want.status_code == 200:
                assert got.get_data() == want.get_data(), (name, path)
                assert got.headers.get("Link") == want.headers.get("Link"), (name, path)
            else:
                assert got.get_json()["code"] == want.get_json()["code"], (name, path)
    created = floors["raw floor"].post(
        "/v1/pets", json={"name": "Rex", "categoryId": 3}, headers=auth_headers
    )
    assert created.status_code == 201
    assert created.headers["Location"] == f"/v1/pets/{created.get_json()['id']}"


def test_the_flask_floor_counts_like_the_service(
    floors: dict[str, Client], issue_key: Callable[..., str]
) -> None:
    headers = {"Authorization": f"Bearer {issue_key('free', per_minute=2)}"}
    answers = [floors["bare-Flask floor"].get("/v1/pets", headers=headers) for _ in range(3)]
    assert [each.status_code for each in answers] == [200, 200, 429]
    assert [each.headers["X-RateLimit-Limit"] for each in answers] == ["2", "2", "2"]
    assert [each.headers["X-RateLimit-Remaining"] for each in answers] == ["1", "0", "0"]
    assert answers[2].get_json()["code"] == "rate_limited"
    assert int(answers[2].headers["Retry-After"]) >= 1
    unknown = floors["bare-Flask floor"].get("/v1/pets", headers={"Authorization": "Bearer nope"})
    assert unknown.status_code == 401 and unknown.get_json()["status"] == 401
