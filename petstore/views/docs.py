"""The API description, no key needed: /v1/openapi.json and a Swagger UI page at /v1/docs.

The document is the same bytes for every request, and as `petstore openapi` prints them: its
servers come from the settings only, never from a Host or forwarding header (a cache in front
would keep a poisoned one). Without PETSTORE_BASE_URL its server is the relative /v1, which
Swagger UI resolves against the page's own address, so "Try it out" calls this server.
"""

from __future__ import annotations

import json
from importlib import metadata, resources
from pathlib import Path

from flask import Blueprint, Response, abort, current_app, redirect, send_from_directory, url_for
from flask.blueprints import BlueprintSetupState
from markupsafe import escape

from petstore import openapi
from petstore.auth import public

bp = Blueprint("docs", __name__)

# Swagger UI's files, as shipped in the flask-swagger-ui wheel: served from here, never a CDN.
ASSETS_PACKAGE = "flask_swagger_ui"
ASSETS_DISTRIBUTION = "flask-swagger-ui"
ASSETS = frozenset(("swagger-ui.css", "swagger-ui-bundle.js", "favicon-32x32.png"))
ASSET_MAX_AGE = 86400
EXTENSION = "petstore.openapi_json"

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


@bp.record_once
def store_document(state: BlueprintSetupState) -> None:
    """Build the document's JSON once per app, when the blueprint is registered with the resources
    it describes (`resources=petstore.views.RESOURCES`, see create_app)."""
    document = openapi.build_document(state.app.config, state.options["resources"])
    state.app.extensions[EXTENSION] = openapi.to_json(document)


@bp.get("/openapi.json")
@public
def openapi_json() -> Response:
    """The OpenAPI document of this API."""
    return current_app.response_class(
        current_app.extensions[EXTENSION], mimetype="application/json"
    )


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
    assets = Path(str(resources.files(ASSETS_PACKAGE).joinpath("dist")))
    return send_from_directory(assets, name, max_age=ASSET_MAX_AGE)


def asset_url(name: str) -> str:
    """The URL of one of Swagger UI's files, with the package version so that upgrades bust caches."""
    return url_for("docs.docs_asset", name=name, v=metadata.version(ASSETS_DISTRIBUTION))
