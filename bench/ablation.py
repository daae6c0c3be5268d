"""The service with flask-limiter switched off: how much of the distance to the floor it is.

Everything else is the service as deployed (wsgi.py): the same hooks, schemas, queries and log.
`make bench` runs it beside the floor and the service, also with the request log off
(PETSTORE_LOG_LEVEL=warning), to show where the distance goes. Not for production:

    gunicorn -c deploy/gunicorn.conf.py --pythonpath bench ablation:app
"""

from __future__ import annotations

import os

from petstore import create_app, logs

logs.configure(os.environ.get("PETSTORE_LOG_LEVEL", "INFO"))

app = create_app({"RATELIMIT_ENABLED": False})
