"""The `petstore` command: a module per group (db, keys, bans, usage and audit, serve and openapi),
and common.py, what they share."""

from __future__ import annotations

import click

from petstore.cli import bans, db, keys, serve, usage

COMMANDS = [db.group, keys.group, bans.group, usage.usage, usage.audit, serve.serve, serve.openapi]


@click.group(commands=COMMANDS)
def main() -> None:
    """The Animal Store service."""
