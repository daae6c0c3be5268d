"""The settings table (petstore.config.SETTINGS): each setting's default, a good value, and a bad
one refused in one line naming the setting and what it accepts."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest

from petstore import config, create_app

# (setting, bad value, words of the accepted values that the line must name)
BAD = [
    ("DATABASE_URL", "petstore.internal", "postgresql://"),
    ("DATABASE_URL", "http://db/petstore", "postgresql://"),
    ("PETSTORE_DB_POOL_SIZE", "four", "at least 1"),
    ("PETSTORE_DB_POOL_SIZE", "0", "at least 1"),
    ("PETSTORE_DB_POOL_TIMEOUT", "soon", "at least 0.01"),
    ("PETSTORE_DB_POOL_TIMEOUT", "nan", "at least 0.01"),
    ("PETSTORE_RETRY_AFTER", "-1", "at least 1"),
    ("PETSTORE_DEPRECATED_AT", "yesterday", "HTTP date"),
    ("PETSTORE_BASE_URL", "api.example.test/v1", "https://"),
    ("PETSTORE_STAGING_BASE_URL", "ftp://x/v1", "https://"),
    ("RATELIMIT_STORAGE_URI", "foo://x", "redis://host:port/db"),
    ("RATELIMIT_STORAGE_URI", "localhost:6379", "memory://"),
    ("PETSTORE_RATELIMIT_STRATEGY", "leaky-bucket", "fixed-window"),
    ("PETSTORE_RATELIMIT_TUNED_STORAGES", "maybe", "on or off"),
    ("PETSTORE_IP_LIMITS", "lots", "60/minute"),
    ("PETSTORE_LOG_LEVEL", "chatty", "DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    ("PETSTORE_LOG_LEVEL", "info\nmore", "DEBUG"),
]


@pytest.mark.parametrize(("name", "value", "accepted"), BAD)
def test_a_bad_setting_is_one_line_naming_it_and_the_accepted_values(
    name: str, value: str, accepted: str
) -> None:
    with pytest.raises(config.ConfigError) as raised:
        config.from_environ({name: value})

    line = str(raised.value)
    assert "\n" not in line
    assert line.startswith(f"{name}={value!r} is not valid: expected ")
    assert accepted in line


@pytest.mark.parametrize(
    ("name", "value", "key", "parsed"),
    [
        ("PETSTORE_LOG_LEVEL", "warning", "LOG_LEVEL", "WARNING"),
        ("RATELIMIT_STORAGE_URI", "redis://127.0.0.1:6379/0", "RATELIMIT_STORAGE_URI", None),
        ("RATELIMIT_STORAGE_URI", "redis+sentinel://h:26379/m", "RATELIMIT_STORAGE_URI", None),
        ("DATABASE_URL", "dbname=petstore host=/run/postgresql", "DATABASE_URL", None),
        ("PETSTORE_BASE_URL", "https://api.example.test/v1", "PUBLIC_BASE_URL", None),
    ],
)
def test_good_values_pass(name: str, value: str, key: str, parsed: str | None) -> None:
    assert config.from_environ({name: value})[key] == (parsed or value)


def test_missing_database_url_says_what_to_give() -> None:
    with pytest.raises(config.ConfigError) as raised:
        config.check(config.from_environ({}))

    line = str(raised.value)
    assert "\n" not in line
    assert line.startswith("DATABASE_URL is not set: expected ")
    assert "postgresql://" in line


# Every setting: (its default, a good value and what it parses to, a bad value or None when
# any text is accepted). A setting added to config.SETTINGS fails the first test until it has
# a row here.
TABLE: dict[str, tuple[Any, str, Any, str | None]] = {
    "DATABASE_URL": (None, "postgresql://u@db:5432/p", "postgresql://u@db:5432/p", "db/p"),
    "PETSTORE_DB_POOL_SIZE": (4, "8", 8, "-3"),
    "PETSTORE_READ_DATABASE_URL": (
        None,
        "postgresql://u@db1,db2/p?target_session_attrs=prefer-standby",
        "postgresql://u@db1,db2/p?target_session_attrs=prefer-standby",
        "db/p",
    ),
    "PETSTORE_DB_POOL_TIMEOUT": (2.0, "0.5", 0.5, "0"),
    "PETSTORE_DB_CONNECT_TIMEOUT": (3, "10", 10, "0"),
    "PETSTORE_DB_STATEMENT_TIMEOUT_MS": (5000, "250", 250, "5s"),
    "PETSTORE_DB_POOLER": ("none", "transaction", "transaction", "session"),
    "PETSTORE_MIGRATION_DATABASE_URL": (None, "postgresql://o@db/p", "postgresql://o@db/p", None),
    "PETSTORE_MIGRATION_LOCK_WAIT_MS": (2000, "500", 500, "2s"),
    "PETSTORE_MIGRATION_RETRIES": (4, "0", 0, "-1"),
    "PETSTORE_MIGRATION_TIMEOUT_MS": (3_600_000, "60000", 60000, "0"),
    "PETSTORE_DB_RECONNECT_TIMEOUT": (5.0, "30", 30.0, "0.01"),
    "PETSTORE_READ_MAX_LAG_SECONDS": (1.0, "5", 5.0, "-1"),
    "PETSTORE_RETRY_AFTER": (2, "5", 5, "1.5"),
    "PETSTORE_READY_TIMEOUT": (1.0, "0.2", 0.2, "inf"),
    "PETSTORE_MAX_BODY_BYTES": (16384, "1048576", 1048576, "63"),
    "PETSTORE_DEPRECATED_AT": (1795651200, "Thu, 05 Dec 2030 00:00:00 GMT", 1922659200, "soon"),
    "PETSTORE_SUNSET": (1922659200, "1800000000", 1800000000, "next year"),
    "PETSTORE_PROXY_COUNT": (0, "1", 1, "-1"),
    "PETSTORE_BASE_URL": (
        None,
        "https://api.example.test/v1",
        "https://api.example.test/v1",
        "/v1",
    ),
    "PETSTORE_STAGING_BASE_URL": (
        None,
        "http://staging.test/v1",
        "http://staging.test/v1",
        "staging.test",
    ),
    "RATELIMIT_STORAGE_URI": ("memory://", "redis://r:6379/2", "redis://r:6379/2", "redis:6379"),
    "PETSTORE_RATELIMIT_STRATEGY": (
        "fixed-window",
        "sliding-window-counter",
        "sliding-window-counter",
        "token-bucket",
    ),
    "PETSTORE_RATELIMIT_TUNED_STORAGES": (True, "OFF", False, "2"),
    "PETSTORE_RATELIMIT_HOT_RATE": (10, "0", 0, "-1"),
    "PETSTORE_LEASE_IDLE_SECONDS": (1.0, "0.5", 0.5, "0"),
    "PETSTORE_IP_LIMITS": ("60/minute;1000/day", "10/second", "10/second", "10 per"),
    "PETSTORE_ANONYMOUS_CLIENTS": (10_000, "500", 500, "0"),
    "PETSTORE_KEY_CACHE_SECONDS": (1.0, "0", 0.0, "-1"),
    "PETSTORE_KEY_CACHE_SIZE": (10_000, "100", 100, "0"),
    "PETSTORE_USAGE_RETENTION_DAYS": (400, "30", 30, "0"),
    "PETSTORE_USAGE_FLUSH_SECONDS": (5.0, "0.5", 0.5, "0"),
    "PETSTORE_BAN_THRESHOLD": (10, "3", 3, "0"),
    "PETSTORE_BAN_SECONDS": (900, "60", 60, "ten"),
    "PETSTORE_BAN_ESCALATION": (2, "3", 3, "0"),
    "PETSTORE_BAN_MAX_SECONDS": (86_400, "3600", 3600, "0"),
    "PETSTORE_BAN_REPEAT_SECONDS": (86_400, "0", 0, "-1"),
    "PETSTORE_REDIS_TIMEOUT": (0.25, "1", 1.0, "0.001"),
    "PETSTORE_LOG_LEVEL": ("INFO", "debug", "DEBUG", "TRACE"),
    "PETSTORE_METRICS_ALLOW": (
        None,
        "10.0.0.0/8,::1",
        (ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("::1")),
        "10.0.0.0/33",
    ),
    "PROMETHEUS_MULTIPROC_DIR": (None, "/run/petstore-metrics", "/run/petstore-metrics", None),
}


def test_the_table_has_a_row_for_every_setting() -> None:
    assert set(TABLE) == set(config.SETTINGS)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_each_setting_defaults_when_unset_or_empty(name: str) -> None:
    key = config.SETTINGS[name][0]
    default = TABLE[name][0]
    assert config.from_environ({})[key] == default
    assert config.from_environ({name: ""})[key] == default


@pytest.mark.parametrize("name", sorted(TABLE))
def test_each_setting_takes_a_good_value(name: str) -> None:
    _default, text, parsed, _bad = TABLE[name]
    assert config.from_environ({name: text})[config.SETTINGS[name][0]] == parsed


@pytest.mark.parametrize("name", sorted(name for name, row in TABLE.items() if row[3] is not None))
def test_each_setting_refuses_a_bad_value_in_one_line_naming_it(name: str) -> None:
    bad = TABLE[name][3]
    with pytest.raises(config.ConfigError) as raised:
        config.from_environ({name: bad})

    line = str(raised.value)
    assert "\n" not in line
    assert line.startswith(f"{name}={bad!r} is not valid: expected ")


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            "postgresql://petstore:s3cr%40t@db1:5432,db2:5432/petstore?target_session_attrs=any",
            "postgresql://petstore:****@db1:5432,db2:5432/petstore?target_session_attrs=any",
        ),
        ("postgres://petstore@db1/petstore", "postgres://petstore@db1/petstore"),
        ("postgresql://db1:5432/petstore", "postgresql://db1:5432/petstore"),
        (
            "postgresql://petstore@db1/petstore?sslmode=require&password=s3cret",
            "postgresql://petstore@db1/petstore?sslmode=require&password=****",
        ),
        (
            "host=db1 user=petstore password='a b\\'c' dbname=petstore",
            "host=db1 user=petstore password=**** dbname=petstore",
        ),
    ],
)
def test_a_printed_database_url_has_no_password(url: str, shown: str) -> None:
    """make run's `database:` line: the password masked, as psycopg's ConnectionInfo.dsn leaves
    it out; everything else as given."""
    assert config.without_password(url) == shown


def test_create_app_given_settings_reads_no_environment(
    monkeypatch: pytest.MonkeyPatch, database_url: str
) -> None:
    """wsgi parses the environment once and passes its settings on: create_app takes them as
    they are (a bad value in the environment by then is not read again), overrides on top."""
    settings = config.from_environ({"DATABASE_URL": database_url, "PETSTORE_BAN_SECONDS": "60"})
    monkeypatch.setenv("PETSTORE_BAN_SECONDS", "ten")
    with pytest.raises(config.ConfigError, match="PETSTORE_BAN_SECONDS='ten'"):
        create_app({"DATABASE_URL": database_url})
    app = create_app({"BAN_THRESHOLD": 3}, settings=settings)
    try:
        assert app.config["BAN_SECONDS"] == 60
        assert app.config["BAN_THRESHOLD"] == 3
    finally:
        app.extensions["petstore.pool"].close()
