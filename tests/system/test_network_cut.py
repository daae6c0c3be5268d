"""A database that vanishes from the network (packets dropped, no RST): a fast 503, never a hang.

PostgreSQL runs in a network namespace of its own; the app (in this process) reaches it across
a veth link. Then the database host's end of the link goes down: the app meets silence, no RST.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from flask import Flask

from petstore import config, create_app, db, keys, migrations
from tests.support.checks import assert_error
from tests.support.hosts import HostPostgres, Hosts, cut

CONNECT_TIMEOUT = 1
STATEMENT_TIMEOUT_MS = 2000
POOL_TIMEOUT = 1.0
POOL_SIZE = 2
# A request on a silent server is answered within the statement timeout and this much more:
# the statement's unacknowledged bytes (tcp_user_timeout, the connect timeout), the pool's check
# of its other idle connection (as long again), and the wait for a new connection.
BOUND = STATEMENT_TIMEOUT_MS / 1000 + (POOL_SIZE + 1) * CONNECT_TIMEOUT + POOL_TIMEOUT


@pytest.fixture
def database(tmp_path: Path) -> Iterator[tuple[Hosts, HostPostgres]]:
    """A PostgreSQL in namespace "db", migrated, across its link to the machine."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (`ip netns`): run .ci/install-iproute2 as root")
    hosts = Hosts(["db"], [("", "db")])
    with hosts, HostPostgres(tmp_path / "db", hosts.netns["db"], hosts.address("db", "")) as pg:
        yield hosts, pg


def settings(url: str) -> dict[str, object]:
    """The app's settings for the server across the link, with short timeouts."""
    return {
        "DATABASE_URL": url,
        "DB_CONNECT_TIMEOUT": CONNECT_TIMEOUT,
        "DB_STATEMENT_TIMEOUT_MS": STATEMENT_TIMEOUT_MS,
        "DB_POOL_TIMEOUT": POOL_TIMEOUT,
        "DB_POOL_SIZE": POOL_SIZE,
        "TESTING": True,
    }


def test_a_request_on_a_silent_database_answers_503_within_the_bound(
    database: tuple[Hosts, HostPostgres],
) -> None:
    hosts, postgres = database
    app_settings = settings(postgres.url())
    with db.connect(config.from_environ({"DATABASE_URL": postgres.url()})) as conn:
        migrations.upgrade(conn)
        key, _row = keys.issue_key(conn, "pro", "network cut")
    app: Flask = create_app(app_settings)
    try:
        client = app.test_client()
        headers = {"Authorization": f"Bearer {key}"}
        # Warm: the pool's connections are open and idle, as in production between requests.
        assert client.get("/v1/pets", headers=headers).status_code == 200
        app.extensions["petstore.pool"].wait(timeout=10)

        cut(hosts, "db", "")
        answers: list[object] = []

        def ask() -> None:
            started = time.monotonic()
            response = client.get("/v1/pets", headers=headers)
            answers.append((response, time.monotonic() - started))

        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        # Without TCP liveness options the kernel retransmits for some fifteen minutes.
        asking.join(timeout=BOUND + 10)
        assert not asking.is_alive(), f"no answer within {BOUND + 10} s: the request hangs"
        response, seconds = answers[0]  # type: ignore[misc]
        assert_error(response, 503, "service_unavailable")
        assert response.headers["Retry-After"]
        assert seconds < BOUND, f"answered in {seconds:.1f} s, bound {BOUND} s"
    finally:
        app.extensions["petstore.pool"].close(timeout=1)
