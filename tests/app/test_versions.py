"""Which code and which schema a process serves: /healthz and /readyz say so."""

from __future__ import annotations

import configparser

from flask.testing import FlaskClient

from petstore import migrations
from tests.support.servers import ROOT


def setup_cfg_version() -> str:
    """The version setup.cfg gives the package."""
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg", encoding="utf-8")
    return parser["metadata"]["version"]


def test_healthz_reports_the_version_of_setup_cfg(client: FlaskClient) -> None:
    response = client.get("/healthz")

    assert response.status_code == 200
    assert response.get_json() == {"status": "ok", "version": setup_cfg_version()}


def test_readyz_reports_the_version_and_the_newest_migration_applied(client: FlaskClient) -> None:
    newest = migrations.migrations()[-1].name

    response = client.get("/readyz")

    assert response.status_code == 200
    assert response.get_json() == {
        "status": "ready",
        "version": setup_cfg_version(),
        "schema": newest.removesuffix(".sql"),
        "checks": {"postgres": "ok", "ratelimit_storage": "ok"},
    }
