"""The Animal Store service: create_app() builds the WSGI application.

The background work of each worker (each process that runs create_app), in one place: every
thread a worker runs, what it owns and how it stops. All are daemon threads, so none holds up an
exit; what must not be lost at exit is written by an atexit hook instead. Our own loops run
through periodic.every.

- psycopg_pool's workers (db.open_pool; standbys.init_app for the read pool): they open, check
  and replace the pool's connections. They stop when the pool is closed, or with the process.
- petstore-metrics-sampler (metrics.sample_while_open, in multiprocess mode): writes the
  worker's tally and gauges every SAMPLE_SECONDS; it ends when its pool is closed or its app is
  gone, and atexit writes the last second (metrics.flush).
- petstore-usage-flusher (usage.flush_while_open): writes the worker's usage counts every
  USAGE_FLUSH_SECONDS, each batch under durable_write; it ends when its pool is closed or its app
  is gone, and atexit writes the last batch within a bound (usage.flush_at_exit).
- petstore-commit-watch (durable.CommitWatch, started by the first write): cancels a write still
  running past its bound, each cancel in a short-lived thread of its own; it lives as long as
  the process, and owns nothing that needs a goodbye.
- OtelBatchSpanRecordProcessor (the SDK's BatchSpanProcessor, only when OTEL_TRACES_EXPORTER
  asks: petstore.tracing.start, from gunicorn's post_fork): sends the sampled spans in batches;
  at exit petstore-trace-flush sends the rest, the exit waiting for it at most
  tracing.EXIT_FLUSH_SECONDS.
- petstore-log-writer (logs.write_while_open, when the request log is buffered): writes the
  pending log lines every FLUSH_SECONDS; it ends when its handler is closed or gone.
- petstore-leases (ratelimit.leases.sweep_in_this_process, on Redis with the fixed window): gives
  back idle leases and notes the worker's heartbeat every SWEEP_SECONDS; it ends with its
  limiter, and atexit gives the leases back within a bound (leases.give_back_at_exit).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flask import Flask
from werkzeug.middleware.proxy_fix import ProxyFix

from petstore import (
    auth,
    config,
    db,
    durable,
    errors,
    metrics,
    pipeline,
    ratelimit,
    standbys,
    usage,
    views,
)
from petstore.views import docs, health, root
from petstore.views import metrics as metrics_view
from petstore.web import API_PREFIX


def create_app(
    overrides: Mapping[str, Any] | None = None, *, settings: Mapping[str, Any] | None = None
) -> Flask:
    """The app, configured from `settings` (every setting, as config.from_environ parsed them:
    wsgi passes its checked ones, so a process parses the environment once), else from the
    environment; then from `overrides` (tests and bench pass some)."""
    app = Flask(__name__)
    # Edges, decided (docs/usage.rst, "Errors"), before any route exists: `/v1//pets` names no
    # resource (404), rather than an HTML 308 to a Location built from the client's Host; and no
    # automatic OPTIONS (an empty text/html 200): without CORS it is a 405 like any other method.
    app.url_map.merge_slashes = False
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False
    app.json.sort_keys = False  # type: ignore[attr-defined]  # keep the schema field order
    app.config.update(config.from_environ() if settings is None else settings)
    if overrides:
        app.config.update(overrides)
    config.check(app.config)

    if app.config["PROXY_COUNT"]:
        # Trust X-Forwarded-For/-Proto/-Host from exactly this many proxies, no more.
        app.wsgi_app = ProxyFix(  # type: ignore[method-assign]
            app.wsgi_app,
            x_for=app.config["PROXY_COUNT"],
            x_proto=app.config["PROXY_COUNT"],
            x_host=app.config["PROXY_COUNT"],
        )

    errors.init_app(app)
    db.init_app(app)
    standbys.init_app(app)
    durable.init_app(app)
    auth.init_app(app)
    ratelimit.init_app(app)
    # The request path, in order (petstore/pipeline.py):
    # identify → count → refuse banned → require a key → require a scope → view → headers → log
    # (and metrics)
    pipeline.init_app(app)

    app.register_blueprint(health.bp)
    app.register_blueprint(root.bp)
    app.register_blueprint(metrics_view.bp)
    for resource in views.RESOURCES:
        app.register_blueprint(resource, url_prefix=API_PREFIX)
    # The OpenAPI document, built once here, describes the resources and their operations.
    app.register_blueprint(docs.bp, url_prefix=API_PREFIX, resources=views.RESOURCES)
    # Requests are counted by the operationId of their route (metrics.OTHER_ENDPOINTS elsewhere).
    metrics.init_app(app, views.operation_ids(app))
    # Requests per key and hour, written in batches (petstore.usage).
    usage.init_app(app)
    return app
