"""Settings: defaults, read from the environment and checked at start-up."""

from __future__ import annotations

import calendar
import email.utils
import os
import re
from collections.abc import Callable, Iterable, Mapping
from ipaddress import IPv4Network, IPv6Network, ip_network
from typing import Any
from urllib.parse import urlsplit

import psycopg
from limits import parse_many
from limits.strategies import STRATEGIES
from psycopg import conninfo

IPNetwork = IPv4Network | IPv6Network


class ConfigError(ValueError):
    """A setting is missing or has a value the service cannot use."""


def _int(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise ValueError(f"expected a whole number of at least {minimum}")
        return value

    return parse


def _float(minimum: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not value >= minimum or value == float("inf"):
            raise ValueError(f"expected a number of at least {minimum}")
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


def _networks(text: str) -> tuple[IPNetwork, ...]:
    """Comma-separated networks in CIDR notation (an address alone is a network of one)."""
    try:
        return tuple(ip_network(part.strip()) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(
            "expected networks in CIDR notation, comma-separated, such as 10.0.0.0/8,::1"
        ) from None


SWITCH = {"on": True, "true": True, "yes": True, "1": True}
SWITCH |= {"off": False, "false": False, "no": False, "0": False}


def _switch(text: str) -> bool:
    """On or off, in any case."""
    if text.lower() not in SWITCH:
        raise ValueError("expected on or off (also true/false, yes/no, 1/0)")
    return SWITCH[text.lower()]


def _database_url(text: str) -> str:
    """A libpq connection string: a postgresql:// URL or key=value pairs."""
    try:
        conninfo.conninfo_to_dict(text)
    except psycopg.ProgrammingError:
        raise ValueError(
            "expected a libpq URL such as postgresql://user:password@host:5432/dbname"
        ) from None
    return text


# A password in a libpq URL's user information, or a `password` parameter of a URL or of
# key=value pairs (quoted or not).
_URL_PASSWORD = re.compile(r"^(postgres(?:ql)?://[^@/?#:]*:)[^@/?#]*@")
_PASSWORD_PARAMETER = re.compile(r"(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|[^&\s]+)")


def without_password(database_url: str) -> str:
    """The libpq connection string with its password shown as ****, for printing."""
    masked = _URL_PASSWORD.sub(r"\g<1>****@", database_url)
    return _PASSWORD_PARAMETER.sub(r"\g<1>****", masked)


def _http_url(text: str) -> str:
    """An absolute http(s) URL, for the servers of the OpenAPI document."""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError("expected an absolute http:// or https:// URL such as https://host/v1")
    return text


# The storages of the limits library that a synchronous flask-limiter can use.
STORAGE_SCHEMES = frozenset(
    (
        "memory",
        "redis",
        "rediss",
        "redis+unix",
        "redis+sentinel",
        "redis+cluster",
        "valkey",
        "valkeys",
        "valkey+unix",
        "valkey+sentinel",
        "valkey+cluster",
        "memcached",
        "mongodb",
        "mongodb+srv",
    )
)


def _storage_uri(text: str) -> str:
    """A limits storage URI whose scheme a storage is registered for."""
    scheme, separator, _rest = text.partition("://")
    if not separator or scheme.removeprefix("petstore+") not in STORAGE_SCHEMES:
        raise ValueError(
            "expected memory:// or redis://host:port/db (also rediss://, redis+sentinel://, "
            "redis+cluster://, memcached://, mongodb://)"
        )
    return text


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(text: str) -> str:
    """A logging level name, in any case."""
    if text.upper() not in LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(LOG_LEVELS)} (any case)")
    return text.upper()


def _one_of(choices: Iterable[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"expected one of {', '.join(sorted(choices))}")
        return text

    return parse


def _limits(text: str) -> str:
    """A flask-limiter limit string such as '60/minute;1000/day'."""
    try:
        parse_many(text)
    except ValueError:
        raise ValueError("expected limits such as '60/minute;1000/day'") from None
    return text


# What sits between the service and PostgreSQL: nothing, or a pooler in transaction mode
# (PgBouncer's pool_mode = transaction), where no session state may be relied on.
POOLERS = ("none", "transaction")

# name in the environment -> (Flask config key, parser, default)
SETTINGS: dict[str, tuple[str, Callable[[str], Any], Any]] = {
    "DATABASE_URL": ("DATABASE_URL", _database_url, None),
    "PETSTORE_DB_POOL_SIZE": ("DB_POOL_SIZE", _int(1), 4),
    "PETSTORE_DB_POOL_TIMEOUT": ("DB_POOL_TIMEOUT", _float(0.01), 2.0),
    "PETSTORE_DB_CONNECT_TIMEOUT": ("DB_CONNECT_TIMEOUT", _int(1), 3),
    "PETSTORE_DB_STATEMENT_TIMEOUT_MS": ("DB_STATEMENT_TIMEOUT_MS", _int(1), 5000),
    "PETSTORE_DB_POOLER": ("DB_POOLER", _one_of(POOLERS), "none"),
    "PETSTORE_MIGRATION_DATABASE_URL": ("MIGRATION_DATABASE_URL", str, None),
    # How long a migration waits for a lock (the queries behind it wait as long), how many more
    # times it tries, and its own statement timeout (an index build outlasts any request).
    "PETSTORE_MIGRATION_LOCK_WAIT_MS": ("MIGRATION_LOCK_WAIT_MS", _int(1), 2000),
    "PETSTORE_MIGRATION_RETRIES": ("MIGRATION_RETRIES", _int(0), 4),
    "PETSTORE_MIGRATION_TIMEOUT_MS": ("MIGRATION_TIMEOUT_MS", _int(1), 3_600_000),
    # Unset: every statement on DATABASE_URL. Set: listPets and getPet read there (standbys).
    "PETSTORE_READ_DATABASE_URL": ("READ_DATABASE_URL", _database_url, None),
    "PETSTORE_READ_MAX_LAG_SECONDS": ("READ_MAX_LAG_SECONDS", _float(0), 1.0),
    "PETSTORE_DB_RECONNECT_TIMEOUT": ("DB_RECONNECT_TIMEOUT", _float(0.1), 5.0),
    "PETSTORE_RETRY_AFTER": ("RETRY_AFTER", _int(1), 2),
    "PETSTORE_READY_TIMEOUT": ("READY_TIMEOUT", _float(0.05), 1.0),
    "PETSTORE_MAX_BODY_BYTES": ("MAX_CONTENT_LENGTH", _int(64), 16384),
    "PETSTORE_DEPRECATED_AT": ("DEPRECATED_AT", _instant, calendar.timegm((2026, 11, 26, 0, 0, 0))),
    "PETSTORE_SUNSET": ("SUNSET", _instant, calendar.timegm((2030, 12, 5, 0, 0, 0))),
    "PETSTORE_PROXY_COUNT": ("PROXY_COUNT", _int(0), 0),
    # Unset: the document's server is the relative /v1 (petstore.openapi.servers), never a Host.
    "PETSTORE_BASE_URL": ("PUBLIC_BASE_URL", _http_url, None),
    # Unset: the document names no staging server.
    "PETSTORE_STAGING_BASE_URL": ("STAGING_BASE_URL", _http_url, None),
    "RATELIMIT_STORAGE_URI": ("RATELIMIT_STORAGE_URI", _storage_uri, "memory://"),
    "PETSTORE_RATELIMIT_STRATEGY": ("RATELIMIT_STRATEGY", _one_of(STRATEGIES), "fixed-window"),
    # Off: the limits library's own storages instead of petstore.ratelimit.storages (the bench compares).
    "PETSTORE_RATELIMIT_TUNED_STORAGES": ("RATELIMIT_TUNED_STORAGES", _switch, True),
    # A key this many requests a second in one worker counts from leases (petstore.ratelimit.leases);
    # 0: every request counted in the storage. Unspent leases go back after this long unused.
    "PETSTORE_RATELIMIT_HOT_RATE": ("RATELIMIT_HOT_RATE", _int(0), 10),
    "PETSTORE_LEASE_IDLE_SECONDS": ("LEASE_IDLE_SECONDS", _float(0.05), 1.0),
    "PETSTORE_IP_LIMITS": ("IP_LIMITS", _limits, "60/minute;1000/day"),
    "PETSTORE_ANONYMOUS_CLIENTS": ("ANONYMOUS_CLIENTS", _int(1), 10_000),
    # How long a worker uses a key's row before asking the database again (petstore.keycache).
    "PETSTORE_KEY_CACHE_SECONDS": ("KEY_CACHE_SECONDS", _float(0), 1.0),
    "PETSTORE_KEY_CACHE_SIZE": ("KEY_CACHE_SIZE", _int(1), 10_000),
    # Requests per key and hour (petstore.usage): kept this many days (`petstore db prune`),
    # written by each worker every this many seconds.
    "PETSTORE_USAGE_RETENTION_DAYS": ("USAGE_RETENTION_DAYS", _int(1), 400),
    "PETSTORE_USAGE_FLUSH_SECONDS": ("USAGE_FLUSH_SECONDS", _float(0.05), 5.0),
    "PETSTORE_BAN_THRESHOLD": ("BAN_THRESHOLD", _int(1), 10),
    "PETSTORE_BAN_SECONDS": ("BAN_SECONDS", _int(1), 900),
    # Escalation: a ban that starts less than BAN_REPEAT_SECONDS after the key's last one ended
    # lasts BAN_ESCALATION times as long as that one, at most BAN_MAX_SECONDS.
    "PETSTORE_BAN_ESCALATION": ("BAN_ESCALATION", _int(1), 2),
    "PETSTORE_BAN_MAX_SECONDS": ("BAN_MAX_SECONDS", _int(1), 86_400),
    "PETSTORE_BAN_REPEAT_SECONDS": ("BAN_REPEAT_SECONDS", _int(0), 86_400),
    "PETSTORE_REDIS_TIMEOUT": ("REDIS_TIMEOUT", _float(0.01), 0.25),
    # Read by wsgi.py and deploy/gunicorn.conf.py for logging; checked here with the rest.
    "PETSTORE_LOG_LEVEL": ("LOG_LEVEL", _log_level, "INFO"),
    # Unset: /metrics answers whoever reaches the app's port (petstore.views.metrics).
    "PETSTORE_METRICS_ALLOW": ("METRICS_ALLOW", _networks, None),
    # prometheus_client's own name: it reads the environment when imported (petstore.metrics).
    "PROMETHEUS_MULTIPROC_DIR": ("METRICS_DIR", str, None),
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
            # One line, whatever the value holds, naming the setting and what it accepts.
            raise ConfigError(f"{name}={text!r} is not valid: {exc}") from None
    return config


def check(config: Mapping[str, Any]) -> None:
    """Refuse to start with settings that cannot work."""
    if not config.get("DATABASE_URL"):
        raise ConfigError(
            "DATABASE_URL is not set: expected the libpq URL of the PostgreSQL database, "
            "such as postgresql://user:password@host:5432/dbname "
            "(or use `make run`, which starts an embedded one)"
        )
    metrics_dir = config.get("METRICS_DIR")
    if metrics_dir and os.environ.get("PROMETHEUS_MULTIPROC_DIR") != metrics_dir:
        # prometheus_client reads the environment once, when it is imported.
        raise ConfigError(
            "PROMETHEUS_MULTIPROC_DIR must be set in the environment before the service "
            "starts (deploy/gunicorn.conf.py sets it); a setting passed later cannot move it"
        )
