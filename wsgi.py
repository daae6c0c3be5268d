"""WSGI entry point: `gunicorn wsgi:app`, configured from the environment alone."""

from __future__ import annotations

import logging

from petstore import create_app

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

app = create_app()
