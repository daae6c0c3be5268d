"""Settings: defaults, read from the environment and checked at start-up."""

from __future__ import annotations

import calendar
import email.utils
import os
from collections.abc import Callable, Mapping
from typing import Any

from limits import parse_many
from limits.strategies import STRATEGIES


class ConfigError(ValueError):
    """A setting is missing or has a value the service cannot use."""


def _int(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise ValueError(f"must be at least {minimum}")
        return value

    return parse


def _float(minimum: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(text)
        if not value >= minimum:
            raise ValueError(f"must be at least {minimum}")
        return value

    return parse


def _instant(text: str) -> int:
    """Unix seconds, or an HTTP date such as 'Thu, 05 Dec 2030 00:00:00 GMT'."""
    if text.strip().lstrip("-").isdigit():
        return int(text)
    parsed = email.utils.parsedate_tz(text)
    if parsed is None:
        raise ValueError("expected unix seconds or an HTTP date")
    return int(email.utils.mktime_tz(parsed))


def _str(text: str) -> str:
    return text


def _strategy(text: str) -> str:
    if text not in STRATEGIES:
        raise ValueError(f"expected one of {', '.join(sorted(STRATEGIES))}")
    return text


def _limits(text: str) -> str:
    """A flask-limiter limit string such as '60/minute;1000/day'."""
    try:
        parse_many(text)
    except ValueError:
        raise ValueError("expected limits such as '60/minute;1000/day'") from None
    return text


# name in the environment -> (Flask config key, parser, default)
SETTINGS: dict[str, tuple[str, Callable[[str], Any], Any]] = {
    "DATABASE_URL": ("DATABASE_URL", _str, None),
    "PETSTORE_DB_POOL_SIZE": ("DB_POOL_SIZE", _int(1), 4),
    "PETSTORE_DB_POOL_TIMEOUT": ("DB_POOL_TIMEOUT", _float(0.01), 2.0),
    "PETSTORE_DB_CONNECT_TIMEOUT": ("DB_CONNECT_TIMEOUT", _int(1), 3),
    "PETSTORE_DB_STATEMENT_TIMEOUT_MS": ("DB_STATEMENT_TIMEOUT_MS", _int(1), 5000),
    "PETSTORE_DB_RECONNECT_TIMEOUT": ("DB_RECONNECT_TIMEOUT", _float(0.1), 5.0),
    "PETSTORE_RETRY_AFTER": ("RETRY_AFTER", _int(1), 2),
    "PETSTORE_READY_TIMEOUT": ("READY_TIMEOUT", _float(0.05), 1.0),
    "PETSTORE_MAX_BODY_BYTES": ("MAX_CONTENT_LENGTH", _int(64), 16384),
    "PETSTORE_DEPRECATED_AT": ("DEPRECATED_AT", _instant, calendar.timegm((2026, 11, 26, 0, 0, 0))),
    "PETSTORE_SUNSET": ("SUNSET", _instant, calendar.timegm((2030, 12, 5, 0, 0, 0))),
    "PETSTORE_PROXY_COUNT": ("PROXY_COUNT", _int(0), 0),
    "PETSTORE_BASE_URL": ("PUBLIC_BASE_URL", _str, "http://127.0.0.1:8000/v1"),
    "PETSTORE_STAGING_BASE_URL": ("STAGING_BASE_URL", _str, "http://127.0.0.1:8001/v1"),
    "RATELIMIT_STORAGE_URI": ("RATELIMIT_STORAGE_URI", _str, "memory://"),
    "PETSTORE_RATELIMIT_STRATEGY": ("RATELIMIT_STRATEGY", _strategy, "fixed-window"),
    "PETSTORE_IP_LIMITS": ("IP_LIMITS", _limits, "60/minute;1000/day"),
    "PETSTORE_BAN_THRESHOLD": ("BAN_THRESHOLD", _int(1), 10),
    "PETSTORE_BAN_SECONDS": ("BAN_SECONDS", _int(1), 900),
    "PETSTORE_REDIS_TIMEOUT": ("REDIS_TIMEOUT", _float(0.01), 0.25),
    # prometheus_client's own name: it reads the environment when imported (petstore.metrics).
    "PROMETHEUS_MULTIPROC_DIR": ("METRICS_DIR", _str, None),
}


def from_environ(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Every setting, from `environ` (default os.environ) or its default."""
    environ = os.environ if environ is None else environ
    config: dict[str, Any] = {}
    for name, (key, parse, default) in SETTINGS.items():
        text = environ.get(name, "")
        if text == "":
            config[key] = default
            continue
        try:
            config[key] = parse(text)
        except ValueError as exc:
            raise ConfigError(f"{name}={text!r}: {exc}") from None
    return config


def check(config: Mapping[str, Any]) -> None:
    """Refuse to start with settings that cannot work."""
    if not config.get("DATABASE_URL"):
        raise ConfigError(
            "DATABASE_URL is not set: give the libpq URL of the PostgreSQL server "
            "(or use `make run`, which starts an embedded one)"
        )
    metrics_dir = config.get("METRICS_DIR")
    if metrics_dir and os.environ.get("PROMETHEUS_MULTIPROC_DIR") != metrics_dir:
        # prometheus_client reads the environment once, when it is imported.
        raise ConfigError(
            "PROMETHEUS_MULTIPROC_DIR must be set in the environment before the service "
            "starts (deploy/gunicorn.conf.py sets it); a setting passed later cannot move it"
        )
