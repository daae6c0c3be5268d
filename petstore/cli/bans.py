"""`petstore bans`: list and lift."""

from __future__ import annotations

import click

from petstore import audit
from petstore.cli import common
from petstore.queries import bans
from petstore.ratelimit.bans import clear_strikes

COLUMNS = {
    "key_id": "key",
    "prefix": "prefix",
    "banned_at": "banned at",
    "banned_until": "until",
    "seconds": "seconds",
    "state": "state",
}


group = click.Group("bans", help="Bans of keys that kept calling after 429.")


@group.command("list")
def bans_list() -> None:
    """Every ban, newest first: active ones and past ones."""
    with common.database() as conn:
        rows = bans.list_bans(conn)
    for row in rows:
        lifted = row["lifted_at"] and f"lifted {row['lifted_at']:{common.INSTANT}}"
        row["state"] = "active" if row["active"] else lifted or "ended"
    common.emit(rows, COLUMNS)


@group.command("lift")
@common.KEY_ID
@common.REASON
def bans_lift(key_id: int, reason: str | None) -> None:
    """End the key's active ban now, and forgive its strikes: it starts again from a full threshold.

    The key's row is stamped (strikes_forgiven_at): strikes counted before the stamp no longer
    count in any worker, whatever the limiter storage, memory:// included. A key with strikes but
    no active ban has them forgiven (exit status 0).
    """
    settings = common.load_settings()
    with common.database(settings) as conn, conn.transaction():
        stamps = bans.forgive_strikes(conn, key_id)
        if stamps is None:
            raise common.NoSuchKey(f"no key with id {key_id}: nothing lifted")
        lifted = bans.lift_bans(conn, key_id)
        audit.record(conn, "bans lift", key_id, reason)
    strikes = None
    if not settings["RATELIMIT_STORAGE_URI"].startswith("memory://"):
        try:
            # Forgiven by the stamp already; cleared too, so that nothing reads them again.
            strikes = clear_strikes(settings, key_id, stamps["before"])
        except Exception as exc:
            click.echo(
                f"the strikes of key {key_id} are forgiven but could not be cleared in the rate "
                f"limit storage ({type(exc).__name__}: {exc}); they expire with their window",
                err=True,
            )
    if lifted:
        click.echo(f"lifted the ban of key {key_id} and cleared its strikes")
    elif strikes:
        click.echo(
            f"key {key_id} has no active ban; cleared its {strikes} "
            f"strike{'s' if strikes != 1 else ''}: it starts again from a full threshold"
        )
    elif strikes is None:
        click.echo(
            f"key {key_id} has no active ban; its strikes, if any, no longer count in any "
            "worker: it starts again from a full threshold"
        )
    else:
        raise common.NothingToDo(f"key {key_id} has no active ban and no strikes: nothing to do")
