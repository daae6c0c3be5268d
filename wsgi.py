"""WSGI entry point: `gunicorn wsgi:app`, configured from the environment alone."""

from __future__ import annotations

import os

from petstore import create_app, logs

logs.configure(os.environ.get("PETSTORE_LOG_LEVEL", "INFO"))

app = create_app()
