"""gunicorn settings for the Animal Store service, read from the environment.

    gunicorn -c deploy/gunicorn.conf.py wsgi:app

Every value below can be overridden with an environment variable (named in each comment) or on
the command line. No --preload: each worker opens its own PostgreSQL pool after the fork.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from typing import Any

_env = os.environ.get

# BIND: the address nginx proxies to; several, comma-separated, are allowed.
bind = _env("BIND", "127.0.0.1:8000").split(",")

# WEB_CONCURRENCY: worker processes. memory:// counts in one process, so it gets one worker;
# with a shared storage (redis://) the default is 2 per core.
_shared_storage = not _env("RATELIMIT_STORAGE_URI", "memory://").startswith("memory://")
workers = int(
    _env("WEB_CONCURRENCY", str(2 * multiprocessing.cpu_count() if _shared_storage else 1))
)

# GUNICORN_WORKER_CLASS: gthread (threads per worker) or sync (one request at a time per worker).
worker_class = _env("GUNICORN_WORKER_CLASS", "gthread")
# PETSTORE_THREADS: threads per worker; each thread may hold one pooled connection, so the
# pool is sized to match unless PETSTORE_DB_POOL_SIZE says otherwise.
threads = int(_env("PETSTORE_THREADS", "4"))
os.environ.setdefault("PETSTORE_DB_POOL_SIZE", str(threads))

# GUNICORN_TIMEOUT: a worker silent this long is killed and replaced. Requests themselves are
# bounded far below it (pool wait, statement timeout, Redis timeout).
timeout = int(_env("GUNICORN_TIMEOUT", "30"))
# GUNICORN_GRACEFUL_TIMEOUT: on SIGTERM, running requests get this long to finish.
graceful_timeout = int(_env("GUNICORN_GRACEFUL_TIMEOUT", "20"))
# Behind nginx with upstream keepalive: keep idle connections a little longer than nginx does.
keepalive = int(_env("GUNICORN_KEEPALIVE", "75"))

# The app writes one JSON line per request (petstore.logs); gunicorn's own access log is off and
# its error log goes to stdout in the same JSON format.
accesslog = None
errorlog = "-"
loglevel = _env("PETSTORE_LOG_LEVEL", "info").lower()
logconfig_dict = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"json": {"()": "petstore.logs.JSONFormatter"}},
    "handlers": {
        "stdout": {
            "class": "logging.StreamHandler",
            "formatter": "json",
            "stream": "ext://sys.stdout",
        }
    },
    "root": {"handlers": ["stdout"], "level": loglevel.upper()},
    "loggers": {
        "gunicorn.error": {"handlers": ["stdout"], "level": loglevel.upper(), "propagate": False},
        "gunicorn.access": {"handlers": [], "level": "CRITICAL", "propagate": False},
    },
}

# Several instances may run on one host; gunicorn's default control socket path is shared.
control_socket_disable = True


def post_worker_init(worker: Any) -> None:
    """On SIGTERM, close this worker's copy of the listening sockets at once.

    A gthread worker that stops keeps the listening socket open until it exits: the kernel
    still accepts connections that nobody will serve, and they are reset when the worker
    goes. Closing it first makes new connections fail fast, so nginx sends them, POSTs
    included, to another instance.
    """
    handle_exit = worker.handle_exit

    def stop_listening_then_exit(signum: int, frame: Any) -> None:
        handle_exit(signum, frame)
        for listener in worker.sockets:
            listener.sock.close()

    signal.signal(signal.SIGTERM, stop_listening_then_exit)
