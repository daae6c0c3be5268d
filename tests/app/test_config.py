"""Bad settings: each is one line naming the setting and what it accepts."""

from __future__ import annotations

import pytest

from petstore import config

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
