"""The Animal Store service: create_app() builds the WSGI application."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flask import Flask

from petstore import auth, config, db, errors
from petstore.views import health, orders, pets


def create_app(settings: Mapping[str, Any] | None = None) -> Flask:
    """The app, configured from the environment and then from `settings` (tests pass overrides)."""
    app = Flask(__name__)
    app.json.sort_keys = False  # type: ignore[attr-defined]  # keep the schema field order
    app.config.update(config.from_environ())
    if settings:
        app.config.update(settings)
    config.check(app.config)

    errors.init_app(app)
    db.init_app(app)
    auth.init_app(app)

    app.register_blueprint(health.bp)
    app.register_blueprint(pets.bp, url_prefix="/v1")
    app.register_blueprint(orders.bp, url_prefix="/v1")
    return app
