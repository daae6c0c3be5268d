"""`petstore serve` (make run's server: petstore/dev/) and `petstore openapi`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from petstore import migrations, views
from petstore.cli import common
from petstore.openapi import build_document, to_json


@click.command("serve")
@click.option("--bind", envvar="BIND", default="127.0.0.1:8000", show_default=True)
@click.option(
    "--var-dir",
    envvar="PETSTORE_VAR_DIR",
    default="var",
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the embedded PostgreSQL keeps its data.",
)
def serve(bind: str, var_dir: Path) -> None:
    """Development server: database (embedded unless DATABASE_URL), migrations, a key, gunicorn.

    Refuses, in one line and before touching anything, a bad setting, another `make run` of this
    checkout, and an address another program listens on (petstore/dev/server.py).
    """
    common.load_settings(check=False)
    # Imported here only: no operator command loads the dev server or the embedded PostgreSQL.
    from petstore.dev import server

    given = bool(os.environ.get("DATABASE_URL"))
    with server.serving(bind, var_dir):
        if not given:  # for the commands run beside make run (load_settings)
            url = os.environ["DATABASE_URL"]
            (var_dir.resolve() / common.RECORDED_URL).write_text(url + "\n", encoding="utf-8")
        settings = common.load_settings()
        kept_in = var_dir.resolve() / server.DEV_KEY_FILE
        with common.database(settings) as conn:
            migrations.upgrade(conn, migrations.Limits.from_settings(settings))
            key, key_id, kept = server.development_key(conn, kept_in)
        server.print_welcome(settings["DATABASE_URL"], given, bind, key, key_id, kept, kept_in)
        sys.stdout.flush()
        sys.exit(server.run_gunicorn(bind))


@click.command("openapi")
def openapi() -> None:
    """Print the OpenAPI document that GET /v1/openapi.json serves (JSON; no database needed)."""
    settings = common.load_settings(check=False)
    click.echo(to_json(build_document(settings, views.RESOURCES)), nl=False)
