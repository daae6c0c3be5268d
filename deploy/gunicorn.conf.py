"""gunicorn settings for the Animal Store service, read from the environment.

    gunicorn -c deploy/gunicorn.conf.py wsgi:app

Every value below can be overridden with an environment variable (named in each comment) or on
the command line. No --preload: each worker opens its own PostgreSQL pool after the fork.
"""

from __future__ import annotations

import atexit
import glob
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
from typing import Any

# PROMETHEUS_MULTIPROC_DIR: where the workers write their metrics for GET /metrics to sum
# (prometheus_client's multiprocess mode). Unset, the master makes a fresh directory of its own,
# named by its pid, and removes it however it exits but SIGKILL (below), after removing those of
# killed masters; several instances on one host need one directory each.
# Set first, before petstore is imported (below, for the settings check): prometheus_client reads
# it once, on import, and the workers inherit it.
if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    # First the directories of masters killed before they could remove theirs (kill -9, the OOM
    # killer), and only those: each is named by its master's pid, which no longer runs.
    for _left in glob.glob(os.path.join(tempfile.gettempdir(), "petstore-metrics-*-*")):
        _pid = os.path.basename(_left).split("-")[2]
        if _pid.isdigit() and not os.path.exists(f"/proc/{_pid}"):
            shutil.rmtree(_left, ignore_errors=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(
        prefix=f"petstore-metrics-{os.getpid()}-"
    )
    # Remembered in the environment: a reload (SIGHUP) reads this file again.
    os.environ["PETSTORE_OWN_METRICS_DIR"] = os.environ["PROMETHEUS_MULTIPROC_DIR"]

from petstore import config as _config
from petstore import gunicorn_glue, tracing
from petstore import migrations as _migrations

_env = os.environ.get


def _remove_own_metrics_dir(directory: str, master: int) -> None:
    """Remove the metrics directory the master made, when the master exits."""
    # The workers are forks that exit through sys.exit too: only the master removes it.
    if os.getpid() == master:
        shutil.rmtree(directory, ignore_errors=True)


# However the master exits: a refused setting (below), a port in use, SIGTERM.
if os.environ.get("PETSTORE_OWN_METRICS_DIR") == os.environ["PROMETHEUS_MULTIPROC_DIR"]:
    atexit.register(_remove_own_metrics_dir, os.environ["PROMETHEUS_MULTIPROC_DIR"], os.getpid())


# The exit statuses of a refusal: a bad or missing setting is the operator's input (2, as a
# refused command line), a database behind the code is the release's order (1). A supervisor
# (systemd, Kubernetes) restarts neither into success; the status says which to fix.
BAD_SETTING = 2
SCHEMA_BEHIND = 1


def _refuse(message: str, status: int = BAD_SETTING) -> None:
    """One line naming the setting, then exit: before gunicorn binds, logs or boots anything.

    The metrics directory made above goes too: on_exit, which removes it otherwise, never runs.
    """
    if os.environ.get("PETSTORE_OWN_METRICS_DIR") == os.environ["PROMETHEUS_MULTIPROC_DIR"]:
        shutil.rmtree(os.environ["PROMETHEUS_MULTIPROC_DIR"], ignore_errors=True)
    print(f"petstore: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


def _count(name: str, default: int) -> int:
    """A positive whole number from the environment variable `name`, else `default`."""
    text = _env(name, "")
    if text == "":
        return default
    if not text.isdigit() or int(text) < 1:
        _refuse(f"{name}={text!r} is not valid: expected a whole number of at least 1")
    return int(text)


# The service's own settings (petstore.config) are checked here too, so that a bad one is one
# line in the master rather than a traceback in every worker.
try:
    _settings = _config.from_environ()
    _config.check(_settings)
except _config.ConfigError as _exc:
    _refuse(str(_exc))

# OTEL_TRACES_EXPORTER and its protocol, and the extra they need (petstore.tracing).
_tracing_refused = tracing.refusal()
if _tracing_refused:
    _refuse(_tracing_refused)

# Code newer than the database's schema does not start: before gunicorn binds, so that during a
# release (USR2) the old master keeps serving and a new host never joins nginx's upstreams.
_missing = _migrations.refusal(_settings)
if _missing:
    _refuse(_missing, SCHEMA_BEHIND)

# gunicorn's refusals (a request it cannot parse) are the Error JSON, not its HTML page. Set here,
# in the master, so that every worker inherits it.
gunicorn_glue.use_json_refusals()

# BIND: the address nginx proxies to; several, comma-separated, are allowed.
bind = _env("BIND", "127.0.0.1:8000").split(",")

# The defaults: with a shared storage (redis://), sync workers, one per core + 1. `make bench`
# compares the serving configurations through nginx (the reports in bench/results/): with the
# key cache a request waits on the database once, so the workers are busy on the CPU, and one per
# core + 1 answered more than gunicorn's usual 2 per core + 1 in every run, with less CPU per
# request; gthread workers save nginx its new upstream connections but did not answer more
# (bench/results/2026-11-28-churn/configs.md: fewer creates, and no read clearly more).
# memory:// counts in one process, so it gets one gthread worker with 4 threads.
_shared_storage = not _env("RATELIMIT_STORAGE_URI", "memory://").startswith("memory://")
# GUNICORN_WORKER_CLASS: sync (one request at a time per worker) or gthread (threads).
_worker = _env("GUNICORN_WORKER_CLASS", "sync" if _shared_storage else "gthread")
# WEB_CONCURRENCY: worker processes.
workers = _count("WEB_CONCURRENCY", multiprocessing.cpu_count() + 1 if _shared_storage else 1)
# PETSTORE_THREADS: threads per worker (a sync worker given more than one is a gthread worker,
# as gunicorn would make it); each thread may hold one pooled connection, so the pool is sized
# to match unless PETSTORE_DB_POOL_SIZE says otherwise.
threads = _count("PETSTORE_THREADS", 1 if _worker == "sync" else 4)
if _worker == "sync" and threads > 1:
    _worker = "gthread"
os.environ.setdefault("PETSTORE_DB_POOL_SIZE", str(threads))
# Both are gunicorn's, except that a stopping worker stops listening at once (petstore.gunicorn_glue);
# another class named here is used as it is.
worker_class = {
    "sync": "petstore.gunicorn_glue.SyncWorker",
    "gthread": "petstore.gunicorn_glue.ThreadWorker",
}.get(_worker, _worker)

# GUNICORN_TIMEOUT: a worker silent this long is killed and replaced. Requests themselves are
# bounded far below it (pool wait, statement timeout, Redis timeout).
timeout = _count("GUNICORN_TIMEOUT", 30)
# GUNICORN_GRACEFUL_TIMEOUT: on SIGTERM, running requests get this long to finish.
graceful_timeout = _count("GUNICORN_GRACEFUL_TIMEOUT", 20)
# Behind nginx with upstream keepalive: keep idle connections a little longer than nginx does.
keepalive = _count("GUNICORN_KEEPALIVE", 75)

# Request head limits, the same as nginx's (large_client_header_buffers 4 8k in
# deploy/nginx/petstore.conf), so that the same request is refused the same way by either:
# a request line over 8190 bytes is a 414, a header line over 8190 bytes or more than 100
# header fields a 431 (nginx has no count of its own; it adds 3 or 4 fields when it forwards).
limit_request_line = 8190
limit_request_field_size = 8190
limit_request_fields = 100

# Which proxy headers to believe is the app's decision alone (PETSTORE_PROXY_COUNT, ProxyFix).
# gunicorn's own reading of X-Forwarded-Proto/-Ssl/-Protocol from a loopback peer would let a
# client's header set the scheme, or refuse a request whose headers disagree (400).
secure_scheme_headers: dict[str, str] = {}
# Nor may a SCRIPT_NAME or PATH_INFO header move the app (nginx sets neither).
forwarder_headers = ""

# The app writes one JSON line per request (petstore.logs); gunicorn's own access log is off (and
# its logger class does not even build the lines, see petstore.gunicorn_glue.NoAccessLogger), and
# its error log goes to stdout in the same JSON format, in batches (petstore.logs.StdoutHandler).
accesslog = None
logger_class = "petstore.gunicorn_glue.NoAccessLogger"
errorlog = "-"
loglevel = _env("PETSTORE_LOG_LEVEL", "info").lower()
logconfig_dict = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"json": {"()": "petstore.logs.JSONFormatter"}},
    "handlers": {
        "stdout": {
            "class": "petstore.logs.StdoutHandler",
            "formatter": "json",
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


def on_starting(server: Any) -> None:
    """Before any worker: empty the metrics directory, as prometheus_client requires.

    Not in a master that USR2 started (gunicorn tells it GUNICORN_PID, its parent's pid): the
    old master's workers still serve and count there when the directory is a set one, and their
    gauges go when they exit (child_exit). An unset directory is the old master's own: gunicorn
    re-execs with the environment it started with, so the new master makes a fresh one.
    """
    directory = os.environ["PROMETHEUS_MULTIPROC_DIR"]
    os.makedirs(directory, exist_ok=True)
    if os.environ.get("GUNICORN_PID"):
        return
    for stale in glob.glob(os.path.join(directory, "*.db")):
        os.remove(stale)


def child_exit(server: Any, worker: Any) -> None:
    """A worker is gone: drop its gauges (pool, fallback) from the sums; its counters stay."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid, os.environ["PROMETHEUS_MULTIPROC_DIR"])


def post_fork(server: Any, worker: Any) -> None:
    """In the new worker, before it loads the app: its tracer provider, when OTEL_TRACES_EXPORTER
    asks for one (the batch processor's thread must be the worker's own; at exit the worker
    sends what it sampled, waiting at most tracing.EXIT_FLUSH_SECONDS)."""
    tracing.start()


def post_worker_init(worker: Any) -> None:
    """A worker has loaded the app: said in the log, where a release waits for it
    (deploy/install.sh), and, under systemd, to systemd.

    A worker still booting, or failing to, must not replace a serving one. Under systemd a master
    that USR2 started becomes the unit's main process now (deploy/petstore.service,
    NotifyAccess=all): gunicorn's own READY=1 names no pid, and systemd stops the whole unit when
    the process it knows as the main one exits, so without this the old master's TERM would take
    the new one with it. Not earlier: a new release whose workers cannot load the app leaves the
    old master the main process, serving. Without NOTIFY_SOCKET, sd_notify does nothing.
    """
    worker.log.info("Worker booted (pid: %s)", worker.pid)
    # Set in the master that USR2 started until its parent, the old master, is gone.
    if os.environ.get("GUNICORN_PID"):
        from gunicorn import systemd

        systemd.sd_notify(f"MAINPID={worker.ppid}", worker.log)


def _read_env_file(path: str) -> dict[str, str]:
    """The NAME=value lines of an environment file, a value in quotes unquoted (blank lines and
    # comments skipped), as systemd's EnvironmentFile and bash read the simple ones."""
    settings = {}
    with open(path, encoding="utf-8") as file:
        for line in file:
            line = line.strip()
            if line and not line.startswith("#") and "=" in line:
                name, _, value = line.partition("=")
                value = value.strip()
                if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"":
                    value = value[1:-1]
                settings[name.strip()] = value
    return settings


def pre_exec(server: Any) -> None:
    """USR2, in the child that is about to become the new master: run the release `current`
    leads to now, in its own venv, with the settings of PETSTORE_ENV_FILE as they are now.

    gunicorn re-execs sys.executable with sys.argv (START_CTX), so a master started as
    /opt/petstore/current/venv/bin/gunicorn would run every later release on the first one's
    interpreter and dependencies, and fail once that release is deleted. The script's folder is
    resolved now, and the interpreter of the same name there runs the same script path (so that
    the next USR2 resolves `current` again); the environment the new master gets (gunicorn's
    env_orig, that of the first start) is updated from the file.

    Whatever fails here ends this child alone (os._exit): an exception would take gunicorn's
    clean-up path in this fork of the master, which stops the serving workers and removes the
    master's pid file.
    """
    try:
        script = os.path.join(server.START_CTX["cwd"], server.START_CTX["args"][1])
        python = os.path.join(
            os.path.realpath(os.path.dirname(script)), os.path.basename(sys.executable)
        )
        if os.path.basename(script) == "gunicorn" and os.path.exists(python):
            server.START_CTX[0] = python
            server.START_CTX["args"] = [python, script, *server.START_CTX["args"][2:]]
        if not os.access(server.START_CTX[0], os.X_OK):
            raise OSError(f"{server.START_CTX[0]} is not an interpreter this user may run")
        if os.environ.get("PETSTORE_ENV_FILE"):
            server.cfg.env_orig.update(_read_env_file(os.environ["PETSTORE_ENV_FILE"]))
    except Exception as exc:
        server.log.error("USR2 refused, the running master serves on: %s", exc)
        logging.shutdown()
        os._exit(1)
