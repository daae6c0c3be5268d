"""The pool's connections to a multi-host DATABASE_URL: the hosts cheapest first, each one's role checked.

For deployments with no Patroni REST API to route by (docs/deploying.rst, "Which route to the
primary"); with Patroni, DATABASE_URL names HAProxy and this module sees one host.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import psycopg.conninfo
from psycopg.rows import DictRow, tuple_row

# The conninfo values given once per host, comma-separated, in the hosts' order.
PER_HOST = ("host", "hostaddr", "port")
# The cost of the host that took the last connection asked of it: tried before any other.
ACCEPTED = -1.0
# A host whose last attempt took this long (seconds) is silent: one attempt at a time waits on it.
SILENT = 1.0
# target_session_attrs this module checks itself, and the query whose true answer accepts the
# server: PgBouncer answers libpq's own check from the in_hot_standby and
# default_transaction_read_only it cached at its first login (PgBouncer issue #859): after a
# failover the demoted node passes as a primary.
ROLE_CHECKS = {
    "read-write": "select current_setting('transaction_read_only') = 'off'",
    "read-only": "select current_setting('transaction_read_only') = 'on'",
    "primary": "select not pg_is_in_recovery()",
    "standby": "select pg_is_in_recovery()",
}


class WrongRole(psycopg.OperationalError):
    """The server behind a host is not what the URL's target_session_attrs asks for."""


class SkippedSilent(psycopg.OperationalError):
    """A silent host not tried, since another connection attempt is waiting on it."""


def split_hosts(params: dict[str, Any]) -> list[dict[str, str]]:
    """The per-host values of `params`, one dict per host (a single port applies to all, as in libpq)."""
    lists = {name: str(params[name]).split(",") for name in PER_HOST if params.get(name)}
    count = max((len(values) for values in lists.values()), default=0)
    return [
        {name: values[0] if len(values) == 1 else values[index] for name, values in lists.items()}
        for index in range(count)
    ]


def describe(host: dict[str, str]) -> str:
    """host:port of one host, for a message."""
    where = host.get("host") or host.get("hostaddr", "")
    return f"{where}:{host['port']}" if "port" in host else where


def ordered_connection_class() -> type[psycopg.Connection[DictRow]]:
    """A connection class for one pool: hosts tried by what their last attempt cost, roles checked.

    libpq tries a multi-host URL's hosts in the written order, each for up to connect_timeout:
    with the first one silent, every new connection spends that timeout on it. Here the host
    that took the last connection comes first, then those that failed fast (a standby, a
    stopped server), and last the silent ones. While one attempt waits on a silent host, the
    others pass it over (failing at once if no other host takes them), so that the pool's retry
    finds a standby promoted meanwhile without waiting out a timeout.

    The role is asked of the server itself (ROLE_CHECKS, one round trip per new connection), not
    left to libpq. A URL asking for prefer-standby or load_balance_hosts connects as psycopg does.
    """
    # Each host's (its per-host values) seconds its last attempt took, or ACCEPTED. The pool's
    # threads share it: a lost update only orders one attempt less well.
    costs: dict[tuple[tuple[str, str], ...], float] = {}
    # The silent hosts an attempt is waiting on now.
    waited_on: set[tuple[tuple[str, str], ...]] = set()
    lock = threading.Lock()

    class OrderedConnection(psycopg.Connection[DictRow]):
        """psycopg.Connection trying its hosts in the order of `costs`."""

        @classmethod
        def connect(cls, conninfo: str = "", **kwargs: Any) -> OrderedConnection:
            params = psycopg.conninfo.conninfo_to_dict(conninfo)
            attrs = str(
                kwargs.pop("target_session_attrs", None)
                or params.get("target_session_attrs")
                or "any"
            )
            conninfo = psycopg.conninfo.make_conninfo(conninfo, target_session_attrs=attrs)
            balanced = params.get("load_balance_hosts", "disable") != "disable"
            if attrs == "prefer-standby" or balanced:
                return super().connect(conninfo, **kwargs)
            hosts = split_hosts(params) or [{}]
            # libpq's check could refuse a host by a pooler's stale word: ours replaces it.
            unchecked = {"target_session_attrs": "any"} if attrs in ROLE_CHECKS else {}
            failures: list[tuple[dict[str, str], psycopg.OperationalError]] = []
            for host in sorted(hosts, key=lambda host: costs.get(tuple(host.items()), 0.0)):
                key = tuple(host.items())
                with lock:
                    silent = len(hosts) > 1 and costs.get(key, 0.0) >= SILENT
                    if silent and key in waited_on:
                        failures.append((host, SkippedSilent("another attempt waits on it")))
                        continue
                    if silent:
                        waited_on.add(key)
                started = time.monotonic()
                try:
                    conn = super().connect(
                        psycopg.conninfo.make_conninfo(conninfo, **host, **unchecked), **kwargs
                    )
                    check_role(conn, attrs)
                except psycopg.OperationalError as exc:
                    costs[key] = time.monotonic() - started
                    failures.append((host, exc))
                    continue
                finally:
                    if silent:
                        with lock:
                            waited_on.discard(key)
                costs[key] = ACCEPTED
                return conn
            if len(failures) == 1:
                raise failures[0][1]
            message = "; ".join(f"{describe(host)}: {exc}" for host, exc in failures)
            raise psycopg.OperationalError(f"no host took the connection: {message}") from (
                failures[-1][1]
            )

    return OrderedConnection


def check_role(conn: psycopg.Connection[Any], attrs: str) -> None:
    """Close `conn` and raise WrongRole unless its server is what `attrs` asks for."""
    query = ROLE_CHECKS.get(attrs)
    if query is None:
        return
    with conn.cursor(row_factory=tuple_row) as cursor:
        accepted = cursor.execute(query).fetchone()
    if not conn.autocommit:
        conn.rollback()
    if accepted is None or not accepted[0]:
        conn.close()
        raise WrongRole(f"the server is not {attrs} (target_session_attrs)")
