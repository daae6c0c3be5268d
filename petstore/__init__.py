"""The Animal Store service: create_app() builds the WSGI application."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flask import Flask
from werkzeug.middleware.proxy_fix import ProxyFix

from petstore import auth, config, db, errors, limits, logs, metrics
from petstore.views import docs, health, orders, pets
from petstore.views import metrics as metrics_view
from petstore.web import API_PREFIX


def create_app(settings: Mapping[str, Any] | None = None) -> Flask:
    """The app, configured from the environment and then from `settings` (tests pass overrides)."""
    app = Flask(__name__)
    app.json.sort_keys = False  # type: ignore[attr-defined]  # keep the schema field order
    app.config.update(config.from_environ())
    if settings:
        app.config.update(settings)
    config.check(app.config)

    if app.config["PROXY_COUNT"]:
        # Trust X-Forwarded-For/-Proto/-Host from exactly this many proxies, no more.
        app.wsgi_app = ProxyFix(  # type: ignore[method-assign]
            app.wsgi_app,
            x_for=app.config["PROXY_COUNT"],
            x_proto=app.config["PROXY_COUNT"],
            x_host=app.config["PROXY_COUNT"],
        )

    logs.init_app(app)
    errors.init_app(app)
    db.init_app(app)
    # The order of the request hooks matters: who is calling (never refuses), then their
    # budget (per key, or per IP for the unidentified), then the refusal of the unidentified.
    app.before_request(auth.identify_caller)
    limits.init_app(app)
    app.before_request(auth.require_caller)
    metrics.init_app(app)

    app.register_blueprint(health.bp)
    app.register_blueprint(metrics_view.bp)
    app.register_blueprint(pets.bp, url_prefix=API_PREFIX)
    app.register_blueprint(orders.bp, url_prefix=API_PREFIX)
    app.register_blueprint(docs.bp, url_prefix=API_PREFIX)
    return app
