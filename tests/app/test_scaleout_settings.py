"""Settings for PgBouncer, Redis Sentinel and Redis Cluster: what each turns into, without the servers."""

from __future__ import annotations

import pytest
from limits.storage import storage_from_string

from petstore import config, db
from petstore.ratelimit import storages


def test_sentinel_and_cluster_uris_map_to_the_counting_storages() -> None:
    sentinel = "redis+sentinel://127.0.0.1:1,127.0.0.1:2/petstore"
    cluster = "redis+cluster://127.0.0.1:1,127.0.0.1:2"
    assert storages.storage_uri(sentinel) == f"petstore+{sentinel}"
    assert storages.storage_uri(cluster) == f"petstore+{cluster}"
    # limits finds our classes by scheme; both keep the count and expiry in one call.
    assert issubclass(storages.CountingSentinelStorage, storages.CountingRedisStorage)
    assert issubclass(storages.CountingClusterStorage, storages.CountingRedisStorage)
    with pytest.raises(Exception) as refused:
        # Nothing listens on port 1: the class is found, then the connection fails.
        storage_from_string(storages.storage_uri(cluster), socket_connect_timeout=0.1)
    assert "scheme" not in str(refused.value).lower()


def test_redis_timeouts_bound_sentinel_and_cluster_too() -> None:
    settings = config.from_environ({"PETSTORE_REDIS_TIMEOUT": "0.5"})
    timeouts = {"socket_timeout": 0.5, "socket_connect_timeout": 0.5}
    for uri in ("redis://h:1/0", "redis+cluster://h:1"):
        assert storages.storage_options({**settings, "RATELIMIT_STORAGE_URI": uri}) == timeouts
    sentinel = storages.storage_options(
        {**settings, "RATELIMIT_STORAGE_URI": "redis+sentinel://h:1/petstore"}
    )
    assert sentinel == {**timeouts, "sentinel_kwargs": timeouts, "use_replicas": False}


def test_transaction_pooler_sends_no_options_and_prepares_nothing() -> None:
    direct = db.connection_kwargs(config.from_environ({}))
    assert direct["options"] == "-c statement_timeout=5000"
    assert "prepare_threshold" not in direct
    pooled_settings = config.from_environ({"PETSTORE_DB_POOLER": "transaction"})
    pooled = db.connection_kwargs(pooled_settings)
    assert "options" not in pooled
    assert pooled["prepare_threshold"] is None


def test_every_connection_finds_a_silent_server_within_the_connect_timeout() -> None:
    liveness = {
        "keepalives": 1,
        "keepalives_idle": 2,
        "keepalives_interval": 1,
        "keepalives_count": 3,
        "tcp_user_timeout": 2000,
    }
    for pooler in ("none", "transaction"):
        settings = config.from_environ(
            {"PETSTORE_DB_CONNECT_TIMEOUT": "2", "PETSTORE_DB_POOLER": pooler}
        )
        assert db.connection_kwargs(settings).items() >= liveness.items()


def test_a_direct_connection_keeps_its_prepared_statements(database_url: str) -> None:
    """No pooler between: the backend pid libpq was told is the server's, and psycopg may prepare."""
    settings = config.from_environ({"DATABASE_URL": database_url})
    with db.connect(settings) as conn:
        db.check_new_connection(settings)(conn)
        assert conn.prepare_threshold == 5
        # Direct, the timeout travels with the connection (options): the check finds it.
        pin = db.TimeoutPin(5000)
        db.check_new_connection(settings, pin)(conn)
        assert pin.found_ms is None and pin.warning() is None


def test_another_timeout_is_noted_and_served(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A server whose statement_timeout is not the configured one: noted and logged, not refused."""
    settings = config.from_environ({"DATABASE_URL": database_url})
    other = {**settings, "DB_STATEMENT_TIMEOUT_MS": 60_000}
    pin = db.TimeoutPin(60_000)
    with db.connect(settings) as conn:
        db.check_new_connection(other, pin)(conn)
        assert conn.execute("select 1 as one").fetchone() == {"one": 1}
    assert pin.found_ms == 5000
    assert "is 5000 ms on the server, expected 60000 ms" in (pin.warning() or "")
    assert [r.getMessage() for r in caplog.records if "statement_timeout" in r.getMessage()] == [
        "statement_timeout behind the pooler is 5000 ms, expected 60000 ms "
        "(PETSTORE_DB_STATEMENT_TIMEOUT_MS): this connection's statements run unbounded; run "
        "`petstore db upgrade` with PETSTORE_MIGRATION_DATABASE_URL, then RECONNECT in the "
        "PgBouncer console"
    ]


def test_an_unknown_pooler_is_refused() -> None:
    with pytest.raises(config.ConfigError, match="PETSTORE_DB_POOLER"):
        config.from_environ({"PETSTORE_DB_POOLER": "session"})
