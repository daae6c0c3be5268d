"""The API description, no key needed: /v1/openapi.json and a Swagger UI page at /v1/docs.

Without PETSTORE_BASE_URL the document's first server is the one it was fetched from, so that
Swagger UI's "Try it out" calls this server, on any port and behind a proxy (with
PETSTORE_PROXY_COUNT, the address the client used).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import metadata, resources
from pathlib import Path
from typing import Any

from flask import (
    Blueprint,
    Response,
    abort,
    current_app,
    redirect,
    request,
    send_from_directory,
    url_for,
)
from flask.blueprints import BlueprintSetupState
from markupsafe import escape

from petstore import openapi
from petstore.auth import public
from petstore.web import API_PREFIX

bp = Blueprint("docs", __name__)

# Swagger UI's files, as shipped in the flask-swagger-ui wheel: served from here, never a CDN.
ASSETS_PACKAGE = "flask_swagger_ui"
ASSETS_DISTRIBUTION = "flask-swagger-ui"
ASSETS = frozenset(("swagger-ui.css", "swagger-ui-bundle.js", "favicon-32x32.png"))
ASSET_MAX_AGE = 86400
EXTENSION = "petstore.openapi_json"
# The Host header is the client's to choose: keep the JSON of this many base URLs, no more.
MAX_CACHED_BASES = 16

PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>Animal Store API {api_version}</title>
  <link rel="stylesheet" href="{css}">
  <link rel="icon" type="image/png" href="{icon}" sizes="32x32">
</head>
<body>
  <div id="swagger-ui"></div>
  <script src="{js}"></script>
  <script>
    window.ui = SwaggerUIBundle({{
      url: {document},
      dom_id: "#swagger-ui",
      deepLinking: true,
      displayOperationId: true,
      validatorUrl: null
    }});
  </script>
</body>
</html>
"""


def assets_dir() -> Path:
    """The folder of Swagger UI's files inside the installed flask-swagger-ui package."""
    return Path(str(resources.files(ASSETS_PACKAGE).joinpath("dist")))


class Documents:
    """The document, built once per app; its JSON per first server, since that follows the request."""

    def __init__(self, document: dict[str, Any], config: Mapping[str, Any]) -> None:
        self.document = document
        self.config = config
        self.texts: dict[str, str] = {}

    def text_for(self, base_url: str) -> str:
        """The JSON of the document as fetched from `base_url` (ignored when PETSTORE_BASE_URL is set)."""
        if self.config.get("PUBLIC_BASE_URL"):
            base_url = ""
        text = self.texts.get(base_url)
        if text is None:
            document = {**self.document, "servers": openapi.servers(self.config, base_url)}
            text = openapi.to_json(document)
            if len(self.texts) >= MAX_CACHED_BASES:
                self.texts.clear()
            self.texts[base_url] = text
        return text


@bp.record_once
def store_document(state: BlueprintSetupState) -> None:
    """Build the document once per app, when the blueprint is registered with the operations it
    describes (`descriptions=petstore.views.described()`, see create_app)."""
    config = state.app.config
    document = openapi.build_document(config, state.options["descriptions"])
    state.app.extensions[EXTENSION] = Documents(document, config)


@bp.get("/openapi.json")
@public
def openapi_json() -> Response:
    """The OpenAPI document of this API, its first server the one it was fetched from."""
    documents: Documents = current_app.extensions[EXTENSION]
    text = documents.text_for(request.root_url.rstrip("/") + API_PREFIX)
    return current_app.response_class(text, mimetype="application/json")


@bp.get("/docs")
@public
def docs_page() -> Response:
    """Swagger UI, reading /v1/openapi.json."""
    page = PAGE.format(
        api_version=escape(openapi.API_VERSION),
        css=escape(asset_url("swagger-ui.css")),
        icon=escape(asset_url("favicon-32x32.png")),
        js=escape(asset_url("swagger-ui-bundle.js")),
        # A JS string literal; url_for percent-encodes, so no "<" can close the script.
        document=json.dumps(url_for("docs.openapi_json")),
    )
    return current_app.response_class(page, mimetype="text/html")


@bp.get("/docs/")
@public
def docs_page_slash() -> Response:
    """/v1/docs/, as people type it: a redirect to the page (relative, so right behind any proxy)."""
    return redirect(url_for("docs.docs_page"), 308, Response=current_app.response_class)  # type: ignore[return-value]


@bp.get("/docs/assets/<name>")
@public
def docs_asset(name: str) -> Response:
    """One of Swagger UI's files; the version in the query string only busts caches."""
    if name not in ASSETS:
        abort(404)
    return send_from_directory(assets_dir(), name, max_age=ASSET_MAX_AGE)


def asset_url(name: str) -> str:
    """The URL of one of Swagger UI's files, with the package version so that upgrades bust caches."""
    return url_for("docs.docs_asset", name=name, v=metadata.version(ASSETS_DISTRIBUTION))
