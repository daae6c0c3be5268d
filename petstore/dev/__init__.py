"""make run's server and the embedded PostgreSQL of make run and tests (the [embedded] extra).

No operator command imports them (tests/app/test_cli.py checks): only `petstore serve` does."""

from __future__ import annotations

import socket


def listen_error(host: str, port: int) -> OSError | None:
    """Why a server could not listen on host:port now, or None when it could."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # gunicorn and PostgreSQL bind with SO_REUSEADDR: only a listener stops them, not TIME_WAIT.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
            probe.listen()
        except OSError as exc:
            return exc
    return None
